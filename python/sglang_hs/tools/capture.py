"""`sglang-hs capture`: a chat dataset -> EAGLE-3 training data through exporting servers.

Resumable at any point: every sample the server reports durable is appended to
OUT/capture.jsonl (one line, flushed); a rerun skips those ids, and a sample the server made
durable just before a kill comes back as 409 "already exported", which also counts as done.
Each sample always goes to the same server (chosen from its id), so a resent sample meets its
earlier copy there (423 while in flight, 409 once durable) and is never exported twice. A
server that goes away is waited for (`server_wait_s`), not given up on; one that stays away
stops the run, and a rerun picks up where it stopped. A server that does not answer when the
run starts is a wrong URL until the user says it is still starting (`wait_at_start`). A stop
signal ends every wait at once: answered requests are journaled, waiting ones are abandoned
(unsent, so a rerun sends them). Records are read and tokenised as they are sent, so memory
does not grow with the dataset.
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
# Exit status of a run stopped because a server stayed away (EX_TEMPFAIL: a rerun resumes);
# a stop signal exits 128 + its number, as a shell reports it (130 Ctrl-C, 143 SIGTERM).
EXIT_SERVER_GONE = 75


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
    # A server that does not answer at start-up is a wrong URL (the run fails at once) unless
    # the user said it is still starting: then it is waited for server_wait_s too.
    wait_at_start: bool = False
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
    # The stop signal's number, when one stopped the run.
    signum: int = 0

    def line(self) -> str:
        return (f"{self.exported} exported, {self.already_exported} already there, {self.skipped_done} skipped "
                f"(done before), {self.failed} failed of {self.total}; {self.tokens} tokens, "
                f"{human_bytes(self.bytes)}, {self.seconds:.1f} s"
                + (f"; interrupted ({self.stopped_because}): rerun to resume" if self.interrupted else ""))

    def exit_code(self) -> int:
        if self.signum:
            return 128 + self.signum
        if self.interrupted:
            return EXIT_SERVER_GONE
        return 1 if self.failed else 0


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


class ServerUnreachable(Exception):
    """A --server did not answer when the run started."""


class Abandoned(Exception):
    """The run is stopping and this request has no answer to wait for: it stays unsent."""


class Stop:
    """Why the run stops. Setting it ends every wait (for a server, for a retry) at once."""

    def __init__(self):
        self.event = asyncio.Event()
        self.why = ""
        self.signum = 0

    def __call__(self, why: str, signum: int = 0) -> None:
        # A signal after a server stopped the run still decides the exit status.
        if not self.event.is_set() or (signum and not self.signum):
            self.why, self.signum = why, signum
        self.event.set()

    def __bool__(self) -> bool:
        return self.event.is_set()

    async def sleep(self, seconds: float) -> bool:
        """Sleep; True if the run was stopped meanwhile (at once, not after `seconds`)."""
        try:
            await asyncio.wait_for(self.event.wait(), seconds)
            return True
        except asyncio.TimeoutError:
            return False


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


def _why(e: BaseException) -> str:
    """What the user needs to know of a failed connection: 'Connection refused', not a repr."""
    os_error = getattr(e, "os_error", None)
    if isinstance(os_error, OSError) and os_error.errno:  # its strerror is asyncio's "Connect call failed"
        return os.strerror(os_error.errno)
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


@dataclasses.dataclass
class Wait:
    """A server being waited for: shown on the progress line."""
    url: str
    why: str
    since: float
    until: float

    def line(self) -> str:
        now = time.time()
        return (f"waiting for {self.url} ({self.why}) for {now - self.since:.0f} s, until "
                f"{time.strftime('%H:%M:%S', time.localtime(self.until))} (--server-wait)")


class Waits:
    """At most one /health poll per absent server, shared by every request waiting for it."""

    POLL_S = 2.0

    def __init__(self, session, wait_s: float, stop: Stop, note):
        self.session, self.wait_s, self.stop, self.note = session, wait_s, stop, note
        self.now: Dict[str, Wait] = {}
        # Why each server was last found absent (for the message when the wait runs out).
        self.last: Dict[str, str] = {}
        self._polls: Dict[str, asyncio.Future] = {}

    async def health(self, url: str) -> Optional[str]:
        """None if the server answers /health with 200, else why not."""
        try:
            async with self.session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return None if r.status == 200 else f"/health answered HTTP {r.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return _why(e)

    async def until_up(self, url: str, why: str) -> bool:
        """True once `url` answers /health again, False if not within wait_s; Abandoned if the
        run stops meanwhile."""
        if url not in self._polls:
            self._polls[url] = asyncio.ensure_future(self._poll(url, why))
        up = await asyncio.shield(self._polls[url])
        if up is None:
            raise Abandoned(url)
        return up

    async def _poll(self, url: str, why: str) -> Optional[bool]:
        now = time.time()
        w = self.now[url] = Wait(url, why, now, now + self.wait_s)
        self.note(f"{url} is not answering ({why}): waiting up to {self.wait_s:.0f} s, until "
                  f"{time.strftime('%H:%M:%S', time.localtime(w.until))}")
        try:
            while time.time() < w.until:
                if await self.stop.sleep(self.POLL_S):
                    return None
                why = await self.health(url)
                if why is None:
                    self.note(f"{url} is back after {time.time() - w.since:.0f} s")
                    return True
                w.why = why
            return False
        finally:
            self.last[url] = w.why
            del self.now[url], self._polls[url]

    def line(self) -> str:
        return "; ".join(w.line() for w in self.now.values())


async def _post(session, url, path, body, cfg: "CaptureConfig", waits: Waits) -> tuple:
    """(status, json) with retries and backoff for transient answers. A server that went away
    is waited for and the request resent to it; ServerGone if it does not come back, Abandoned
    if the run stops before there is an answer."""
    delay = 0.5
    for attempt in range(cfg.retries + 1):
        if attempt and waits.stop:
            raise Abandoned(url)
        try:
            async with session.post(url + path, json=body) as r:
                status, data = r.status, await r.json(content_type=None)
        except _GONE as e:
            status, data = None, {"error": {"message": f"{type(e).__name__}: {e}"}}
            if attempt < cfg.retries and not await waits.until_up(url, _why(e)):
                raise ServerGone(f"{url} stopped answering and was not back within {cfg.server_wait_s:.0f} s")
            continue
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
            status, data = None, {"error": {"message": f"{type(e).__name__}: {e}"}}
        if status is not None and status not in TRANSIENT:
            return status, data
        if attempt < cfg.retries:
            if await waits.stop.sleep(delay * (1 + random.random())):
                raise Abandoned(url)
            delay = min(delay * 2, 30)
    return status, data


async def _regenerate(session, url, cfg: CaptureConfig, tok, s: Sample, waits: Waits) -> Sample:
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
                                "custom_params": {"sglang_hs": {"export": False}}}}, cfg, waits)
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


async def _capture(cfg: CaptureConfig, tok, stop: Optional[Stop] = None) -> Summary:
    os.makedirs(cfg.out, exist_ok=True)
    servers = [u.rstrip("/") for u in cfg.servers]
    check_servers(cfg.out, servers, cfg.allow_new_servers)
    done = load_done(cfg.out)
    summ = Summary()
    stop = Stop() if stop is None else stop
    journal = open(os.path.join(cfg.out, JOURNAL), "a")
    failed_log = open(os.path.join(cfg.out, FAILED), "a")
    # At most `concurrency` samples are tokenised and not yet answered at any time.
    slots = asyncio.Semaphore(cfg.concurrency)
    t0 = time.perf_counter()

    def record_failure(sid, why):
        summ.failed += 1
        failed_log.write(json.dumps({"id": sid, "error": why, "time": time.time()}) + "\n")
        failed_log.flush()

    async def one(session, waits, s: Sample):
        url = server_for(s.id, servers)
        try:
            if cfg.regenerate and s.messages:
                s = await _regenerate(session, url, cfg, tok, s, waits)
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
                "sampling_params": {"max_new_tokens": 1, "custom_params": {"sglang_hs": opts}}}, cfg, waits)
        except ServerGone as e:  # not this sample's fault: it stays unsent, a rerun sends it
            return stop(str(e))
        except Abandoned:  # the run is stopping: unsent, a rerun sends it
            return
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

    # A server that stops answering mid-request is a connection error after sock_connect at
    # most (a host that drops packets would otherwise hold a request for minutes).
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=3600)
    in_flight: set = set()
    progress = None
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            waits = Waits(session, cfg.server_wait_s, stop, _note)
            n = count_records(cfg.data, cfg.limit)
            progress = asyncio.ensure_future(_progress(cfg.progress, lambda: _rates(summ, n, t0, waits)))
            for s in _samples(cfg, tok, done, summ, record_failure):
                await slots.acquire()
                if stop:
                    slots.release()
                    break
                task = asyncio.ensure_future(one(session, waits, s))
                in_flight.add(task)
                task.add_done_callback(lambda t: (in_flight.discard(t), slots.release()))
            # Answered requests finish (their samples become durable and are journaled);
            # after a stop nothing new starts and waits for a server end at once.
            await asyncio.gather(*in_flight, return_exceptions=True)
    finally:
        if progress is not None:
            progress.cancel()
        journal.close()
        failed_log.close()
    summ.seconds = time.perf_counter() - t0
    summ.interrupted, summ.stopped_because, summ.signum = bool(stop), stop.why, stop.signum
    return summ


async def reach_servers(servers: List[str], cfg: CaptureConfig, waits: Waits) -> None:
    """Every server answers /health before anything is sent. One that cannot be reached is a
    wrong URL (ServerUnreachable at once) unless cfg.wait_at_start; one that answers, but not
    200, is starting and is waited for. Abandoned if the run is stopped meanwhile."""
    whys = await asyncio.gather(*(waits.health(u) for u in servers))
    absent = {u: why for u, why in zip(servers, whys) if why is not None}
    for url, why in absent.items():
        if not (cfg.wait_at_start or why.startswith("/health answered")):
            raise ServerUnreachable(
                f"cannot reach {url} ({why}). Is the server running, and is this its address? To wait for a "
                "server that is still starting, give --server-wait SECONDS.")
    ups = await asyncio.gather(*(waits.until_up(u, why) for u, why in absent.items()))
    late = [u for u, up in zip(absent, ups) if not up]
    if late:
        raise ServerUnreachable(f"{', '.join(late)} did not answer /health within {cfg.server_wait_s:.0f} s "
                                f"(--server-wait); last: {'; '.join(waits.last[u] for u in late)}")


async def _main(cfg: CaptureConfig) -> Summary:
    """Reach the servers, load the tokenizer, capture; a stop signal ends any of these early."""
    stop = Stop()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if stop.signum:  # the second one: the user does not want to wait for answers either
            _note(f"{name}, a second stop signal: exiting now; requests in flight are abandoned (a rerun resends them)")
            os._exit(128 + signum)  # the journal is flushed line by line: nothing is lost
        stop(f"stopped by {name}", signum)
        _note(f"{name}: stopping; answered requests are journaled, waits for servers end (a rerun sends "
              f"those samples); a second signal exits at once")

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        servers = [u.rstrip("/") for u in cfg.servers]
        async with aiohttp.ClientSession() as session:
            waits = Waits(session, cfg.server_wait_s, stop, _note)
            progress = asyncio.ensure_future(_progress(cfg.progress, waits.line))
            try:
                await reach_servers(servers, cfg, waits)
            except Abandoned:
                return Summary(interrupted=True, stopped_because=stop.why, signum=stop.signum)
            finally:
                progress.cancel()
        tok = await asyncio.to_thread(load_tokenizer, cfg)
        return await _capture(cfg, tok, stop)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _note(msg: str) -> None:
    """A line that stays (the progress line is redrawn over it a second later)."""
    sys.stderr.write(f"\r[capture] {msg}".ljust(100) + "\n")
    sys.stderr.flush()


def _rates(summ: Summary, n: Optional[int], t0: float, waits: Waits) -> str:
    dt = time.perf_counter() - t0
    k = summ.exported + summ.already_exported + summ.failed
    rate = k / dt if dt else 0
    left = ""
    if n is not None:
        todo = n - summ.skipped_done
        left = f"/{todo}" + (f"  ETA {(todo - k) / rate:.0f} s" if rate else "")
    line = (f"{k}{left} samples  {rate:.1f} samples/s  {summ.tokens / dt:.0f} tokens/s  "
            f"{summ.bytes / 1e9:.2f} GB")
    return line + (f"  {waits.line()}" if waits.now else "")


async def _progress(enabled: bool, text):
    while enabled:
        await asyncio.sleep(1.0)
        line = text()
        if line:
            sys.stderr.write(f"\r[capture] {line}   ")
            sys.stderr.flush()


def load_tokenizer(cfg: CaptureConfig):
    from transformers import AutoTokenizer

    path = cfg.tokenizer
    if path is None:
        import requests

        path = requests.get(cfg.servers[0].rstrip("/") + "/get_model_info", timeout=30).json()["model_path"]
    return AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)


def capture(cfg: CaptureConfig) -> Summary:
    """Run a capture. ServerUnreachable if a server does not answer at start (see reach_servers)."""
    if cfg.id_prefix:
        try:
            check_sample_id(sample_id(cfg.id_prefix, 0, {}))
        except SampleIdError:
            raise SampleIdError(f"--id-prefix {cfg.id_prefix!r}: sample ids must start with a letter or digit "
                                "and use only A-Z a-z 0-9 . _ - (e.g. 'run1-')") from None
    summ = asyncio.run(_main(cfg))
    if cfg.progress:
        sys.stderr.write("\n")
    return summ
