"""Online (speculators-file sink, each sample read and deleted as speculators' trainer does)
vs the export directory, side by side in one run: on CPU with SmolLM2-135M, or on a GPU
(`--gpu`, the stock launcher, triton attention) with any checkpoint (`--model`).

Both servers run at once, same flags but the sink, and are measured in alternating rounds on
identical prompts. The directory side is a capture (/generate, the sample stays on disk);
the online side is what speculators' online mode does per row (/v1/completions, then
hs-connectors' own FileTransfer reads the handoff file and deletes it).

    .venv/bin/python benchmark/bench_online.py --rounds 5
    python3 benchmark/bench_online.py --gpu --model M --prompts 64 --length 1024 --concurrency 32 \
        --out benchmark/results/gpu_online_h200.json
"""

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import requests

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the dev harness
sys.path.append(os.path.join(REPO, ".cache", "trainers"))  # hs-connectors' reader, as the trainer has it

from harness.bench import provenance, random_prompts, spread  # noqa: E402
from sglang_hs.tools import models  # noqa: E402
from sglang_hs.tools.serve import LocalServer  # noqa: E402


def du(path):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def directory_round(url, prompts, concurrency, tag):
    def one(i):
        r = requests.post(url + "/generate", json={"rid": f"{tag}-{i:05d}", "input_ids": prompts[i],
                                                   "sampling_params": {"max_new_tokens": 1}}, timeout=3600)
        r.raise_for_status()
        return r.json()["meta_info"]["hidden_states_export"]["bytes"]

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as ex:
        sizes = list(ex.map(one, range(len(prompts))))
    return time.perf_counter() - t0, sum(sizes)


def online_round(url, model, prompts, concurrency):
    from pathlib import Path

    from hs_connectors.transfer import FileTransfer

    reader = FileTransfer(Path("/nonexistent"))  # online rows only: no cached hs_{i}

    def one(i):
        r = requests.post(url + "/v1/completions", json={"model": model, "prompt": prompts[i], "max_tokens": 1,
                                                         "return_token_ids": True}, timeout=3600)
        r.raise_for_status()
        params = r.json()["kv_transfer_params"]
        t = reader.get_generated(params)
        reader.delete(params["hidden_states_path"])
        return t["hidden_states"].numel() * t["hidden_states"].element_size() + t["token_ids"].numel() * 8

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as ex:
        sizes = list(ex.map(one, range(len(prompts))))
    return time.perf_counter() - t0, sum(sizes)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--work-dir", default=".cache")
    p.add_argument("--model", help="default: SmolLM2-135M-Instruct from the embedded GGUF")
    p.add_argument("--gpu", action="store_true", help="the stock launcher on the GPU (triton attention) instead of CPU")
    p.add_argument("--out", default="benchmark/results/cpu_online_smollm2.json")
    a = p.parse_args()
    model = a.model or models.smollm2(os.path.join(a.work_dir, "models", "smollm2-135m-instruct"))
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    dirs = {s: tempfile.mkdtemp(prefix=f"sglang-hs-online-{s}-", dir=shm) for s in ("directory", "online")}
    common = ["--model-path", model, "--skip-server-warmup", "--disable-radix-cache"]
    if a.gpu:  # both servers share the GPU
        common += ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--mem-fraction-static", "0.35"]
    rows = {"directory": [], "online": []}
    try:
        with LocalServer([*common, "--export-hidden-states-dir", dirs["directory"]], "/tmp/bench-online-dir.log",
                         cpu=not a.gpu) as sd, \
             LocalServer([*common, "--export-hidden-states-dir", dirs["online"], "--export-sink", "speculators-file"],
                         "/tmp/bench-online-spec.log", cpu=not a.gpu) as so:
            warm = random_prompts(4, a.length, seed=999)
            directory_round(sd.url, warm, 4, "warm")
            online_round(so.url, model, warm, 4)
            for k in range(a.rounds):
                prompts = random_prompts(a.prompts, a.length, seed=k)
                order = ("directory", "online") if k % 2 == 0 else ("online", "directory")
                for side in order:
                    s, b = (directory_round(sd.url, prompts, a.concurrency, f"r{k}") if side == "directory"
                            else online_round(so.url, model, prompts, a.concurrency))
                    rows[side].append({"seconds": s, "bytes": b, "samples_per_s": a.prompts / s, "gb_per_s": b / s / 1e9})
                    print(side, k, json.dumps(rows[side][-1]), flush=True)
            left = {"directory": du(dirs["directory"]), "online": du(os.path.join(dirs["online"], "handoff"))}
    finally:
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
    ratio = [o["samples_per_s"] / d["samples_per_s"] for o, d in zip(rows["online"], rows["directory"])]
    result = {
        "what": "samples/s and GB/s: speculators-file sink read and deleted by hs-connectors' FileTransfer "
                "(/v1/completions) vs the directory sink (/generate), same prompts, alternating rounds",
        "model": model, "device": "gpu" if a.gpu else "cpu",
        "prompts_per_round": a.prompts, "prompt_length": a.length, "concurrency": a.concurrency,
        "directory": {k: spread([r[k] for r in rows["directory"]]) for k in ("samples_per_s", "gb_per_s")},
        "online": {k: spread([r[k] for r in rows["online"]]) for k in ("samples_per_s", "gb_per_s")},
        "online_vs_directory_samples_per_s": spread(ratio),
        "bytes_left_in_dir_after_run": left,
        "bytes_streamed_never_kept": sum(r["bytes"] for r in rows["online"]),
        "median_ratio": statistics.median(ratio),
        **provenance([sys.executable, *sys.argv]),
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: result[k] for k in ("online_vs_directory_samples_per_s", "bytes_left_in_dir_after_run")}))


if __name__ == "__main__":
    main()
