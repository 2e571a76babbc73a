"""Host time our hooks add to one decode step with decode rows, without a server: the
scheduler thread's part of live capture at sample rate 1.0 (every request exports).

A batch of B requests, each prefilled once, then decoded S steps the way the seams drive the
runtime (begin_decode, the rows read after a CUDA graph's replay on a GPU or staged by the
LogitsProcessor hook on CPU, end_forward), finishing every request at the end so the writer
writes real files. Each phase's time per step is
measured on the calling thread; on a GPU the device work is queued, not waited for, as in
the server (no synchronisation), so what is measured is the host time that delays the
scheduler's next step.

    .venv/bin/python benchmark/bench_decode_hooks.py                  # CPU
    python3 benchmark/bench_decode_hooks.py --device cuda --out ...   # on the GPU host
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the dev harness

from harness.bench import provenance, spread  # noqa: E402
from sglang_hs.overlay.runtime import ExportRuntime  # noqa: E402
from sglang_hs.overlay.sinks import DirectorySink  # noqa: E402
from sglang_hs.overlay.staging import SlabPool  # noqa: E402
from sglang_hs.overlay.writer import SampleWriter  # noqa: E402

PHASES = ("begin", "rows", "end")
PREFILL_TOKENS, PREFILL_FORWARDS = 8192, 8


def one_round(a, device, work):
    k = len(a.aux)
    os.makedirs(work)
    writer = SampleWriter(DirectorySink(work, "dp0", a.aux), SlabPool(a.host_gib << 30, pin=device.type == "cuda"),
                          lambda outcome: None, threads=a.writer_threads)
    rt = ExportRuntime(a.aux, writer, "dp0-tp0")
    opts = {"sglang_hs": {"decode_rows": True}}
    states = [rt.new_state(f"r{i}", list(range(a.prompt)), opts, lambda: False) for i in range(a.batch)]
    # The prefill (not timed): one extend forward of every prompt.
    n = a.batch * a.prompt
    rt.begin_forward(states, [0] * a.batch, [a.prompt] * a.batch)
    rows = torch.randn(n, a.hidden, dtype=torch.bfloat16, device=device)
    rt.stage(rows, [rows] * k)
    rt.end_forward()
    final = torch.randn(a.batch, a.hidden, dtype=torch.bfloat16, device=device)
    aux = [torch.randn(a.batch, a.hidden, dtype=torch.bfloat16, device=device) for _ in range(k)]
    graph = device.type == "cuda"
    if graph:  # what a decode graph's capture records; its replays refill these buffers
        rt.capture_decode_graph(final, aux)
    t = {p: [] for p in PHASES}
    for s in range(a.steps):
        seq = [a.prompt + s + 1] * a.batch
        t0 = time.perf_counter()
        rt.begin_decode(states, seq)
        t1 = time.perf_counter()
        if not graph:
            rt.stage(final, aux)
        t2 = time.perf_counter()
        rt.end_forward(graph_ran=graph)  # on a GPU: reads the graph's rows, then hands them out
        t3 = time.perf_counter()
        for p, x in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2)):
            t[p].append(x * 1000)
    for st in states:
        rt.finish(st, list(range(a.steps + 1)), False)
    t_w = time.perf_counter()
    writer.flush()
    written = time.perf_counter() - t_w
    # Prompt-only forwards of PREFILL_TOKENS (8 prompts): the host time of planning, gathering
    # and staging their rows, and handing them to the writer (device work queued, not waited).
    per = PREFILL_TOKENS // 8
    rows = torch.randn(PREFILL_TOKENS, a.hidden, dtype=torch.bfloat16, device=device)
    pre = []
    for f in range(PREFILL_FORWARDS):
        batch = [rt.new_state(f"p{f}-{i}", list(range(per)), None, lambda: False) for i in range(8)]
        t0 = time.perf_counter()
        rt.begin_forward(batch, [0] * 8, [per] * 8)
        rt.stage(rows, [rows] * k)
        rt.end_forward()
        pre.append((time.perf_counter() - t0) * 1000)
    writer.flush()
    writer.close()
    return {p: statistics.median(v) for p, v in t.items()} | {"prefill": statistics.median(pre)}, written, \
        dict(writer.stats)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--aux", type=int, nargs="+", default=[2, 4, 6])
    p.add_argument("--host-gib", type=int, default=4)
    p.add_argument("--writer-threads", type=int, default=8, help="the server's default")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    device = torch.device(a.device)
    work = tempfile.mkdtemp(prefix="decode-hooks-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    per = {ph: [] for ph in PHASES}
    total, written, sample_bytes, prefill = [], [], None, []
    try:
        for r in range(a.rounds):
            meds, w_s, stats = one_round(a, device, os.path.join(work, f"round-{r}"))
            for ph in PHASES:
                per[ph].append(meds[ph])
            total.append(sum(meds[ph] for ph in PHASES))
            prefill.append(meds["prefill"])
            written.append(w_s)
            sample_bytes = stats["bytes"] / max(1, stats["samples"])
            print(f"round {r}: " + " ".join(f"{ph} {meds[ph]:.3f}" for ph in (*PHASES, "prefill"))
                  + f" ms a step; writer {stats['samples']} samples, {w_s:.2f} s after the last step", flush=True)
            shutil.rmtree(os.path.join(work, f"round-{r}"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {
        "what": "host ms our hooks add to one decode step with decode rows for every request of the batch "
                "(median step of each round; spread over rounds)",
        "shape": {"batch": a.batch, "prompt": a.prompt, "steps": a.steps, "hidden": a.hidden, "aux_layers": a.aux,
                  "device": a.device, "decode_graph": device.type == "cuda"},
        "ms_per_step": {ph: spread(v) for ph, v in per.items()} | {"total": spread(total)},
        "ms_per_prefill_forward": spread(prefill),
        "prefill_forward": f"{PREFILL_TOKENS} tokens, 8 prompts, prompt rows only (median of {PREFILL_FORWARDS} a round)",
        "writer_tail_s": spread(written),
        "writer_tail_what": "seconds from the last step until every sample (the batch's, prompt and answer) is written",
        "sample_bytes": sample_bytes,
        **provenance(sys.argv),
    }
    print(json.dumps(out["ms_per_step"], indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
