"""`sglang-hs capture`: a chat dataset -> EAGLE-3 training data through exporting servers.

Resumable at any point: every sample the server reports durable is appended to
OUT/capture.jsonl (one line, flushed); a rerun skips those ids, and a sample the server made
durable just before a kill comes back as 409 "already exported", which also counts as done.
So a kill and a resume end with no sample missing and none duplicated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import signal
import sys
import time
from typing import Dict, List, Optional

import aiohttp

from sglang_hs.format import SampleIdError, check_sample_id, human_bytes
from sglang_hs.tools.masks import truncate
from sglang_hs.tools.records import RecordError, Sample, iter_records, sample_id, to_sample

JOURNAL = "capture.jsonl"
FAILED = "capture_failed.jsonl"
# 423: the same sample id is still in flight on the server (e.g. sent by a run that was just
# killed); it is freed once that request finishes or is aborted.
TRANSIENT = {423, 500, 502, 503, 504}


@dataclasses.dataclass
class CaptureConfig:
    servers: List[str]
    data: str
    out: str
    tokenizer: Optional[str] = None
    # Kimi-K2.5 and other checkpoints ship their tokenizer as remote code.
    trust_remote_code: bool = False
    concurrency: int = 32
    max_length: Optional[int] = None
    last_turn_only: bool = False
    mask_reasoning: bool = False
    regenerate: bool = False
    max_new_tokens: int = 1024
    temperature: float = 0.0
    retries: int = 5
    id_prefix: str = ""
    limit: Optional[int] = None
    progress: bool = True


@dataclasses.dataclass
class Summary:
    total: int = 0
    skipped_done: int = 0
    exported: int = 0
    already_exported: int = 0
    failed: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    interrupted: bool = False

    def line(self) -> str:
        return (f"{self.exported} exported, {self.already_exported} already there, {self.skipped_done} skipped "
                f"(done before), {self.failed} failed of {self.total}; {self.tokens} tokens, "
                f"{human_bytes(self.bytes)}, {self.seconds:.1f} s" + ("; interrupted" if self.interrupted else ""))


def load_done(out: str) -> Dict[str, dict]:
    path = os.path.join(out, JOURNAL)
    done = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    e = json.loads(line)
                    done[e["id"]] = e
                except (json.JSONDecodeError, KeyError):
                    pass  # a line torn by a kill: that sample is simply resent
    return done


class _Router:
    """Least-outstanding-requests over the servers (one URL may be an sglang-router)."""

    def __init__(self, urls: List[str]):
        self.load = {u.rstrip("/"): 0 for u in urls}

    def acquire(self) -> str:
        url = min(self.load, key=self.load.get)
        self.load[url] += 1
        return url

    def release(self, url: str) -> None:
        self.load[url] -= 1


async def _post(session, router, path, body, retries) -> tuple:
    """(status, json) with retries and backoff for transient failures."""
    delay = 0.5
    for attempt in range(retries + 1):
        url = router.acquire()
        try:
            async with session.post(url + path, json=body) as r:
                status, data = r.status, await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
            status, data = None, {"error": {"message": f"{type(e).__name__}: {e}"}}
        finally:
            router.release(url)
        if status is not None and status not in TRANSIENT:
            return status, data
        if attempt < retries:
            await asyncio.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 30)
    return status, data


async def _regenerate(session, router, cfg: CaptureConfig, tok, s: Sample) -> Sample:
    """Let the target model write every assistant turn, then export the whole conversation."""
    from sglang_hs.tools.masks import chat_ids_and_mask

    msgs, out = s.messages, []
    for m in msgs:
        if m["role"] != "assistant":
            out.append(m)
            continue
        prompt = list(tok.apply_chat_template(out, tokenize=True, add_generation_prompt=True,
                                              return_dict=True)["input_ids"])
        status, data = await _post(session, router, "/generate", {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
                                "custom_params": {"sglang_hs": {"export": False}}}}, cfg.retries)
        if status != 200:
            raise RecordError(f"regeneration failed: HTTP {status}: {_msg(data)}")
        text = data.get("text")
        if text is None:
            text = tok.decode(data["output_ids"], skip_special_tokens=True)
        out.append({"role": "assistant", "content": text})
    ids, mask = chat_ids_and_mask(tok, out, cfg.last_turn_only, cfg.mask_reasoning)
    return Sample(s.id, ids, mask, out)


def _msg(data) -> str:
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return data["error"].get("message", "")
    return str(data)[:500]


async def _capture(cfg: CaptureConfig, tok) -> Summary:
    os.makedirs(cfg.out, exist_ok=True)
    done = load_done(cfg.out)
    summ = Summary()
    journal = open(os.path.join(cfg.out, JOURNAL), "a")
    failed_log = open(os.path.join(cfg.out, FAILED), "a")
    router = _Router(cfg.servers)
    sem = asyncio.Semaphore(cfg.concurrency)
    t0 = time.perf_counter()
    stop = asyncio.Event()

    def record_failure(sid, why):
        summ.failed += 1
        failed_log.write(json.dumps({"id": sid, "error": why, "time": time.time()}) + "\n")
        failed_log.flush()

    async def one(session, s: Sample):
        async with sem:
            if stop.is_set():
                return
            try:
                if cfg.regenerate and s.messages:
                    s = await _regenerate(session, router, cfg, tok, s)
                ids, mask = truncate(s.input_ids, s.loss_mask, cfg.max_length)
                if mask is not None and not any(mask):
                    raise RecordError("no assistant token left after truncation")
                opts = {"metadata": {"source": os.path.basename(cfg.data)}}
                if mask is not None:
                    opts["loss_mask"] = mask
                status, data = await _post(session, router, "/generate", {
                    "rid": s.id, "input_ids": ids,
                    "sampling_params": {"max_new_tokens": 1, "custom_params": {"sglang_hs": opts}}}, cfg.retries)
            except RecordError as e:
                return record_failure(s.id, str(e))
            except Exception as e:  # one bad sample never stops the run
                return record_failure(s.id, f"{type(e).__name__}: {e}")
            info = (data.get("meta_info") or {}).get("hidden_states_export") if isinstance(data, dict) else None
            if status == 200 and info is None:
                record_failure(s.id, "the server answered without meta_info.hidden_states_export: "
                                     "is it running with --export-hidden-states-dir?")
            elif status == 200:
                summ.exported += 1
                summ.tokens += info["num_tokens"]
                summ.bytes += info.get("bytes", 0)
                journal.write(json.dumps({"id": s.id, "dir": info["dir"], "path": info["path"],
                                          "num_tokens": info["num_tokens"]}) + "\n")
                journal.flush()
            elif status == 409:  # made durable by a run that was killed before it could note it
                summ.already_exported += 1
                journal.write(json.dumps({"id": s.id, "already_exported": True}) + "\n")
                journal.flush()
            else:
                record_failure(s.id, f"HTTP {status}: {_msg(data)}")

    samples: List[Sample] = []
    for i, rec in enumerate(iter_records(cfg.data)):
        if cfg.limit is not None and i >= cfg.limit:
            break
        summ.total += 1
        sid = sample_id(cfg.id_prefix, i, rec if isinstance(rec, dict) else {"not_json": str(rec)})
        if sid in done:
            summ.skipped_done += 1
            continue
        if isinstance(rec, RecordError):
            record_failure(sid, f"bad record: {rec}")
            continue
        try:
            samples.append(to_sample(tok, rec, sid, cfg.last_turn_only, cfg.mask_reasoning))
        except (RecordError, ValueError, KeyError, TypeError) as e:
            record_failure(sid, f"bad record: {e}")

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.ensure_future(one(session, s)) for s in samples]
        progress = asyncio.ensure_future(_progress(summ, len(samples), t0, cfg.progress))
        waiter = asyncio.ensure_future(asyncio.gather(*tasks))
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            summ.interrupted = True
            # Requests already sent finish (their samples become durable and are journaled);
            # nothing new starts.
            await asyncio.gather(*tasks, return_exceptions=True)
        stopper.cancel()
        progress.cancel()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)
    journal.close()
    failed_log.close()
    summ.seconds = time.perf_counter() - t0
    return summ


async def _progress(summ: Summary, n: int, t0: float, enabled: bool):
    while enabled:
        await asyncio.sleep(1.0)
        dt = time.perf_counter() - t0
        k = summ.exported + summ.already_exported + summ.failed
        rate = k / dt if dt else 0
        eta = (n - k) / rate if rate else float("inf")
        sys.stderr.write(f"\r[capture] {k}/{n} samples  {rate:.1f} samples/s  {summ.tokens / dt:.0f} tokens/s  "
                         f"{summ.bytes / 1e9:.2f} GB  ETA {eta:.0f} s   ")
        sys.stderr.flush()


def load_tokenizer(cfg: CaptureConfig):
    from transformers import AutoTokenizer

    path = cfg.tokenizer
    if path is None:
        import requests

        path = requests.get(cfg.servers[0].rstrip("/") + "/get_model_info", timeout=30).json()["model_path"]
    return AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)


def capture(cfg: CaptureConfig) -> Summary:
    if cfg.id_prefix:
        try:
            check_sample_id(sample_id(cfg.id_prefix, 0, {}))
        except SampleIdError:
            raise SampleIdError(f"--id-prefix {cfg.id_prefix!r}: sample ids must start with a letter or digit "
                                "and use only A-Z a-z 0-9 . _ - (e.g. 'run1-')") from None
    tok = load_tokenizer(cfg)
    summ = asyncio.run(_capture(cfg, tok))
    if cfg.progress:
        sys.stderr.write("\n")
    return summ
