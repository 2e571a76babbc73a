"""Dev harness for tests and benchmarks; not part of the sglang-hs wheel."""
