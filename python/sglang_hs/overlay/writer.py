"""Background sample writer: atomic sample files, a durable manifest, one outcome per request."""

from __future__ import annotations

import collections
import errno
import json
import logging
import os
import queue
import re
import threading
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

from sglang_hs.format import (
    FILES_PER_SHARD,
    FORMAT_VERSION,
    Storage,
    append_manifest,
    open_manifest,
    read_manifest,
    shard_dir_name,
    write_sample_file,
)
from sglang_hs.overlay.rows import RequestState, build_sample
from sglang_hs.overlay.staging import SlabPool
from sglang_hs.protocol import DuplicateSampleError, ExportError, Outcome

logger = logging.getLogger("sglang_hs.overlay.writer")

Notify = Callable[[Outcome], None]


class SampleWriter:
    def __init__(
        self,
        out_dir: str,
        writer_tag: str,
        aux_layer_ids: Sequence[int],
        pool: SlabPool,
        notify: Notify,
        threads: int = 2,
        storage: Storage = Storage(),
    ):
        self.out_dir = out_dir
        self.tag = writer_tag
        self.aux_layer_ids = list(aux_layer_ids)
        self.pool = pool
        self.notify = notify
        self.storage = storage
        self.stats: Dict[str, float] = {"samples": 0, "tokens": 0, "bytes": 0, "failed": 0, "write_s": 0.0}
        # Seconds from a prompt's last rows leaving the forward to its manifest line, and the
        # part of it spent waiting for their device->host copy, for the most recent samples.
        self._durable_s: "collections.deque[Tuple[float, float]]" = collections.deque(maxlen=4096)
        self._lock = threading.Lock()
        self._manifest_lock = threading.Lock()
        self._ids = {e["id"] for e in read_manifest(out_dir)}
        self._shard, self._in_shard = self._find_shard()
        self._manifest_fd = open_manifest(out_dir)
        self._q: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._threads = [
            threading.Thread(target=self._run, name=f"sglang-hs-writer-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for t in self._threads:
            t.start()

    def _find_shard(self):
        pat = re.compile(re.escape(self.tag) + r"-(\d{5})")
        idx = max((int(m.group(1)) for d in os.listdir(self.out_dir) if (m := pat.fullmatch(d))), default=0)
        d = os.path.join(self.out_dir, shard_dir_name(self.tag, idx))
        n = len([f for f in os.listdir(d) if f.endswith(".safetensors")]) if os.path.isdir(d) else 0
        return idx, n

    def _claim_path(self, sid: str) -> str:
        with self._lock:
            if sid in self._ids:
                raise DuplicateSampleError(
                    f"sample id {sid!r} is already exported in {self.out_dir}; send a new rid"
                )
            if self._in_shard >= FILES_PER_SHARD:
                self._shard, self._in_shard = self._shard + 1, 0
            self._ids.add(sid)
            self._in_shard += 1
            rel = os.path.join(shard_dir_name(self.tag, self._shard), f"{sid}.safetensors")
        os.makedirs(os.path.join(self.out_dir, os.path.dirname(rel)), exist_ok=True)
        return rel

    def _unclaim(self, sid: str) -> None:
        with self._lock:
            self._ids.discard(sid)
            self._in_shard -= 1

    def submit(self, st: RequestState, aborted: Callable[[], bool]) -> None:
        self.pool.enqueue()
        self._q.put((st, aborted, time.perf_counter()))

    def drop(self, st: RequestState) -> None:
        """Forget a request's rows (aborted or failed mid-prefill); nothing is written."""
        for ev in st.ready:  # the copy engine may still be writing into these rows
            ev.synchronize()
        st.release()

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            st, aborted, submitted = job
            try:
                self._write(st, aborted, submitted)
            except Exception as e:  # never let one sample kill the writer or hang its request
                logger.exception("sglang-hs: writing sample %s failed", st.rid)
                self.notify(st.outcome(status=500, error=f"internal error writing sample {st.rid}: {e!r}"))
            finally:
                st.release()
                self.pool.dequeue()
                self._q.task_done()

    def _write(self, st: RequestState, aborted: Callable[[], bool], submitted: float) -> None:
        t0 = time.perf_counter()
        for ev in st.ready:  # device->host copies of these rows (GPU); wait here, not in the forward
            ev.synchronize()
        copied = time.perf_counter()
        if aborted():
            self.notify(st.outcome(aborted=True))
            return
        try:
            size, rel = self._commit(st)
        except ExportError as e:  # a duplicate id, a loss mask of the wrong length
            out = st.outcome(error=str(e), status=e.status_code)
        except OSError as e:
            status = 507 if e.errno in (errno.ENOSPC, errno.EDQUOT) else 500
            out = st.outcome(
                error=f"could not write sample {st.rid} to {self.out_dir}: {e.strerror or e} "
                "(the server keeps serving; free space or fix permissions and resend)",
                status=status,
            )
        else:
            out = st.outcome(ok=True, path=rel, num_tokens=st.prompt_len, bytes=size)
            with self._lock:
                self.stats["samples"] += 1
                self.stats["tokens"] += st.prompt_len
                self.stats["bytes"] += size
                self.stats["write_s"] += time.perf_counter() - t0
                self._durable_s.append((time.perf_counter() - submitted, copied - submitted))
        if not out.ok:
            with self._lock:
                self.stats["failed"] += 1
            logger.error("sglang-hs: sample %s not exported: %s", st.rid, out.error)
        self.notify(out)

    def _commit(self, st: RequestState):
        """Write the file, then list it: a sample exists once its manifest line does."""
        tensors = build_sample(st, self.storage)
        meta = {
            "format": FORMAT_VERSION,
            "id": st.rid,
            "aux_layer_ids": json.dumps(self.aux_layer_ids),
            "metadata": json.dumps(st.options.metadata or {}),
        }
        rel = self._claim_path(st.rid)
        path = os.path.join(self.out_dir, rel)
        try:
            size = write_sample_file(path, tensors, meta)
            try:
                with self._manifest_lock:  # one line at a time (append_manifest cuts a torn one)
                    append_manifest(self._manifest_fd, st.rid, rel, st.prompt_len)
            except BaseException:
                os.unlink(path)  # not in the manifest: not a sample
                raise
        except BaseException:
            self._unclaim(st.rid)
            raise
        return size, rel

    def fail(self, st: RequestState, error: str, status: int = 500) -> None:
        """Report a sample that cannot be exported (the rows were never complete)."""
        logger.error("sglang-hs: sample %s not exported: %s", st.rid, error)
        with self._lock:
            self.stats["failed"] += 1
        self.notify(st.outcome(error=error, status=status))

    def durable_latency(self) -> Dict[str, float]:
        """p50/p99/max (ms) of the time from a prompt's rows leaving the forward to its sample
        being durable, and of its part spent waiting for the device->host copy (on a GPU, the
        forward's own remaining time too, as the forward loop runs ahead of the device), over
        the most recent samples."""
        with self._lock:
            pairs = list(self._durable_s)
        if not pairs:
            return {}
        out = {}
        for name, xs in (("durable", sorted(p[0] for p in pairs)), ("copy_wait", sorted(p[1] for p in pairs))):
            pick = lambda q: round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 2)  # noqa: E731
            out.update({f"{name}_ms_p50": pick(0.5), f"{name}_ms_p99": pick(0.99), f"{name}_ms_max": pick(1.0)})
        out["durable_n"] = len(pairs)
        return out

    @property
    def queued(self) -> int:
        """Samples submitted and not yet written or failed."""
        return self._q.unfinished_tasks

    def flush(self) -> None:
        self._q.join()

    def close(self, timeout_s: Optional[float] = None) -> int:
        """Write what is queued (waiting at most timeout_s), stop the threads, close the
        manifest; return how many queued samples were left unwritten."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.queued and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.02)
        left = self.queued
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if not any(t.is_alive() for t in self._threads):
            os.close(self._manifest_fd)
        return left
