"""Benchmark building blocks: prompt throughput of a running server, and provenance."""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import requests

from sglang_hs.protocol import REQUEST_KEY


def random_prompts(n: int, length: int, seed: int, vocab: int = 32000) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def measure_prefill(url: str, prompts: Sequence[List[int]], concurrency: int, rid_prefix: Optional[str] = None,
                    extra: Optional[dict] = None, export: Optional[bool] = None) -> Dict[str, float]:
    """Send every prompt once (max_new_tokens=1) with `concurrency` clients; prompt tokens/s.
    export=False asks an export server not to export these requests (the request option).
    On an export server, held_ms_*: how long answers waited for their samples to be durable
    (meta_info.hidden_states_export.held_ms), and held_ms_last that of the round's last answer."""
    session = requests.Session()
    adapter = requests.adapters.HTTPAdapter(pool_maxsize=concurrency)
    session.mount("http://", adapter)

    def one(i):
        sp = {"max_new_tokens": 1, "temperature": 0}
        if export is not None:
            sp["custom_params"] = {REQUEST_KEY: {"export": export}}
        body = {"input_ids": prompts[i], "sampling_params": sp, **(extra or {})}
        if rid_prefix:
            body["rid"] = f"{rid_prefix}-{i:06d}"
        t = time.perf_counter()
        r = session.post(url + "/generate", json=body, timeout=3600)
        r.raise_for_status()
        end = time.perf_counter()
        held = None
        if b'"held_ms"' in r.content:  # parse only exported answers (return_hidden_states ones are MBs)
            held = r.json()["meta_info"]["hidden_states_export"]["held_ms"]
        return len(r.content), end - t, end, held

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as ex:
        done = list(ex.map(one, range(len(prompts))))
    wall = time.perf_counter() - t0
    tokens = sum(len(p) for p in prompts)
    lat = sorted(1000 * x[1] for x in done)
    res = {"prompts": len(prompts), "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
           "steady_tokens_per_s": steady_rate([(x[2], len(p)) for x, p in zip(done, prompts)]),
           "response_bytes": sum(x[0] for x in done), "latency_ms_p50": round(_pick(lat, 0.5), 1),
           "latency_ms_p99": round(_pick(lat, 0.99), 1)}
    held = sorted(x[3] for x in done if x[3] is not None)
    if held:
        res.update({"held_ms_p50": _pick(held, 0.5), "held_ms_p99": _pick(held, 0.99), "held_ms_max": held[-1],
                    "held_ms_last": max(done, key=lambda x: x[2])[3]})
    return res


def measure_decode(url: str, prompts: Sequence[List[int]], concurrency: int, max_new_tokens: int,
                   rid_prefix: str, export: Optional[bool] = None) -> Dict[str, float]:
    """Stream every prompt's answer (max_new_tokens, greedy, ignore_eos) with `concurrency`
    clients: output tokens/s over the round, and the inter-token latency (time between two
    streamed chunks over the tokens the later one adds) pooled over every request."""
    session = requests.Session()
    session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=concurrency))

    def one(i):
        sp = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
        if export is not None:
            sp["custom_params"] = {REQUEST_KEY: {"export": export}}
        body = {"rid": f"{rid_prefix}-{i:06d}", "input_ids": prompts[i], "sampling_params": sp, "stream": True}
        t0 = time.perf_counter()
        gaps, first, last, done = [], None, None, 0
        with session.post(url + "/generate", json=body, timeout=3600, stream=True) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                n = json.loads(line[5:])["meta_info"]["completion_tokens"]
                now = time.perf_counter()
                if n > done:
                    if last is None:
                        first = now - t0
                    else:
                        gaps.append((now - last) / (n - done))
                    last, done = now, n
        return done, first, gaps

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as ex:
        got = list(ex.map(one, range(len(prompts))))
    wall = time.perf_counter() - t0
    itl = sorted(1000 * g for _, _, gaps in got for g in gaps)
    ttft = sorted(1000 * f for _, f, _ in got if f is not None)
    out = sum(n for n, _, _ in got)
    return {"requests": len(prompts), "output_tokens": out, "seconds": wall, "output_tokens_per_s": out / wall,
            "itl_ms_p50": round(_pick(itl, 0.5), 3), "itl_ms_p99": round(_pick(itl, 0.99), 3),
            "ttft_ms_p50": round(_pick(ttft, 0.5), 1)}


def _pick(xs: Sequence[float], q: float) -> float:
    """The q-quantile of sorted xs (nearest rank)."""
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def steady_rate(answers: Sequence[Tuple[float, int]], lo: float = 0.1, hi: float = 0.9) -> Optional[float]:
    """Tokens per second answered between the moments a fraction `lo` and a fraction `hi` of the
    requests had their answers: the server's rate once full and before the round drains. A
    round's own rate (tokens / wall) also holds its start and the wait for its last answers
    (with export on, the last batch's copy and write), which a long capture pays once, not once
    per few-second round. answers: (time answered, prompt tokens) per request; None when the
    window holds no time (too few requests)."""
    ends = sorted(answers)
    i, j = int(lo * len(ends)), int(hi * len(ends)) - 1
    if j <= i or ends[j][0] <= ends[i][0]:
        return None
    return sum(n for _, n in ends[i + 1:j + 1]) / (ends[j][0] - ends[i][0])


def spread(xs: Sequence[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "rounds": list(xs)}


def summarize_rounds(per: Dict[str, List[dict]], base: str) -> Dict[str, dict]:
    """Per server label, every measured key as median/min/max over its rounds, and its per-round
    ratio of output tokens/s to `base`'s in the same round (rounds pair by index, so only a
    server with as many rounds as `base` gets one). A key a server never reports (acceptance for
    the target alone) is left out."""
    out = {}
    for label, rounds in per.items():
        if not rounds:
            continue
        out[label] = s = {k: spread([r[k] for r in rounds]) for k in rounds[0] if rounds[0][k] is not None}
        ref = per.get(base, [])
        if label != base and len(ref) == len(rounds):
            s[f"speedup_vs_{base}"] = spread([r["output_tokens_per_s"] / b["output_tokens_per_s"]
                                             for r, b in zip(rounds, ref)])
    return out


def provenance(command: Sequence[str]) -> dict:
    import torch

    def git(*a):
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, timeout=10).stdout.strip()
        except OSError:
            return ""

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("sglang", "transformers", "sglang_hs"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:
            versions[mod] = None
    hw = {"machine": platform.machine(), "cpu_count": os.cpu_count(), "platform": platform.platform()}
    if torch.cuda.is_available():
        hw["gpu"] = torch.cuda.get_device_name(0)
        hw["gpu_count"] = torch.cuda.device_count()
    return {
        "command": " ".join(command),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": git("rev-parse", "HEAD") or os.environ.get("SGLANG_HS_GIT_SHA", ""),
        "git_dirty": bool(git("status", "--porcelain")),
        # The GPU host's copy of the tree has the base commit's .git: gpu_session.sh says which
        # commit's tree it carried (written beside the wheel when it was built).
        **({"code_commit": os.environ["SGLANG_HS_CODE_COMMIT"]} if os.environ.get("SGLANG_HS_CODE_COMMIT") else {}),
        "versions": versions,
        "hardware": hw,
        "argv0": sys.argv[0],
    }
