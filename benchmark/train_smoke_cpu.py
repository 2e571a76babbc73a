"""Training smoke on CPU: SmolLM2-135M-Instruct states exported by SGLang, converted, and
trained for a few optimiser steps by each trainer's own EAGLE-3 entry point.

1. A SmolLM2 CPU server with export on; `sglang-hs capture` of the first --samples bundled
   chats (chat-template masks); `convert --to specforge` and `--to speculators`.
2. speculators 0.9.0: its trainer CLI (`speculators.train.cli.main`) with `--data-path` our
   folder and flags only (`--draft-attn-impl sdpa --loss-implementation eager --num-workers 0`,
   all CPU-safe choices it offers), plus two shims, because it assumes a GPU:
     shim S1: `speculators.train.trainer.get_local_rank` -> "cpu" (it moves the model and the
              batches to `local_rank`, an int, i.e. cuda:0);
     shim S2: `torch.accelerator.synchronize` -> no-op (its step timer syncs the GPU).
3. SpecForge 0.2.0: `specforge train --config DEST/specforge.yaml` (the file `convert` wrote)
   with overrides only (`training.fsdp_sharding=NO_SHARD`, steps, logging), through
   harness.trainers and its one CPU shim (F1: its Triton `LogSoftmaxLoss`, the same value in torch).
Each trainer's per-step loss and step-0 accuracy are read from its own metric output.
Writes benchmark/results/train_smoke_cpu.json.

    .venv/bin/python benchmark/train_smoke_cpu.py [--samples 64] [--steps 30] [--speculators-epochs 8]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import resources

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from harness.trainers import shims_applied, specforge_cmd, specforge_steps, speculators_shims  # noqa: E402


def run_speculators(argv, metrics_path):
    """In a child process: speculators' own trainer CLI with shims S1 and S2 (harness.trainers)."""
    speculators_shims()
    import speculators.train.cli as cli
    from speculators.train.config import TrainConfig

    setup = cli.setup_metric_logger

    class Record(logging.Handler):  # its metrics are dicts on the "speculators.metrics" logger
        def emit(self, record):
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record.msg, default=str) + "\n")

    def setup_and_record(*a, **k):
        setup(*a, **k)
        logging.getLogger("speculators.metrics").addHandler(Record())

    cli.setup_metric_logger = setup_and_record
    cli.main(TrainConfig.resolve(argv))


def capture_and_convert(work: str, samples: int) -> dict:
    from sglang_hs.tools import models
    from sglang_hs.tools.capture import CaptureConfig, capture
    from sglang_hs.tools.convert import inspect_export, to_specforge, to_speculators
    from sglang_hs.tools.serve import LocalServer

    model = models.smollm2(os.path.join(REPO, ".cache", "models", "smollm2-135m-instruct"))
    out = os.path.join(work, "export")
    data = str(resources.files("sglang_hs").joinpath("data/chats_200.jsonl"))
    # float32: this CPU has no bf16 matrix units; the smoke is about the data path and training.
    args = ["--model-path", model, "--export-hidden-states-dir", out, "--dtype", "float32", "--skip-server-warmup"]
    with LocalServer(args, os.path.join(work, "server.log")) as srv:
        summ = capture(CaptureConfig(servers=[srv.url], data=data, out=out, limit=samples, concurrency=8,
                                     progress=False))
    sf = to_specforge(out, os.path.join(work, "specforge"))
    sp = to_speculators(out, os.path.join(work, "speculators"))
    info = inspect_export(out)
    return {"model": model, "capture": summ.line(), "samples": info["samples"], "tokens": info["tokens"],
            "specforge_convert": sf.line(), "speculators_convert": sp.line()}


def train_speculators(work: str, model: str, epochs: int, extra=()) -> dict:
    # Its --max-steps ends an epoch, not the run (each later epoch still takes a step and a
    # validation pass), so the run is bounded by epochs.
    metrics = os.path.join(work, "speculators-metrics.jsonl")
    cmd = [sys.executable, __file__, "--child-speculators", metrics, "--data-path", os.path.join(work, "speculators"),
           "--verifier-name-or-path", model, "--draft-vocab-size", "8192", "--save-path",
           os.path.join(work, "speculators-out"), "--epochs", str(epochs),
           "--total-seq-len", "2048", "--log-freq", "1", "--num-workers", "0", "--draft-attn-impl", "sdpa",
           "--loss-implementation", "eager", "--lr", "1e-3", *extra]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    rows = [json.loads(x) for x in open(metrics)] if os.path.exists(metrics) else []
    train = [x for x in rows if "train" in x]
    return {"returncode": r.returncode, "seconds": round(time.time() - t0, 1), "command": cmd[3:],
            "shims": ["S1 get_local_rank -> 'cpu'", "S2 torch.accelerator.synchronize -> no-op"],
            "loss": [x["train"].get("loss") for x in train],
            "step0_accuracy": [x["train"].get("full_acc_0") for x in train],
            "log_tail": (r.stdout + r.stderr)[-3000:] if r.returncode else ""}


def train_specforge(work: str, steps: int) -> dict:
    cmd = specforge_cmd("train", "--config", os.path.join(work, "specforge", "specforge.yaml"),
                        "training.fsdp_sharding=NO_SHARD", f"training.max_steps={steps}", "training.log_interval=1",
                        "training.learning_rate=1e-3", "training.warmup_ratio=0.0", "training.lr_scheduler=constant",
                        f"output_dir={os.path.join(work, 'specforge-out')}",
                        f"data.cache_dir={os.path.join(work, 'sf-cache')}")
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    steps_seen = specforge_steps(r.stdout)
    return {"returncode": r.returncode, "seconds": round(time.time() - t0, 1), "command": cmd[3:],
            "shims": shims_applied(r.stdout),
            "loss": [s.get("loss") for s in steps_seen], "step0_accuracy": [s.get("acc_0") for s in steps_seen],
            "log_tail": (r.stdout + r.stderr)[-3000:] if r.returncode else ""}


def summarise(run: dict) -> dict:
    loss = [x for x in run["loss"] if x is not None]
    acc = [x for x in run["step0_accuracy"] if x is not None]
    k = max(1, len(loss) // 5)
    first, last = sum(loss[:k]) / k if loss else None, sum(loss[-k:]) / k if loss else None
    return {"steps": len(loss), "loss_first_fifth": first, "loss_last_fifth": last,
            "loss_fell": bool(loss) and last < first, "step0_accuracy_last_fifth": sum(acc[-k:]) / k if acc else None,
            "step0_accuracy_above_zero": bool(acc) and max(acc[-k:]) > 0}


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--child-speculators":
        return run_speculators(sys.argv[3:], sys.argv[2])
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--steps", type=int, default=30, help="SpecForge optimiser steps")
    p.add_argument("--speculators-epochs", type=int, default=8, help="speculators epochs (about 4 steps each here)")
    p.add_argument("--out", default=os.path.join(REPO, "benchmark", "results", "train_smoke_cpu.json"))
    a = p.parse_args()
    from harness.bench import provenance

    work = tempfile.mkdtemp(prefix="train-smoke-", dir="/dev/shm")
    try:
        data = capture_and_convert(work, a.samples)
        runs = {"speculators": train_speculators(work, data["model"], a.speculators_epochs),
                "specforge": train_specforge(work, a.steps)}
    finally:
        shutil.rmtree(os.path.join(work, "export"), ignore_errors=True)
    result = {**provenance(sys.argv), "data": data, "trainers": {"speculators": "0.9.0", "specforge": "0.2.0"},
              "runs": runs, "summary": {k: summarise(v) for k, v in runs.items()}}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["summary"], indent=1))
    ok = all(v["returncode"] == 0 for v in runs.values()) and all(
        s["loss_fell"] and s["step0_accuracy_above_zero"] for s in result["summary"].values())
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
