"""sglang-hs: hidden-state export for EAGLE-3 drafter training, as an overlay on SGLang."""

__version__ = "0.1.0"
