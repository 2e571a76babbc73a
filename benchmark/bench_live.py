"""Live capture's cost to serving, side by side on one GPU: decode throughput (output
tokens/s) and p99 inter-token latency with export off, live capture at sample rate 0.1, and
at 1.0.

Two servers run at once, Llama-3-8B geometry with dummy weights, CUDA graphs on: "off" (no
export) and "live" (`--export-mode live --export-sample-rate 0.1`). On the live server, a
request that says nothing is exported when its rid is sampled (arm live_0.1), and one that
says `"export": true` always is (arm live_1.0: every request, as a rate of 1 would). Arms
are measured in rounds whose order rotates; each round's exported files are removed before
the next, as a trainer consuming them would.

    python benchmark/bench_live.py --rounds 5 --out benchmark/results/gpu_live_h200.json
"""

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import time

import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the dev harness

from bench_gpu_export import LLAMA3_8B  # noqa: E402
from harness.bench import measure_decode, provenance, random_prompts, spread  # noqa: E402
from sglang_hs.format import iter_samples  # noqa: E402
from sglang_hs.overlay.admission import sampled  # noqa: E402
from sglang_hs.tools.serve import LocalServer  # noqa: E402

# Decode is measured: prefill CUDA graphs are off in both servers (their capture costs ~90 s of
# each start; bulk prefill runs as fast without them, ../shared/gpu-bundle/README.md). Both
# servers get the same KV cache: SGLang sizes it from the memory free at its own start, so the
# second server, started beside the first, got 26,822 tokens against 134,215 on the H100
# (2026-12-07), too few for 64 clients: it queued requests and the arms did not compare.
KV_TOKENS = 65536  # 64 clients x (512 + 256) tokens fit
FLAGS = ["--load-format", "dummy", "--skip-tokenizer-init", "--attention-backend", "triton",
         "--sampling-backend", "pytorch", "--skip-server-warmup", "--mem-fraction-static", "0.6",
         "--max-total-tokens", str(KV_TOKENS), "--enable-metrics", "--cuda-graph-backend-prefill", "disabled"]
RATE = 0.1
ARMS = [("off", "off", None), (f"live_{RATE}", "live", None), ("live_1.0", "live", True)]


def counters(url):
    text = requests.get(url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^sglang_hs:(\w+)_total\{[^}]*\} (\S+)$", text, re.M)}


def kv_tokens(log_path):
    """The KV cache size SGLang allocated, from its start-up log line."""
    m = re.search(r"KV Cache is allocated\..*#tokens: (\d+)", open(log_path, errors="replace").read())
    return int(m.group(1)) if m else None


def settle(url, before, expected, timeout_s=300):
    """Wait until the live server has written, dropped or failed the `expected` samples this
    arm sampled, so the next arm does not pay for this one's writes. Returns the counters'
    change and the seconds waited after the arm's last answer (the writer's tail)."""
    t0 = time.perf_counter()
    while True:
        after = counters(url)
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        done = sum(delta.get(k, 0) for k in ("exported_samples", "dropped_samples", "failed_samples"))
        if done >= expected or time.perf_counter() - t0 > timeout_s:
            return delta, round(time.perf_counter() - t0, 2)
        time.sleep(0.05)


def clear(export_dir):
    """Remove the samples written so far (the manifest keeps listing the earlier rounds' removed
    ones; nothing else reads it here)."""
    for _, path in iter_samples(export_dir):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--work", default="/tmp")
    p.add_argument("--out", required=True)
    p.add_argument("--cpu-model", help="a smoke run of this script on CPU (sglang-hs serve-cpu) with this checkpoint")
    a = p.parse_args()
    flags, cpu, vocab = FLAGS, False, 128000
    if a.cpu_model:
        model, cpu, vocab = a.cpu_model, True, 30000
        flags = ["--skip-tokenizer-init", "--skip-server-warmup", "--enable-metrics", "--max-total-tokens", str(KV_TOKENS)]
    else:
        model = tempfile.mkdtemp(prefix="llama3-8b-geometry-")
        json.dump(LLAMA3_8B, open(f"{model}/config.json", "w"))
    export_dir = tempfile.mkdtemp(prefix="hs-live-", dir="/dev/shm")
    res = {"benchmark": "gpu_live_capture_decode_llama3_8b_geometry", "provenance": provenance([sys.executable, *sys.argv]),
           "server_flags": flags, "shape": vars(a), "rounds": {name: [] for name, _, _ in ARMS}}

    def save():
        json.dump(res, open(a.out, "w"), indent=2)

    # One after the other: SGLang sizes its KV cache from the GPU memory free at its start.
    with LocalServer(["--model-path", model, *flags], f"{a.work}/live-off.log", cpu=cpu) as off, \
            LocalServer(["--model-path", model, *flags, "--export-hidden-states-dir", export_dir, "--export-mode", "live",
                         "--export-sample-rate", str(RATE)], f"{a.work}/live-on.log", cpu=cpu) as live:
        servers = {"off": off, "live": live}
        res["kv_tokens"] = {k: kv_tokens(s.log_path) for k, s in servers.items()}
        if len(set(res["kv_tokens"].values())) != 1:
            save()
            sys.exit(f"the servers' KV caches differ ({res['kv_tokens']}): the arms would not compare; "
                     "lower --mem-fraction-static's share or KV_TOKENS")
        warm = random_prompts(a.concurrency, a.prompt_len, seed=3, vocab=vocab)
        for name, srv in servers.items():
            # The live server's warm-up exports too, so the export path's first use stays out of
            # round 0 (the first H100 run warmed without it: its first live arm had a 2.5 s median
            # time to first token against 0.44 s off; the cause was not isolated).
            measure_decode(srv.url, warm, 64, 32, rid_prefix=f"warm-{name}", export=True if name == "live" else False)
        clear(export_dir)
        for r in range(a.rounds):
            ps = random_prompts(a.requests, a.prompt_len, seed=100 + r, vocab=vocab)
            order = ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]
            for name, server, export in order:
                srv = servers[server]
                before = counters(srv.url) if server == "live" else {}
                m = measure_decode(srv.url, ps, a.concurrency, a.max_new_tokens, rid_prefix=f"r{r}-{name}",
                                   export=export)
                if server == "live":
                    rids = [f"r{r}-{name}-{i:06d}" for i in range(len(ps))]  # measure_decode's rids
                    m["sampled"] = len(rids) if export else sum(sampled(rid, RATE) for rid in rids)
                    m["counters"], m["write_tail_s"] = settle(srv.url, before, m["sampled"])
                    clear(export_dir)
                m["position_in_round"] = order.index((name, server, export))
                res["rounds"][name].append(m)
                save()
                print(f"round {r} {name}: {m['output_tokens_per_s']:.0f} out tok/s, ITL p99 {m['itl_ms_p99']} ms "
                      f"{m.get('counters', '')} tail {m.get('write_tail_s', '')} s", flush=True)
        res["startup_s"] = {k: s.startup_s for k, s in servers.items()}
        res["counters_total"] = counters(live.url)
    rounds = res["rounds"]
    res["summary"] = {name: {"output_tokens_per_s": spread([m["output_tokens_per_s"] for m in v]),
                             "itl_ms_p99": spread([m["itl_ms_p99"] for m in v]),
                             "itl_ms_p50": spread([m["itl_ms_p50"] for m in v])} for name, v in rounds.items()}
    for name in ("live_0.1", "live_1.0"):
        s = res["summary"][name]
        s["throughput_ratio_vs_off"] = spread([x["output_tokens_per_s"] / o["output_tokens_per_s"]
                                               for x, o in zip(rounds[name], rounds["off"])])
        s["itl_p99_ratio_vs_off"] = spread([x["itl_ms_p99"] / o["itl_ms_p99"] for x, o in zip(rounds[name], rounds["off"])])
        s["throughput_cost"] = 1 - s["throughput_ratio_vs_off"]["median"]
    res["goals"] = {"live_0.1_cost_le_1pct": res["summary"]["live_0.1"]["throughput_cost"] <= 0.01,
                    "live_1.0_cost_le_5pct": res["summary"]["live_1.0"]["throughput_cost"] <= 0.05}
    save()
    shutil.rmtree(export_dir, ignore_errors=True)
    print(json.dumps(res["summary"], indent=1), json.dumps(res["goals"]))


if __name__ == "__main__":
    main()
