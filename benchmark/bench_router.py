"""Capture through sglang-router vs straight to the same servers, side by side: two exporting
servers, a router (--policy manual) in front of them, rounds on the same records (new ids each
round), each way first in turn; samples/s and how the samples split over the servers.

    .venv/bin/python benchmark/bench_router.py --rounds 5
"""

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
from importlib import resources

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the dev harness

from harness.bench import provenance, spread  # noqa: E402
from harness.router import ROUTER_FOR_CAPTURE, LocalRouter  # noqa: E402
from sglang_hs.format import read_manifest  # noqa: E402
from sglang_hs.tools import models  # noqa: E402
from sglang_hs.tools.capture import CaptureConfig, capture  # noqa: E402
from sglang_hs.tools.serve import LocalServer  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--records", type=int, default=100, help="conversations per round (from the bundled 200)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--work-dir", default=".cache")
    p.add_argument("--model", help="default: SmolLM2-135M-Instruct from the embedded GGUF")
    p.add_argument("--out", default="benchmark/results/cpu_router_smollm2.json")
    a = p.parse_args()
    model = a.model or models.smollm2(os.path.join(a.work_dir, "models", "smollm2-135m-instruct"))
    work = tempfile.mkdtemp(prefix="sglang-hs-router-")
    data = os.path.join(work, "chats.jsonl")
    with open(resources.files("sglang_hs").joinpath("data/chats_200.jsonl")) as src, open(data, "w") as dst:
        dst.writelines(itertools.islice(src, a.records))
    # float32: this CPU has no bf16 matrix units; the question is the router's cost, not dtype.
    servers = [LocalServer(["--model-path", model, "--export-hidden-states-dir", os.path.join(work, f"node{k}"),
                            "--dtype", "float32", "--skip-server-warmup"], os.path.join(work, f"server{k}.log"))
               for k in range(2)]
    ways = ("direct", "router")
    rows = {w: [] for w in ways}
    try:
        for s in servers:
            s.__enter__()
        with LocalRouter([s.url for s in servers], os.path.join(work, "router.log"), *ROUTER_FOR_CAPTURE) as router:
            def run(way, prefix):
                urls = [router.url] if way == "router" else [s.url for s in servers]
                cfg = CaptureConfig(servers=urls, data=data, out=os.path.join(work, f"journal-{prefix}"),
                                    concurrency=a.concurrency, id_prefix=prefix, progress=False,
                                    via_router=way == "router")
                summ = capture(cfg)
                assert summ.failed == 0 and summ.exported == a.records, summ.line()
                split = [sum(e["id"].startswith(prefix) for e in read_manifest(s.export_dir)) for s in servers]
                return summ, split

            for way in ways:
                run(way, f"warm-{way}-")
            for k in range(a.rounds):
                for way in list(ways)[k % 2:] + list(ways)[:k % 2]:  # each way first in turn
                    summ, split = run(way, f"r{k}-{way}-")
                    rows[way].append({"seconds": summ.seconds, "samples_per_s": summ.exported / summ.seconds,
                                      "tokens_per_s": summ.tokens / summ.seconds, "per_server": split})
                    print(way, k, json.dumps(rows[way][-1]), flush=True)
    finally:
        for s in servers:
            s.__exit__()
        shutil.rmtree(work, ignore_errors=True)
    ratio = [r["samples_per_s"] / d["samples_per_s"] for r, d in zip(rows["router"], rows["direct"])]
    share = {w: [max(r["per_server"]) / sum(r["per_server"]) for r in rows[w]] for w in ways}
    result = {
        "what": f"sglang-hs capture through sglang-router 0.3.2 ({' '.join(ROUTER_FOR_CAPTURE)}, --via-router) "
                "vs straight to the same two exporting servers (the client hashing ids over them), samples exported "
                "per second, same records each round under new ids, each way first in turn; per_server: samples each "
                "server wrote",
        "model": model, "device": "cpu", "servers": 2, "records_per_round": a.records,
        "concurrency": a.concurrency,
        **{w: {"samples_per_s": spread([r["samples_per_s"] for r in rows[w]]),
               "busiest_server_share": spread(share[w])} for w in ways},
        "router_vs_direct": spread(ratio), "median_ratio": statistics.median(ratio),
        "rounds": rows, **provenance([sys.executable, *sys.argv]),
    }
    import sglang_router

    result["versions"]["sglang_router"] = sglang_router.__version__
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({"median_ratio": result["median_ratio"], "router_vs_direct": result["router_vs_direct"],
                      "busiest_server_share": {w: result[w]["busiest_server_share"] for w in ways}}))


if __name__ == "__main__":
    main()
