"""Stand-in for `deep_gemm` (shim G1 in benchmark/e2e_eagle3.py): SGLang 0.5.17's EAGLE v2 worker
imports its DSA attention backend while it captures graphs, and that module imports `deep_gemm`
at import time. Nothing of it runs for a Llama target; any use raises AttributeError."""
