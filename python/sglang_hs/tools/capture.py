"""`sglang-hs capture`: a chat dataset -> EAGLE-3 training data through exporting servers.

Resumable at any point: every sample the server reports durable is appended to
OUT/capture.jsonl (one line, flushed); a rerun skips those ids, and a sample the server made
durable just before a kill comes back as 409 "already exported", which also counts as done.
Each sample always goes to the same server (chosen from its id), so a resent sample meets its
earlier copy there (423 while in flight, 409 once durable) and is never exported twice. A
server that goes away is waited for (`server_wait_s`), not given up on; one that stays away
stops the run, and a rerun picks up where it stopped. Records are read and tokenised as they
are sent, so memory does not grow with the dataset.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import random
import signal
import sys
import time
from typing import Dict, Iterator, List, Optional

import aiohttp

from sglang_hs import __version__
from sglang_hs.format import (PROVENANCE_KEY, CaptureProvenance, SampleIdError, chat_template_sha256,
                              check_sample_id, human_bytes)
from sglang_hs.tools.masks import truncate
from sglang_hs.tools.records import RecordError, Sample, iter_records, sample_id, to_sample

JOURNAL = "capture.jsonl"
FAILED = "capture_failed.jsonl"
# The server list a run started with: which server a sample goes to depends on it.
SERVERS = "capture_servers.json"
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
    # How long a server that stopped answering (killed, restarting) is waited for before the
    # run stops; a rerun resumes.
    server_wait_s: float = 600.0
    # Accept a server list that differs from the one this OUT was started with.
    allow_new_servers: bool = False


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
    # Why the run stopped early, when it did (Ctrl-C, a server that did not come back).
    stopped_because: str = ""

    def line(self) -> str:
        return (f"{self.exported} exported, {self.already_exported} already there, {self.skipped_done} skipped "
                f"(done before), {self.failed} failed of {self.total}; {self.tokens} tokens, "
                f"{human_bytes(self.bytes)}, {self.seconds:.1f} s"
                + (f"; interrupted ({self.stopped_because}): rerun to resume" if self.interrupted else ""))


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


class ServerGone(Exception):
    """A server stopped answering and did not come back within server_wait_s."""


class ServersChangedError(ValueError):
    pass


def server_for(sample_id: str, servers: List[str]) -> str:
    """The server a sample always goes to: a stable hash of its id, not the current load, so a
    sample resent after a kill reaches the server that may still hold (or already wrote) it."""
    h = int.from_bytes(hashlib.sha1(sample_id.encode()).digest()[:8], "big")
    return servers[h % len(servers)]


def check_servers(out: str, servers: List[str], allow_new: bool) -> None:
    """Record the server list on the first run; refuse a different one on a rerun, since the
    samples in flight when the last run stopped would then be sent to another server too."""
    path = os.path.join(out, SERVERS)
    if os.path.exists(path):
        with open(path) as f:
            before = json.load(f)["servers"]
        if before == servers or allow_new:
            if before != servers:
                sys.stderr.write(f"[capture] server list changed from {before}: samples that were in flight "
                                 "when the last run stopped may be exported twice\n")
            else:
                return
        else:
            raise ServersChangedError(
                f"{out} was captured with --server {' --server '.join(before)}; this run names {servers}. "
                "A sample goes to the server its id hashes to, so rerun with the same list in the same order. "
                "To change it anyway, pass --allow-new-servers (samples in flight when the last run stopped "
                "may then be exported twice).")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"servers": servers}, f)
    os.replace(tmp, path)


# Connection-level failures: the server is not there (killed, restarting), as opposed to a
# server that answered or timed out on this request.
_GONE = (aiohttp.ClientConnectionError,)


async def _wait_until_up(session, url: str, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                if r.status == 200:
                    return True
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(2.0)
    return False


async def _post(session, url, path, body, cfg: "CaptureConfig") -> tuple:
    """(status, json) with retries and backoff for transient answers. A server that went away
    is waited for and the request resent to it; ServerGone if it does not come back."""
    delay = 0.5
    for attempt in range(cfg.retries + 1):
        try:
            async with session.post(url + path, json=body) as r:
                status, data = r.status, await r.json(content_type=None)
        except _GONE as e:
            status, data = None, {"error": {"message": f"{type(e).__name__}: {e}"}}
            if attempt < cfg.retries and not await _wait_until_up(session, url, cfg.server_wait_s):
                raise ServerGone(f"{url} stopped answering and was not back within {cfg.server_wait_s:.0f} s")
            continue
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
            status, data = None, {"error": {"message": f"{type(e).__name__}: {e}"}}
        if status is not None and status not in TRANSIENT:
            return status, data
        if attempt < cfg.retries:
            await asyncio.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 30)
    return status, data


async def _regenerate(session, url, cfg: CaptureConfig, tok, s: Sample) -> Sample:
    """Let the target model write every assistant turn, then export the whole conversation."""
    from sglang_hs.tools.masks import chat_ids_and_mask, prompt_ids

    msgs, out = s.messages, []
    for m in msgs:
        if m["role"] != "assistant":
            out.append(m)
            continue
        prompt = prompt_ids(tok, out)
        status, data = await _post(session, url, "/generate", {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
                                "custom_params": {"sglang_hs": {"export": False}}}}, cfg)
        if status != 200:
            raise RecordError(f"regeneration failed: HTTP {status}: {_msg(data)}")
        text = data.get("text")
        if text is None:
            text = tok.decode(data["output_ids"], skip_special_tokens=True)
        out.append({"role": "assistant", "content": text})
    ids, mask = chat_ids_and_mask(tok, out, cfg.last_turn_only, cfg.mask_reasoning)
    return Sample(s.id, ids, mask, out)


def provenance(cfg: CaptureConfig, tok, s: Sample, truncated: bool, regenerated: bool) -> CaptureProvenance:
    """What made this sample, stored with it (format.CaptureProvenance)."""
    policy = "template" if s.messages is not None else "given" if s.loss_mask is not None else "none"
    return CaptureProvenance(
        source=os.path.basename(cfg.data.rstrip("/")), tokenizer=getattr(tok, "name_or_path", "") or "",
        chat_template_sha256=chat_template_sha256(getattr(tok, "chat_template", None)), mask_policy=policy,
        last_turn_only=cfg.last_turn_only, mask_reasoning=cfg.mask_reasoning, max_length=cfg.max_length,
        truncated=truncated, regenerated=regenerated, sglang_hs_version=__version__)


def _msg(data) -> str:
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return data["error"].get("message", "")
    return str(data)[:500]


def _samples(cfg: CaptureConfig, tok, done: Dict[str, dict], summ: Summary, record_failure) -> Iterator[Sample]:
    """The records still to send, read and tokenised one at a time."""
    for i, rec in enumerate(iter_records(cfg.data)):
        if cfg.limit is not None and i >= cfg.limit:
            return
        summ.total += 1
        sid = sample_id(cfg.id_prefix, i, rec if isinstance(rec, dict) else {"not_json": str(rec)})
        if sid in done:
            summ.skipped_done += 1
            continue
        if isinstance(rec, RecordError):
            record_failure(sid, f"bad record: {rec}")
            continue
        try:
            yield to_sample(tok, rec, sid, cfg.last_turn_only, cfg.mask_reasoning)
        except (RecordError, ValueError, KeyError, TypeError) as e:
            record_failure(sid, f"bad record: {e}")


def count_records(path: str, limit: Optional[int]) -> Optional[int]:
    """For the progress line: lines of a JSONL file (cheap, no parsing), rows of a dataset;
    None for a pipe, which can be read only once."""
    if os.path.isdir(path):
        return None
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        n = sum(1 for line in f if line.strip())
    return n if limit is None else min(n, limit)


async def _capture(cfg: CaptureConfig, tok) -> Summary:
    os.makedirs(cfg.out, exist_ok=True)
    servers = [u.rstrip("/") for u in cfg.servers]
    check_servers(cfg.out, servers, cfg.allow_new_servers)
    done = load_done(cfg.out)
    summ = Summary()
    journal = open(os.path.join(cfg.out, JOURNAL), "a")
    failed_log = open(os.path.join(cfg.out, FAILED), "a")
    # At most `concurrency` samples are tokenised and not yet answered at any time.
    slots = asyncio.Semaphore(cfg.concurrency)
    t0 = time.perf_counter()
    stop = asyncio.Event()

    def stop_because(why: str) -> None:
        if not stop.is_set():
            summ.interrupted, summ.stopped_because = True, why
            stop.set()

    def record_failure(sid, why):
        summ.failed += 1
        failed_log.write(json.dumps({"id": sid, "error": why, "time": time.time()}) + "\n")
        failed_log.flush()

    async def one(session, s: Sample):
        url = server_for(s.id, servers)
        try:
            if cfg.regenerate and s.messages:
                s = await _regenerate(session, url, cfg, tok, s)
            regenerated = bool(cfg.regenerate and s.messages)
            ids, mask = truncate(s.input_ids, s.loss_mask, cfg.max_length)
            if mask is not None and not any(mask):
                raise RecordError("no assistant token left after truncation")
            opts = {"metadata": {PROVENANCE_KEY: dataclasses.asdict(provenance(
                cfg, tok, s, truncated=len(ids) < len(s.input_ids), regenerated=regenerated))}}
            if mask is not None:
                opts["loss_mask"] = mask
            status, data = await _post(session, url, "/generate", {
                "rid": s.id, "input_ids": ids,
                "sampling_params": {"max_new_tokens": 1, "custom_params": {"sglang_hs": opts}}}, cfg)
        except ServerGone as e:  # not this sample's fault: it stays unsent, a rerun sends it
            return stop_because(str(e))
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

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop_because, "stopped by a signal")
    timeout = aiohttp.ClientTimeout(total=None, sock_read=3600)
    progress = asyncio.ensure_future(_progress(summ, count_records(cfg.data, cfg.limit), t0, cfg.progress))
    in_flight: set = set()
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            for s in _samples(cfg, tok, done, summ, record_failure):
                await slots.acquire()
                if stop.is_set():
                    slots.release()
                    break
                task = asyncio.ensure_future(one(session, s))
                in_flight.add(task)
                task.add_done_callback(lambda t: (in_flight.discard(t), slots.release()))
            # Requests already sent finish (their samples become durable and are journaled);
            # after a stop nothing new starts.
            await asyncio.gather(*in_flight, return_exceptions=True)
    finally:
        progress.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        journal.close()
        failed_log.close()
    summ.seconds = time.perf_counter() - t0
    return summ


async def _progress(summ: Summary, n: Optional[int], t0: float, enabled: bool):
    while enabled:
        await asyncio.sleep(1.0)
        dt = time.perf_counter() - t0
        k = summ.exported + summ.already_exported + summ.failed
        rate = k / dt if dt else 0
        left = ""
        if n is not None:
            todo = n - summ.skipped_done
            left = f"/{todo}" + (f"  ETA {(todo - k) / rate:.0f} s" if rate else "")
        sys.stderr.write(f"\r[capture] {k}{left} samples  {rate:.1f} samples/s  {summ.tokens / dt:.0f} tokens/s  "
                         f"{summ.bytes / 1e9:.2f} GB   ")
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
