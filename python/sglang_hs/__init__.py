"""sglang-hs: hidden-state export for EAGLE-3 drafter training, as an overlay on SGLang.

Two sides share one file format (`format`) and one scheduler-to-HTTP protocol (`protocol`):
`overlay` runs inside SGLang's processes, `tools` are what people run.
"""

__version__ = "0.1.0"
