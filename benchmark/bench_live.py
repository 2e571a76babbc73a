"""Live capture's cost to serving, side by side on one GPU: decode throughput (output
tokens/s) and p99 inter-token latency with export off, live capture at sample rate 0.1, and
at 1.0.

Two servers run at once, Llama-3-8B geometry with dummy weights, CUDA graphs on: "off" (no
export) and "live" (`--export-mode live --export-sample-rate 0.1`). On the live server, a
request that says nothing is exported when its rid is sampled (arm live_0.1), and one that
says `"export": true` always is (arm live_1.0: every request, as a rate of 1 would). Arm
live_1.0_discard is live_1.0 with the sink's write skipped (probes/discard: hooks, gather,
device->host copy and the writer's wait all still run), so live_1.0 against it is what writing
the files takes from serving. Arms are measured in rounds whose order rotates; each round's
exported files are removed before the next, as a trainer consuming them would.

With --py-spy BIN, one more round after the measured ones samples the live server's scheduler
process with py-spy (--gil: only the thread holding the GIL is recorded) through each live arm:
the share of the time our writer threads hold the scheduler's GIL, and the scheduler thread's.

    python benchmark/bench_live.py --rounds 5 --out benchmark/results/gpu_live_h200.json
"""

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
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
# (arm, server, the requests' export option, the sink's write skipped)
ARMS = [("off", "off", None, False), (f"live_{RATE}", "live", None, False), ("live_1.0", "live", True, False),
        ("live_1.0_discard", "live", True, True)]
PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probes", "discard")
PY_SPY_RATE = 200  # samples a second


def scheduler_pid(launcher_pid):
    import psutil

    for c in psutil.Process(launcher_pid).children(recursive=True):
        if "scheduler" in " ".join(c.cmdline()):
            return c.pid
    raise RuntimeError("no sglang::scheduler process under the live server")


def gil_shares(raw_path, seconds):
    """py-spy's raw output (one 'frame;frame;... count' line per stack, recorded only while its
    thread held the GIL) -> the share of the recorded time each kind of thread held it: our
    writer threads, SGLang's scheduler thread, any other."""
    held = {"writer": 0, "scheduler": 0, "other": 0}
    for line in open(raw_path, errors="replace"):
        stack, _, n = line.rstrip().rpartition(" ")
        if n.isdigit():
            kind = "writer" if "SampleWriter._run" in stack else "scheduler" if "run_scheduler_process" in stack else "other"
            held[kind] += int(n)
    total = PY_SPY_RATE * seconds
    return {"samples": held, **{f"{k}_gil_share": v / total for k, v in held.items()},
            "gil_free_share": max(0.0, 1 - sum(held.values()) / total)}


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
    p.add_argument("--py-spy", help="py-spy's binary: one more round samples the scheduler's GIL under each live arm")
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
           "server_flags": flags, "shape": vars(a), "rounds": {name: [] for name, *_ in ARMS}}
    discard = os.path.join(export_dir, ".discard")  # outside the shards: clear() leaves it

    def save():
        json.dump(res, open(a.out, "w"), indent=2)

    # One after the other: SGLang sizes its KV cache from the GPU memory free at its start.
    live = LocalServer(["--model-path", model, *flags, "--export-hidden-states-dir", export_dir, "--export-mode", "live",
                        "--export-sample-rate", str(RATE)], f"{a.work}/live-on.log", cpu=cpu)
    live.env = dict(live.env, SGLANG_HS_DISCARD_FLAG=discard,
                    PYTHONPATH=os.pathsep.join(x for x in (PROBE, live.env.get("PYTHONPATH")) if x))
    with LocalServer(["--model-path", model, *flags], f"{a.work}/live-off.log", cpu=cpu) as off, live:
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
        def arm(r, name, server, export, skip_write, ps):
            srv = servers[server]
            before = counters(srv.url) if server == "live" else {}
            if skip_write:
                open(discard, "w").close()
            try:
                m = measure_decode(srv.url, ps, a.concurrency, a.max_new_tokens, rid_prefix=f"r{r}-{name}",
                                   export=export)
                if server == "live":
                    rids = [f"r{r}-{name}-{i:06d}" for i in range(len(ps))]  # measure_decode's rids
                    m["sampled"] = len(rids) if export else sum(sampled(rid, RATE) for rid in rids)
                    m["counters"], m["write_tail_s"] = settle(srv.url, before, m["sampled"])
                    clear(export_dir)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(discard)
            return m

        for r in range(a.rounds):
            ps = random_prompts(a.requests, a.prompt_len, seed=100 + r, vocab=vocab)
            order = ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]
            for name, *how in order:
                m = arm(r, name, *how, ps)
                m["position_in_round"] = [x[0] for x in order].index(name)
                res["rounds"][name].append(m)
                save()
                print(f"round {r} {name}: {m['output_tokens_per_s']:.0f} out tok/s, ITL p99 {m['itl_ms_p99']} ms "
                      f"TTFT p50 {m['ttft_ms_p50']} ms {m.get('counters', '')} tail {m.get('write_tail_s', '')} s",
                      flush=True)
        if a.py_spy:
            pid, res["gil"] = scheduler_pid(live.proc.pid), {}
            ps = random_prompts(a.requests, a.prompt_len, seed=99, vocab=vocab)
            for name, *how in ARMS:
                if how[0] != "live":
                    continue
                raw, secs = f"{a.work}/py-spy-{name}.txt", 4
                spy = subprocess.Popen([a.py_spy, "record", "--gil", "--nonblocking", "--rate", str(PY_SPY_RATE),
                                        "--duration", str(secs), "--format", "raw", "--output", raw, "--pid", str(pid)],
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                m = arm("spy", name, *how, ps)
                out = spy.communicate()[0]
                res["gil"][name] = gil_shares(raw, secs) if spy.returncode == 0 and os.path.exists(raw) else \
                    {"error": f"py-spy rc {spy.returncode}: {out[-1500:]}"}
                res["gil"][name]["output_tokens_per_s"] = m["output_tokens_per_s"]
                print(f"py-spy {name}: {json.dumps(res['gil'][name])}", flush=True)
                save()
        res["startup_s"] = {k: s.startup_s for k, s in servers.items()}
        res["counters_total"] = counters(live.url)
    rounds = res["rounds"]
    res["summary"] = {name: {"output_tokens_per_s": spread([m["output_tokens_per_s"] for m in v]),
                             "itl_ms_p99": spread([m["itl_ms_p99"] for m in v]),
                             "itl_ms_p50": spread([m["itl_ms_p50"] for m in v]),
                             "ttft_ms_p50": spread([m["ttft_ms_p50"] for m in v])} for name, v in rounds.items()}
    for name in [x[0] for x in ARMS[1:]]:
        s = res["summary"][name]
        s["throughput_ratio_vs_off"] = spread([x["output_tokens_per_s"] / o["output_tokens_per_s"]
                                               for x, o in zip(rounds[name], rounds["off"])])
        s["itl_p99_ratio_vs_off"] = spread([x["itl_ms_p99"] / o["itl_ms_p99"] for x, o in zip(rounds[name], rounds["off"])])
        s["throughput_cost"] = 1 - s["throughput_ratio_vs_off"]["median"]
    res["goals"] = {"live_0.1_cost_le_0.5pct": res["summary"]["live_0.1"]["throughput_cost"] <= 0.005,
                    "live_1.0_cost_le_2pct": res["summary"]["live_1.0"]["throughput_cost"] <= 0.02}
    save()
    shutil.rmtree(export_dir, ignore_errors=True)
    print(json.dumps(res["summary"], indent=1), json.dumps(res["goals"]))


if __name__ == "__main__":
    main()
