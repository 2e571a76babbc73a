"""SpecForge 0.2.0's and speculators 0.9.0's own entry points, each run in a child process:

    python -m harness.trainers specforge train --config X.yaml [training.KEY=VALUE ...]
    python -m harness.trainers to_sglang --checkpoint RUN --draft-config C.json --output-dir D
    python -m harness.trainers speculators --data-path D --verifier-name-or-path M [...]

Shims, named so a result can say which applied:
  F1 (no CUDA only): its `LogSoftmaxLoss` is a Triton kernel; the same loss in torch.
  F2 (no `datasets` installed only, the GPU host): SpecForge imports `datasets.Dataset` at
     module level for its online path; the offline path never builds one, so a stub that
     raises if it ever does stands in.
  S1 (no CUDA only): speculators' Trainer puts the draft and each batch on `get_local_rank()`,
     an int (cuda:N); on CPU that device is "cpu".
  S2 (no CUDA only): its step timer calls `torch.accelerator.synchronize`; a no-op on CPU.
The trainers live in .cache/trainers (`make venv`) or wherever SGLANG_HS_TRAINERS points."""

from __future__ import annotations

import ast
import os
import re
import sys
import types
from typing import List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINERS = os.environ.get("SGLANG_HS_TRAINERS", os.path.join(REPO, ".cache", "trainers"))
# SpecForge prints one line per logged step: "step N: {'loss': ..., 'acc_0': ..., ...}".
STEP_LINE = re.compile(r"^step \d+: (\{.*\})$", re.M)
SHIMS_LINE = "harness.trainers shims applied: "


def specforge_cmd(*argv: str) -> List[str]:
    return [sys.executable, "-m", "harness.trainers", "specforge", *argv]


def to_sglang_cmd(*argv: str) -> List[str]:
    return [sys.executable, "-m", "harness.trainers", "to_sglang", *argv]


def specforge_steps(stdout: str) -> List[dict]:
    return [ast.literal_eval(m.group(1)) for m in STEP_LINE.finditer(stdout)]


def shims_applied(stdout: str) -> List[str]:
    """The shims a child said it applied (F1, F2; see the module docstring)."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith(SHIMS_LINE)]
    return ast.literal_eval(lines[0][len(SHIMS_LINE):]) if lines else []


def speculators_cmd(*argv: str) -> List[str]:
    return [sys.executable, "-m", "harness.trainers", "speculators", *argv]


def speculators_shims() -> List[str]:
    import torch

    sys.path.append(TRAINERS)
    applied = []
    if not torch.cuda.is_available():
        import speculators.train.trainer as trainer

        trainer.get_local_rank = lambda: "cpu"
        torch.accelerator.synchronize = lambda *a, **k: None
        applied += ["S1", "S2"]
    print(f"{SHIMS_LINE}{applied}", flush=True)
    return applied


def _shims() -> List[str]:
    import torch

    sys.path.append(TRAINERS)
    applied = []
    try:
        import datasets  # noqa: F401
    except ImportError:
        class Dataset:
            def __init__(self, *a, **k):
                raise RuntimeError("harness.trainers F2: `datasets` is a stub here (offline path only)")

        stub = types.ModuleType("datasets")
        stub.Dataset = Dataset
        sys.modules["datasets"] = stub
        applied.append("F2")
    if not torch.cuda.is_available():
        import specforge.algorithms.eagle3.model as eagle3

        class EagerLogSoftmaxLoss:  # F1: mean over positions of -sum(p * log_softmax(logits)), masked
            @staticmethod
            def apply(logits, target, position_mask):
                lp = torch.log_softmax(logits.float(), dim=-1)
                return (-(target.float() * lp).sum(-1) * position_mask.reshape(logits.shape[:2]).float()).mean()

        eagle3.LogSoftmaxLoss = EagerLogSoftmaxLoss
        applied.append("F1")
    print(f"{SHIMS_LINE}{applied}", flush=True)
    return applied


if __name__ == "__main__":
    cmd, argv = sys.argv[1:2], sys.argv[2:]
    if cmd == ["specforge"]:
        _shims()
        from specforge.cli import main
    elif cmd == ["to_sglang"]:
        _shims()
        from specforge.export.to_sglang import main
    elif cmd == ["speculators"]:
        speculators_shims()
        from speculators.train.cli import main as train
        from speculators.train.config import TrainConfig

        def main(argv):
            return train(TrainConfig.resolve(argv))
    else:
        sys.exit(__doc__)
    sys.exit(main(argv))
