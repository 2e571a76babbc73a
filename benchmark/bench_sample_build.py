"""Building and writing one sample with decode rows beside a thread running Python, as the
export writer does beside SGLang's scheduler thread: the decode rows as a tensor view per
generated token, joined by `format.coalesce` (as before), vs gathered out of their slab with
one call per slab (`staging.joined`), alternating rounds. Reported: ms per sample, and how much
of the Python thread's progress the write took while it ran (the share of the GIL the writer
held, as that thread saw it).

The pieces are made as a server makes them: the prompt staged whole, then one decode step of
`--batch` rows at a time split into one-row pieces, of which the request keeps its own.

    .venv/bin/python benchmark/bench_sample_build.py --out benchmark/results/cpu_sample_build.json
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the dev harness

from harness.bench import provenance, spread  # noqa: E402
from sglang_hs import format as fmt  # noqa: E402
from sglang_hs.overlay.staging import SlabPool, joined  # noqa: E402

ARMS = {
    "views": lambda pieces, plane: [getattr(p, plane) for p in pieces],  # a view per piece (before)
    "gathered": joined,
}


def request_pieces(pool, prompt, generated, batch, k, h):
    mine = pool.pieces(prompt, k, h, torch.bfloat16)
    for step in range(generated):
        rows = [c for p in pool.pieces(batch, k, h, torch.bfloat16) for c in p.split([1] * p.rows)]
        mine.append(rows[step % batch])
        for c in rows:
            if c is not mine[-1]:
                c.release()
    return mine


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--samples", type=int, default=5, help="samples written per arm and round")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--prompt", type=int, default=350)
    p.add_argument("--generated", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="rows of each decode step (the request keeps one)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--out", default="benchmark/results/cpu_sample_build.json")
    a = p.parse_args()
    k, h = 3, a.hidden
    pool = SlabPool(4 << 30)
    work = tempfile.mkdtemp(prefix="sample-build-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    stop, count = threading.Event(), [0]

    def spin():  # the scheduler thread's stand-in: Python work between calls that leave the GIL
        while not stop.is_set():
            x = 0
            for _ in range(200):
                x += 1
            time.sleep(0.0001)  # a CUDA call or a socket poll: the GIL is free meanwhile
            count[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    res = {arm: {"ms": [], "gil_taken": []} for arm in a.arms}
    try:
        for r in range(a.rounds):
            c0, t0 = count[0], time.perf_counter()
            time.sleep(0.5)  # the thread's rate alone
            alone = (count[0] - c0) / (time.perf_counter() - t0)
            for arm in (a.arms if r % 2 == 0 else a.arms[::-1]):
                ms, taken = [], []
                for i in range(a.samples):
                    pieces = request_pieces(pool, a.prompt, a.generated, a.batch, k, h)
                    c0, t0 = count[0], time.perf_counter()
                    tensors = {"token_ids": torch.arange(a.prompt + a.generated + 1),
                               "aux_hidden_states": ARMS[arm](pieces, "aux"),
                               "final_hidden_states": ARMS[arm](pieces, "final")}
                    fmt.write_sample_file(os.path.join(work, f"{arm}-{r}-{i}.safetensors"), tensors, {})
                    dt = time.perf_counter() - t0
                    ms.append(1000 * dt)
                    taken.append(max(0.0, 1 - (count[0] - c0) / (alone * dt)))
                    for piece in pieces:
                        piece.release()
                res[arm]["ms"].append(sorted(ms)[len(ms) // 2])
                res[arm]["gil_taken"].append(sorted(taken)[len(taken) // 2])
                print(f"round {r} {arm}: {res[arm]['ms'][-1]:.1f} ms a sample, the Python thread lost "
                      f"{100 * res[arm]['gil_taken'][-1]:.0f}% of its progress meanwhile", flush=True)
                for f in os.listdir(work):
                    os.remove(os.path.join(work, f))
    finally:
        stop.set()
        spinner.join()
        shutil.rmtree(work, ignore_errors=True)
    out = {
        "what": "one sample with decode rows built and written beside a thread running Python: ms per sample and "
                "the share of that thread's progress lost while the sample was written (medians of each round's "
                "samples), decode rows as a view per token vs gathered per slab",
        "shape": {"hidden": h, "aux_layers": k, "prompt_rows": a.prompt, "decode_rows": a.generated,
                  "decode_batch": a.batch},
        "switch_interval_s": sys.getswitchinterval(),
        **{arm: {m: spread(v) for m, v in d.items()} for arm, d in res.items()},
        **({"ms_ratio_gathered_vs_views": spread([g / v for g, v in zip(res["gathered"]["ms"], res["views"]["ms"])])}
           if len(res) == 2 else {}),
        **provenance([sys.executable, *sys.argv]),
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps({arm: {m: round(v["median"], 3) for m, v in out[arm].items()} for arm in a.arms}))


if __name__ == "__main__":
    main()
