"""Soak: 10,000 requests at 64-way concurrency against one CPU server, with a mid-run drain
(SIGTERM) and a mid-run kill -9, each followed by a restart on the same directory.

Tiny 8-layer Llama (harness/models.py), chunked prefill (64) and the prefix cache on; half the
prompts share one of 40 prefixes. 10% of requests opt out (`"export": false`) and must never
be listed; 5% are aborted by the client (it hangs up after 20-500 ms) and are resent at the
end, as a capture would. Afterwards every listed sample is checked: its token ids against the
request's, and every row against HF transformers (fp32) for the same tokens, so a row that
went to the wrong sample is caught. Server memory (RSS of its process group) is sampled
every 5 s. Writes benchmark/results/soak_cpu.json.

    .venv/bin/python benchmark/soak_cpu.py [--requests 10000] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time

import aiohttp
import psutil
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from harness import models  # noqa: E402
from harness.bench import provenance  # noqa: E402
from sglang_hs.format import load_sample, read_manifest, validate_export  # noqa: E402
from sglang_hs.tools import models as shipped_models  # noqa: E402
from sglang_hs.tools.serve import LocalServer, free_port  # noqa: E402
from sglang_hs.tools.verify import hf_planes, load_hf  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 49152
# A row whose cosine to HF's fp32 row for the same position is below this belongs to another
# request (rows of unrelated requests are near-orthogonal; bf16 noise stays above 0.999).
MIN_ROW_COSINE = 0.99


@dataclasses.dataclass
class Req:
    rid: str
    ids: list
    kind: str  # "export", "opt_out" or "abort"


def plan(n: int, seed: int) -> list:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, VOCAB) for _ in range(rng.randrange(16, 160))] for _ in range(40)]
    out = []
    for i in range(n):
        head = rng.choice(prefixes) if rng.random() < 0.5 else []
        ids = head + [rng.randrange(10, VOCAB) for _ in range(rng.randrange(8, 400))]
        r = rng.random()
        out.append(Req(f"soak-{i:05d}", ids, "opt_out" if r < 0.10 else "abort" if r < 0.15 else "export"))
    return out


class Server:
    """The server under soak, restartable on the same port and directory."""

    def __init__(self, model: str, out, logs: str):
        self.args = ["--model-path", model, "--chunked-prefill-size", "64", "--skip-server-warmup",
                     "--log-level", "warning"] + (["--export-hidden-states-dir", out] if out else [])
        self.port, self.logs, self.n = free_port(), logs, 0
        self.srv = None
        self.exporting = bool(out)
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> float:
        self.n += 1
        self.srv = LocalServer(self.args, os.path.join(self.logs, f"server-{self.n}.log"), port=self.port)
        self.srv.__enter__()
        return self.srv.startup_s

    def stop(self, sig) -> float:
        t0 = time.time()
        os.killpg(self.srv.proc.pid, sig)
        self.srv.proc.wait(120)
        self.srv.__exit__(None, None, None)
        return time.time() - t0

    def rss_mib(self) -> float:
        try:
            pgid = os.getpgid(self.srv.proc.pid)
        except (ProcessLookupError, AttributeError):
            return 0.0
        total = 0
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(p.pid) == pgid:
                    total += p.memory_info().rss
            except (ProcessLookupError, psutil.Error):
                pass
        return total / 2**20


async def drive(server: Server, reqs: list, concurrency: int, restarts: list, restart: bool = True) -> dict:
    """Send every request; resend those lost to a restart; count what came back."""
    codes = collections.Counter()
    done = {"n": 0}
    up = asyncio.Event()
    up.set()
    pending = collections.deque(reqs)
    restart_at = {len(reqs) // 3: signal.SIGTERM, 2 * len(reqs) // 3: signal.SIGKILL} if restart else {}
    events = []

    async def send(session, r: Req, hang_up: bool):
        opts = {"export": False} if r.kind == "opt_out" else {}
        body = {"rid": r.rid, "input_ids": r.ids,
                "sampling_params": {"max_new_tokens": 1, "custom_params": {"sglang_hs": opts}}}
        timeout = aiohttp.ClientTimeout(total=random.uniform(0.02, 0.5)) if hang_up else None
        async with session.post(server.url + "/generate", json=body, timeout=timeout) as resp:
            return resp.status, await resp.json(content_type=None)

    async def worker(session):
        while pending:
            r = pending.popleft()
            while True:
                await up.wait()
                try:
                    status, data = await send(session, r, r.kind == "abort")
                except asyncio.TimeoutError:
                    codes["hung_up"] += 1
                    break
                except aiohttp.ClientConnectionError:
                    codes["connection_lost"] += 1  # the server is restarting: wait, resend
                    await asyncio.sleep(1.0)
                    continue
                codes[status] += 1
                if status == 423:  # a hung-up copy is still in flight
                    await asyncio.sleep(0.5)
                    continue
                if status == 200 and server.exporting:
                    info = data["meta_info"].get("hidden_states_export")
                    if (info is None) != (r.kind == "opt_out"):
                        events.append({"wrong_answer": r.rid, "kind": r.kind, "meta": str(data["meta_info"])[:300]})
                break
            done["n"] += 1
            sig = restart_at.pop(done["n"], None)
            if sig is not None:
                up.clear()
                down = await asyncio.to_thread(server.stop, sig)
                start = await asyncio.to_thread(server.start)
                restarts.append({"signal": signal.Signals(sig).name, "after_requests": done["n"],
                                 "stop_s": round(down, 1), "startup_s": round(start, 1)})
                up.set()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None, sock_read=600)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return {"codes": dict((str(k), v) for k, v in codes.items()), "events": events}


async def resend_unlisted(server: Server, reqs: list, out: str) -> dict:
    """The capture's rerun: every sample meant for export that is not listed is sent again."""
    listed = {e["id"] for e in read_manifest(out)}
    todo = [r for r in reqs if r.kind != "opt_out" and r.rid not in listed]
    codes = collections.Counter()
    async with aiohttp.ClientSession() as session:
        sem = asyncio.Semaphore(16)

        async def one(r):
            async with sem:
                while True:
                    body = {"rid": r.rid, "input_ids": r.ids, "sampling_params": {"max_new_tokens": 1}}
                    async with session.post(server.url + "/generate", json=body) as resp:
                        codes[resp.status] += 1
                        if resp.status != 423:
                            return
                    await asyncio.sleep(0.5)

        await asyncio.gather(*(one(r) for r in todo))
    return {"resent": len(todo), "codes": dict((str(k), v) for k, v in codes.items())}


def check_rows(out: str, model_path: str, reqs: list) -> dict:
    """Every listed sample: token ids equal the request's, every row close to HF fp32's."""
    by_rid = {r.rid: r for r in reqs}
    info = json.load(open(os.path.join(out, "export.json")))
    ref = load_hf(model_path, torch.float32)
    token_mismatch, misattributed, rows, worst = [], [], 0, 1.0
    for e in read_manifest(out):
        t = load_sample(os.path.join(out, e["path"]))
        tok = t["token_ids"]
        if tok.tolist() != by_rid[e["id"]].ids:
            token_mismatch.append(e["id"])
            continue
        got = torch.cat([t["aux_hidden_states"], t["final_hidden_states"][:, None]], dim=1).float()
        want = hf_planes(ref, tok, list(info["aux_layer_ids"]))
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)  # [T, K+1]
        rows += tok.numel()
        worst = min(worst, float(cos.min()))
        if float(cos.min()) < MIN_ROW_COSINE:
            misattributed.append(e["id"])
    return {"rows": rows, "token_mismatch": token_mismatch, "misattributed": misattributed,
            "worst_row_cosine": worst}


def steady(rss: list, life: int) -> dict:
    """One server life's RSS after its first minute (start-up, pools filling): the median of
    its first third against its last third."""
    mib = [(t, m) for t, n, m in rss if n == life and m > 0]
    later = [m for t, m in mib if t - mib[0][0] >= 60] if mib else []
    k = max(1, len(later) // 3)
    return {"samples": len(later), "first_third_mib": statistics.median(later[:k]) if later else None,
            "last_third_mib": statistics.median(later[-k:]) if later else None}


def memory_control(model: str, reqs: list, concurrency: int, rounds: int) -> dict:
    """Is RSS growth within a server life ours? The same requests against a server with export
    off and one with it on, alternating, one life each, no restarts."""
    out = {"off": [], "on": []}
    for r in range(rounds):
        for mode in ("off", "on"):
            work = tempfile.mkdtemp(prefix=f"soak-mem-{mode}-", dir="/dev/shm")
            server = Server(model, os.path.join(work, "export") if mode == "on" else None, work)
            rss, stop = [], threading.Event()
            t0 = time.time()

            def sample(server=server, rss=rss, stop=stop, t0=t0):
                while not stop.wait(5.0):
                    rss.append((round(time.time() - t0, 1), server.n, round(server.rss_mib(), 1)))

            server.start()
            threading.Thread(target=sample, daemon=True).start()
            asyncio.run(drive(server, reqs, concurrency, [], restart=False))
            stop.set()
            server.stop(signal.SIGTERM)
            st = steady(rss, 1)
            st["growth_mib"] = round(st["last_third_mib"] - st["first_third_mib"], 1) if st["samples"] else None
            out[mode].append(st)
            shutil.rmtree(work, ignore_errors=True)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-control", type=int, metavar="ROUNDS", default=0,
                   help="instead of the soak: RSS growth with export off vs on, ROUNDS alternating rounds")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    smol = shipped_models.smollm2(os.path.join(REPO, ".cache", "models", "smollm2-135m-instruct"))
    model = models.tiny("llama", os.path.join(REPO, ".cache", "models", "tiny-llama-8l"), smol)
    if a.memory_control:
        res = {**provenance(sys.argv), "model": "tiny-llama-8l", "requests": a.requests,
               "concurrency": a.concurrency, **memory_control(model, plan(a.requests, a.seed), a.concurrency,
                                                               a.memory_control)}
        path = a.out or os.path.join(REPO, "benchmark", "results", "soak_cpu_memory_control.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print(json.dumps(res, indent=1))
        return
    a.out = a.out or os.path.join(REPO, "benchmark", "results", "soak_cpu.json")
    work = tempfile.mkdtemp(prefix="soak-", dir="/dev/shm")
    out = os.path.join(work, "export")
    reqs = plan(a.requests, a.seed)
    server = Server(model, out, work)
    rss, stop_sampling = [], threading.Event()
    t0 = time.time()

    def sample_rss():
        while not stop_sampling.wait(5.0):
            rss.append((round(time.time() - t0, 1), server.n, round(server.rss_mib(), 1)))

    server.start()
    threading.Thread(target=sample_rss, daemon=True).start()
    restarts = []
    driven = asyncio.run(drive(server, reqs, a.concurrency, restarts))
    resent = asyncio.run(resend_unlisted(server, reqs, out))
    minutes_serving = (time.time() - t0) / 60
    stop_sampling.set()
    server.stop(signal.SIGTERM)

    manifest = read_manifest(out)
    ids = [e["id"] for e in manifest]
    meant = {r.rid for r in reqs if r.kind != "opt_out"}
    opted_out = {r.rid for r in reqs if r.kind == "opt_out"}
    fmt = validate_export(out, expected_tokens={r.rid: r.ids for r in reqs if r.kind != "opt_out"})
    rows = check_rows(out, model, reqs)
    # Flat memory: within each server life (restarts reset it), after its first minute.
    flat = {str(n): steady(rss, n) for n in range(1, server.n + 1)}
    result = {
        **provenance(sys.argv),
        "model": "tiny-llama-8l (hidden 64, SmolLM2 vocabulary)",
        "requests": a.requests, "concurrency": a.concurrency,
        "kinds": dict(collections.Counter(r.kind for r in reqs)),
        "samples": len(ids), "rows": rows["rows"],
        "lost": len(meant - set(ids)),
        "duplicated": len(ids) - len(set(ids)),
        "opt_outs_listed": len(opted_out & set(ids)),
        "token_mismatch": len(rows["token_mismatch"]),
        "misattributed_samples": len(rows["misattributed"]), "worst_row_cosine": rows["worst_row_cosine"],
        "validate_export_ok": fmt.ok, "validate_errors": fmt.errors[:10],
        "wrong_answers": driven["events"][:20], "http": driven["codes"], "end_resend": resent,
        "failures": sum(v for k, v in driven["codes"].items() if k.isdigit() and int(k) >= 500),
        "restarts": restarts,
        "minutes": round(minutes_serving, 2),
        "max_rss_mib": max((m for _, _, m in rss), default=0.0),
        "steady_rss_by_server_life": flat,
        "rss_series": rss,
        "work_dir": work,
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "rss_series"}, indent=1))
    ok = (result["lost"] == 0 and result["duplicated"] == 0 and result["misattributed_samples"] == 0
          and result["token_mismatch"] == 0 and result["opt_outs_listed"] == 0 and fmt.ok
          and not driven["events"])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
