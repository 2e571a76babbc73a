"""Online (speculators-file and speculators-mooncake sinks, each sample read and deleted as
speculators' trainer does) vs the export directory, side by side in one run: on CPU with
SmolLM2-135M, or on a GPU (`--gpu`, the stock launcher, triton attention) with any
checkpoint (`--model`).

The three servers run at once, same flags but the sink, and are measured in rounds on
identical prompts, each side first in turn. The directory side is a capture (/generate, the
sample stays on disk); an online side is what speculators' online mode does per row
(/v1/completions, then hs-connectors' own transfer reads the sample and deletes it).

    .venv/bin/python benchmark/bench_online.py --rounds 5
    python3 benchmark/bench_online.py --gpu --model M --prompts 64 --length 1024 --concurrency 32 \
        --out benchmark/results/gpu_online_h200.json
"""

import argparse
import concurrent.futures as cf
import contextlib
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
from harness.mooncake import MooncakeMaster  # noqa: E402
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


def online_round(url, model, prompts, concurrency, reader):
    """What speculators' online mode does per row: /v1/completions, then its transfer reads
    the sample and deletes it."""
    def one(i):
        r = requests.post(url + "/v1/completions", json={"model": model, "prompt": prompts[i], "max_tokens": 1,
                                                         "return_token_ids": True}, timeout=3600)
        r.raise_for_status()
        params = r.json()["kv_transfer_params"]
        t = reader.get_generated(params)
        reader.delete(params.get("hidden_states_path") or params["handle"])
        return t["hidden_states"].numel() * t["hidden_states"].element_size() + t["token_ids"].numel() * 8

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as ex:
        sizes = list(ex.map(one, range(len(prompts))))
    return time.perf_counter() - t0, sum(sizes)


def readers(master):
    """hs-connectors' own transfers, as speculators builds them from its train flags."""
    from pathlib import Path

    from hs_connectors.transfer import FileTransfer, HiddenStatesBackend

    args = argparse.Namespace(mooncake_master=master, mooncake_metadata_server="P2PHANDSHAKE",
                              mooncake_protocol="tcp", mooncake_device="", mooncake_global_segment_gib=0.0625,
                              mooncake_local_buffer_gib=1.0)
    mooncake = HiddenStatesBackend.registry["mooncake"].from_train_args(args, "/nonexistent")
    mooncake.setup()  # what each DataLoader worker does first
    return {"file": FileTransfer(Path("/nonexistent")), "mooncake": mooncake}  # online rows only: no hs_{i}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--work-dir", default=".cache")
    p.add_argument("--model", help="default: SmolLM2-135M-Instruct from the embedded GGUF")
    p.add_argument("--gpu", action="store_true", help="the stock launcher on the GPU (triton attention) instead of CPU")
    p.add_argument("--segment-gib", type=float, default=0.25, help="the Mooncake server's segment")
    p.add_argument("--out", default="benchmark/results/cpu_online_smollm2.json")
    a = p.parse_args()
    model = a.model or models.smollm2(os.path.join(a.work_dir, "models", "smollm2-135m-instruct"))
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    sides = ("directory", "file", "mooncake")
    dirs = {s: tempfile.mkdtemp(prefix=f"sglang-hs-online-{s}-", dir=shm) for s in sides}
    common = ["--model-path", model, "--skip-server-warmup", "--disable-radix-cache"]
    if a.gpu:  # the three servers share the GPU
        common += ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--mem-fraction-static", "0.25"]
    rows = {s: [] for s in sides}
    os.environ.setdefault("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")
    try:
        with contextlib.ExitStack() as stack:
            master = stack.enter_context(MooncakeMaster("/tmp/bench-online-master.log"))
            sink = {"directory": [], "file": ["--export-sink", "speculators-file"],
                    "mooncake": ["--export-sink", "speculators-mooncake", "--export-mooncake-master", master.address,
                                 "--export-mooncake-segment-gib", str(a.segment_gib)]}
            srv = {s: stack.enter_context(LocalServer([*common, "--export-hidden-states-dir", dirs[s], *sink[s]],
                                                      f"/tmp/bench-online-{s}.log", cpu=not a.gpu)) for s in sides}
            rd = readers(master.address)

            def run(side, prompts, concurrency, tag):
                if side == "directory":
                    return directory_round(srv[side].url, prompts, concurrency, tag)
                return online_round(srv[side].url, model, prompts, concurrency, rd[side])

            warm = random_prompts(4, a.length, seed=999)
            for side in sides:
                run(side, warm, 4, "warm")
            for k in range(a.rounds):
                prompts = random_prompts(a.prompts, a.length, seed=k)
                for side in sides[k % 3:] + sides[:k % 3]:  # each side first in turn
                    sec, b = run(side, prompts, a.concurrency, f"r{k}")
                    rows[side].append({"seconds": sec, "bytes": b, "samples_per_s": a.prompts / sec,
                                       "gb_per_s": b / sec / 1e9})
                    print(side, k, json.dumps(rows[side][-1]), flush=True)
            left = {"directory": du(dirs["directory"]), "file": du(os.path.join(dirs["file"], "handoff"))}
    finally:
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
    ratio = {s: [o["samples_per_s"] / d["samples_per_s"] for o, d in zip(rows[s], rows["directory"])]
             for s in ("file", "mooncake")}
    result = {
        "what": "samples/s and GB/s, side by side on the same prompts, each side first in turn: the directory sink "
                "(/generate, the sample stays on disk) vs speculators' online mode per row (/v1/completions, then "
                "hs-connectors' own transfer reads and deletes the sample) over the speculators-file and "
                "speculators-mooncake sinks (a real mooncake_master, TCP on loopback)",
        "model": model, "device": "gpu" if a.gpu else "cpu",
        "prompts_per_round": a.prompts, "prompt_length": a.length, "concurrency": a.concurrency,
        **{s: {k: spread([r[k] for r in rows[s]]) for k in ("samples_per_s", "gb_per_s")} for s in sides},
        "vs_directory_samples_per_s": {s: spread(r) for s, r in ratio.items()},
        "median_ratio": {s: statistics.median(r) for s, r in ratio.items()},
        "bytes_left_after_run": left,
        "bytes_streamed_never_kept": {s: sum(r["bytes"] for r in rows[s]) for s in ("file", "mooncake")},
        "rounds": rows,
        **provenance([sys.executable, *sys.argv]),
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: result[k] for k in ("median_ratio", "bytes_left_after_run")}))


if __name__ == "__main__":
    main()
