"""Storage on CPU: bytes per token, capture throughput and training, bf16 vs fp8 vs fp8 with
final rows at loss positions only, SmolLM2-135M-Instruct in its own dtype (bf16).

1. Three export servers side by side: `--export-dtype bf16`, `--export-dtype fp8_e4m3`, and
   `--export-dtype fp8_e4m3 --export-final-rows loss`. Each round sends the same slice of the
   bundled chats (chat-template masks) through `sglang-hs capture` to each server in turn (the
   order rotates every round); capture tokens/s per server and round, medians and spread.
2. Bytes per token of each export directory (what `inspect` reports), and the same formula
   computed for Kimi-K2.5's geometry (hidden 7168, 3 aux layers) at this data's loss fraction.
3. The same speculators 0.9.0 run (train_smoke_cpu.py's, same seed and steps) on each export,
   converted with `convert --to speculators` (fp8 stays fp8: its `--hidden-states-backend
   fp8`), plus the bf16 data with a second seed: the seed-to-seed spread is the noise.
Writes benchmark/results/storage_cpu.json (plot: benchmark/plot_storage.py).

    .venv/bin/python benchmark/storage_cpu.py [--rounds 3] [--per-round 48] [--epochs 6]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from importlib import resources

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmark"))

STORAGES = {"bf16": ["--export-dtype", "bf16"], "fp8": ["--export-dtype", "fp8_e4m3"],
            "fp8+loss": ["--export-dtype", "fp8_e4m3", "--export-final-rows", "loss"]}


def bytes_per_token(hidden: int, k_aux: int, loss_fraction: float, storage: str) -> float:
    """File bytes per token of the format (tensor data; the header is per file): token id (8)
    and loss mask (1), aux rows, final rows (all, or at loss positions with their position)."""
    if storage == "bf16":
        return 9 + (k_aux + 1) * hidden * 2
    aux = k_aux * (hidden + 4)
    final = hidden + 4
    if storage == "fp8":
        return 9 + aux + final
    return 9 + aux + loss_fraction * (final + 8)


def write_slices(work: str, rounds: int, per_round: int):
    src = str(resources.files("sglang_hs").joinpath("data/chats_200.jsonl"))
    lines = [x for x in open(src) if x.strip()]
    if rounds * per_round > len(lines):
        raise SystemExit(f"only {len(lines)} chats: lower --rounds or --per-round")
    paths = []
    for r in range(rounds):
        p = os.path.join(work, f"chats-{r}.jsonl")
        with open(p, "w") as f:
            f.writelines(lines[r * per_round:(r + 1) * per_round])
        paths.append(p)
    return paths


def capture_rounds(work: str, model: str, slices) -> dict:
    from contextlib import ExitStack

    from sglang_hs.tools.capture import CaptureConfig, capture
    from sglang_hs.tools.serve import LocalServer

    res = {name: {"rounds": []} for name in STORAGES}
    with ExitStack() as stack:
        servers = {}
        for name, flags in STORAGES.items():
            out = os.path.join(work, f"export-{name}")
            srv = stack.enter_context(LocalServer(
                ["--model-path", model, "--export-hidden-states-dir", out, "--skip-server-warmup", *flags],
                os.path.join(work, f"server-{name}.log")))
            servers[name] = (srv, out)
            res[name]["startup_s"] = round(srv.startup_s, 1)
        names = list(STORAGES)
        for name in names:  # the first forward of a fresh CPU server pays one-time setup
            servers[name][0].generate({"input_ids": [1, 2, 3], "sampling_params": {
                "max_new_tokens": 1, "custom_params": {"sglang_hs": {"export": False}}}}).raise_for_status()
        for r, data in enumerate(slices):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                srv, out = servers[name]
                t0 = time.perf_counter()
                summ = capture(CaptureConfig(servers=[srv.url], data=data, out=out, id_prefix=f"r{r}-",
                                             concurrency=8, progress=False))
                wall = time.perf_counter() - t0
                if summ.failed or summ.exported == 0:
                    raise SystemExit(f"capture to {name} failed: {summ.line()}")
                res[name]["rounds"].append({"round": r, "position_in_round": order.index(name),
                                            "samples": summ.exported, "tokens": summ.tokens,
                                            "seconds": round(wall, 2), "tokens_per_s": summ.tokens / wall})
                print(f"round {r} {name}: {summ.tokens / wall:.0f} tokens/s", flush=True)
    for name in names:
        tps = [x["tokens_per_s"] for x in res[name]["rounds"]]
        res[name]["tokens_per_s_median"] = statistics.median(tps)
        res[name]["tokens_per_s_min_max"] = [min(tps), max(tps)]
    for name in names[1:]:
        ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(res[name]["rounds"], res["bf16"]["rounds"])]
        res[name]["ratio_vs_bf16_per_round"] = ratios
        res[name]["ratio_vs_bf16_median"] = statistics.median(ratios)
    return res


def sizes(work: str) -> dict:
    from sglang_hs.format import iter_samples, load_sample
    from sglang_hs.tools.convert import inspect_export

    out = {}
    for name in STORAGES:
        d = os.path.join(work, f"export-{name}")
        info = inspect_export(d)
        loss = sum(int(load_sample(p)["loss_mask"].sum()) for _, p in iter_samples(d))
        out[name] = {"samples": info["samples"], "tokens": info["tokens"], "bytes": info["bytes"],
                     "bytes_per_token": info["bytes"] / info["tokens"], "loss_fraction": loss / info["tokens"]}
    for name in STORAGES:
        out[name]["vs_bf16"] = out[name]["bytes_per_token"] / out["bf16"]["bytes_per_token"]
    return out


def quality(work: str) -> dict:
    """Per plane: dequantized fp8 rows vs the bf16 export of the same sample (same ids)."""
    import torch

    from sglang_hs.format import decode_sample, iter_samples, load_sample

    ref = {e["id"]: p for e, p in iter_samples(os.path.join(work, "export-bf16"))}
    res = {}
    for name in ("fp8", "fp8+loss"):
        cos, se, ss = {}, {}, {}
        for e, p in iter_samples(os.path.join(work, f"export-{name}")):
            a, b = decode_sample(load_sample(p), torch.float32), decode_sample(load_sample(ref[e["id"]]), torch.float32)
            at = a.get("final_positions")
            pairs = {f"aux{j}": (a["aux_hidden_states"][:, j], b["aux_hidden_states"][:, j])
                     for j in range(a["aux_hidden_states"].shape[1])}
            pairs["final"] = (a["final_hidden_states"], b["final_hidden_states"] if at is None else b["final_hidden_states"][at])
            for k, (x, y) in pairs.items():
                if x.shape[0]:
                    cos.setdefault(k, []).append(torch.nn.functional.cosine_similarity(x, y, dim=-1))
                    se[k] = se.get(k, 0.0) + float((x - y).pow(2).sum())
                    ss[k] = ss.get(k, 0.0) + float(y.pow(2).sum())
        res[name] = {k: {"mean_cos": float(torch.cat(v).mean()), "min_cos": float(torch.cat(v).min()),
                         "rel_err": (se[k] / ss[k]) ** 0.5} for k, v in cos.items()}
    return res


def train(work: str, model: str, epochs: int) -> dict:
    from train_smoke_cpu import summarise, train_speculators

    from sglang_hs.tools.convert import to_speculators

    runs = {}
    for name, seed in (("bf16", 42), ("bf16", 43), ("fp8", 42), ("fp8+loss", 42)):
        conv = os.path.join(work, f"spec-{name}")
        if not os.path.exists(conv):
            to_speculators(os.path.join(work, f"export-{name}"), conv)
        run_dir = os.path.join(work, f"train-{name}-{seed}")
        os.makedirs(run_dir)
        os.symlink(conv, os.path.join(run_dir, "speculators"))
        extra = ["--seed", str(seed)] + (["--hidden-states-backend", "fp8"] if name != "bf16" else [])
        run = train_speculators(run_dir, model, epochs, extra)
        run["summary"] = summarise(run)
        runs[f"{name} seed {seed}"] = run
        print(f"train {name} seed {seed}: {run['summary']}", flush=True)
    return runs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--per-round", type=int, default=48, help="chats per round (each round a new slice)")
    p.add_argument("--epochs", type=int, default=6, help="speculators epochs per training run")
    p.add_argument("--out", default=os.path.join(REPO, "benchmark", "results", "storage_cpu.json"))
    a = p.parse_args()
    from harness.bench import provenance
    from sglang_hs.tools import models

    model = models.smollm2(os.path.join(REPO, ".cache", "models", "smollm2-135m-instruct"))
    work = tempfile.mkdtemp(prefix="storage-", dir="/dev/shm")
    try:
        slices = write_slices(work, a.rounds, a.per_round)
        cap = capture_rounds(work, model, slices)
        size = sizes(work)
        qual = quality(work)
        runs = train(work, model, a.epochs)
    finally:
        for name in STORAGES:
            shutil.rmtree(os.path.join(work, f"export-{name}"), ignore_errors=True)
    f = size["fp8+loss"]["loss_fraction"]
    kimi = {s: bytes_per_token(7168, 3, f, s) for s in STORAGES}
    result = {**provenance(sys.argv), "model": model, "rounds": a.rounds, "per_round": a.per_round,
              "capture": cap, "bytes": size, "quality_vs_bf16_export": qual,
              "kimi_k25_computed": {"hidden": 7168, "aux_layers": 3, "loss_fraction": f,
                                    "bytes_per_token": kimi, "vs_bf16": {s: v / kimi["bf16"] for s, v in kimi.items()},
                                    "tb_for_17_3m_tokens": {s: v * 17.3e6 / 1e12 for s, v in kimi.items()}},
              "training": {"trainer": "speculators 0.9.0", "epochs": a.epochs, "runs": runs}}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps({k: result[k] for k in ("bytes", "quality_vs_bf16_export", "kimi_k25_computed")}, indent=1))
    print(json.dumps({k: {"median": v["tokens_per_s_median"], "ratio": v.get("ratio_vs_bf16_median")}
                      for k, v in cap.items()}))


if __name__ == "__main__":
    main()
