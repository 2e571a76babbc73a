"""Writing one sample with decode rows while another thread runs Python, as SGLang's scheduler
thread does beside the export writer: piece by piece (one write per generated token's row, as
before) vs coalesced (small pieces joined before writing, `format.coalesce`), alternating rounds.

The shape is the regenerate benchmark's on the GPU: Llama-3-8B width (4096), 3 aux layers, a
prompt of 350 rows in one piece and 256 decode rows of one row each.

    .venv/bin/python benchmark/bench_gil_writer.py --out benchmark/results/cpu_gil_writer.json
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

ARMS = {"piece_by_piece": 1, "coalesced": fmt.COALESCE_BYTES}  # COALESCE_BYTES: 1 joins nothing


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--samples", type=int, default=5, help="samples written per arm and round")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--prompt", type=int, default=350)
    p.add_argument("--generated", type=int, default=256)
    p.add_argument("--out", default="benchmark/results/cpu_gil_writer.json")
    a = p.parse_args()
    h, k = a.hidden, 3
    aux = [torch.randn(a.prompt, k, h).bfloat16()] + [torch.randn(1, k, h).bfloat16() for _ in range(a.generated)]
    fin = [torch.randn(a.prompt, h).bfloat16()] + [torch.randn(1, h).bfloat16() for _ in range(a.generated)]
    tensors = {"token_ids": torch.arange(a.prompt + a.generated + 1), "aux_hidden_states": aux,
               "final_hidden_states": fin}
    work = tempfile.mkdtemp(prefix="gil-writer-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    stop = threading.Event()

    def spin():  # pure Python, holding the GIL between switch intervals
        x = 0
        while not stop.is_set():
            x += 1

    res = {f"{arm}_{load}": [] for load in ("idle", "busy") for arm in ARMS}
    try:
        for r in range(a.rounds):
            for load in ("idle", "busy"):
                stop.clear()
                spinner = threading.Thread(target=spin) if load == "busy" else None
                if spinner:
                    spinner.start()
                arms = list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]
                for arm in arms:
                    fmt.COALESCE_BYTES = ARMS[arm]
                    ms = []
                    for i in range(a.samples):
                        t0 = time.perf_counter()
                        fmt.write_sample_file(os.path.join(work, f"{arm}-{load}-{r}-{i}.safetensors"), tensors, {})
                        ms.append((time.perf_counter() - t0) * 1000)
                    res[f"{arm}_{load}"].append(sorted(ms)[len(ms) // 2])
                    print(f"round {r} {load} {arm}: median {res[f'{arm}_{load}'][-1]:.1f} ms a sample", flush=True)
                stop.set()
                if spinner:
                    spinner.join()
                for f in os.listdir(work):
                    os.remove(os.path.join(work, f))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {
        "what": "ms to write one sample with decode rows (median of each round's samples), piece by piece vs "
                "coalesced, with the writer alone (idle) and beside a thread running Python (busy)",
        "shape": {"hidden": h, "aux_layers": k, "prompt_rows": a.prompt, "decode_rows": a.generated,
                  "sample_mib": round(sum(t.numel() * 2 for t in aux + fin) / 2**20, 1)},
        "switch_interval_s": sys.getswitchinterval(),
        "ms_per_sample": {name: spread(v) for name, v in res.items()},
        "busy_ratio_piece_by_piece_vs_coalesced": spread(
            [x / y for x, y in zip(res["piece_by_piece_busy"], res["coalesced_busy"])]),
        **provenance([sys.executable, *sys.argv]),
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps({k: v["median"] for k, v in out["ms_per_sample"].items()}))


if __name__ == "__main__":
    main()
