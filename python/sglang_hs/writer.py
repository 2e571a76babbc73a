"""Background sample writer: bounded host memory, atomic files, durable manifest."""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import re
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from sglang_hs.capture import ReqExport, RequestOptionsError, build_sample
from sglang_hs.format import (
    FILES_PER_SHARD,
    FORMAT_VERSION,
    DuplicateSampleError,
    append_manifest,
    open_manifest,
    read_manifest,
    shard_dir_name,
    write_sample_file,
)

logger = logging.getLogger("sglang_hs.writer")

Notify = Callable[[dict], None]


SLAB_BYTES = 32 << 20


class Slab:
    """A fixed-size block of (pinned) host memory holding rows of several requests; returned
    to its pool when the last request using it has been written or dropped."""

    __slots__ = ("data", "pool", "refs", "pooled")

    def __init__(self, data: torch.Tensor, pool: "SlabPool", pooled: bool):
        self.data, self.pool, self.refs, self.pooled = data, pool, 0, pooled

    def ref(self) -> None:
        with self.pool._cv:
            self.refs += 1

    def unref(self) -> None:
        with self.pool._cv:
            self.refs -= 1
            if self.refs == 0:
                self.pool._give(self)


class SlabPool:
    """Bounded, reusable host memory for exported rows, from device copy until on disk.

    At most limit/slab_bytes slabs are ever allocated (pinned on a GPU, so device->host copies
    are asynchronous); all have one size, so they are reused without fragmentation. When none
    is free, `take` blocks the forward loop (back-pressure) as long as the writer has queued
    samples whose slabs it will free. Rows of prompts still being chunk-prefilled cannot be
    written yet; if they alone hold every slab, waiting would deadlock, so an unpooled
    (pageable, freed after use) slab is handed out instead and counted as overflow.
    """

    def __init__(self, limit_bytes: int, slab_bytes: int = SLAB_BYTES, pin: bool = False):
        self.slab_bytes = slab_bytes
        self.max_slabs = max(1, limit_bytes // slab_bytes)
        self.pin = pin
        self.pooled = 0
        self.in_use = 0
        self.peak_in_use = 0
        self.overflow = 0
        self.queued = 0
        self.waited_s = 0.0
        self._free: List[Slab] = []
        self._cv = threading.Condition()

    def take(self) -> Slab:
        with self._cv:
            t0 = None
            while not self._free and self.pooled >= self.max_slabs and self.queued > 0:
                t0 = t0 or time.perf_counter()
                self._cv.wait(timeout=1.0)
            if t0:
                self.waited_s += time.perf_counter() - t0
            if self._free:
                slab = self._free.pop()
            elif self.pooled < self.max_slabs:
                self.pooled += 1
                slab = Slab(torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=self.pin), self, True)
            else:
                self.overflow += 1
                slab = Slab(torch.empty(self.slab_bytes, dtype=torch.uint8), self, False)
            slab.refs = 1
            self.in_use += 1
            self.peak_in_use = max(self.peak_in_use, self.in_use)
            return slab

    def _give(self, slab: Slab) -> None:  # called with the lock held
        self.in_use -= 1
        if slab.pooled:
            self._free.append(slab)
        self._cv.notify_all()

    def enqueue(self) -> None:
        with self._cv:
            self.queued += 1

    def dequeue(self) -> None:
        with self._cv:
            self.queued -= 1
            self._cv.notify_all()

    def stats(self) -> dict:
        return {"slab_bytes": self.slab_bytes, "max_slabs": self.max_slabs, "pinned": self.pin,
                "host_bytes_allocated": self.pooled * self.slab_bytes,
                "host_bytes_peak_in_use": self.peak_in_use * self.slab_bytes, "overflow_slabs": self.overflow,
                "backpressure_wait_s": round(self.waited_s, 3)}


class SampleWriter:
    def __init__(
        self,
        out_dir: str,
        writer_tag: str,
        aux_layer_ids: Sequence[int],
        pool: SlabPool,
        notify: Notify,
        threads: int = 2,
    ):
        self.out_dir = out_dir
        self.tag = writer_tag
        self.aux_layer_ids = list(aux_layer_ids)
        self.pool = pool
        self.notify = notify
        self.stats: Dict[str, float] = {"samples": 0, "tokens": 0, "bytes": 0, "failed": 0, "write_s": 0.0}
        self._lock = threading.Lock()
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

    def submit(self, st: ReqExport, aborted: Callable[[], bool]) -> None:
        self.pool.enqueue()
        self._q.put((st, aborted))

    def drop(self, st: ReqExport) -> None:
        """Forget a request's rows (aborted or failed mid-prefill); nothing is written."""
        for ev in st.ready:  # the copy engine may still be writing into these rows
            ev.synchronize()
        st.release()

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            st, aborted = job
            try:
                self._write(st, aborted)
            except Exception as e:  # never let one sample kill the writer or hang its request
                logger.exception("sglang-hs: writing sample %s failed", st.rid)
                self.notify(st.message(ok=False, status=500,
                                       error=f"internal error writing sample {st.rid}: {e!r}"))
            finally:
                st.release()
                self.pool.dequeue()
                self._q.task_done()

    def _write(self, st: ReqExport, aborted: Callable[[], bool]) -> None:
        msg = st.message(ok=False)
        t0 = time.perf_counter()
        try:
            for ev in st.ready:  # device->host copies of these rows (GPU); wait here, not in the forward
                ev.synchronize()
            if aborted():
                msg["aborted"] = True
                self.notify(msg)
                return
            tensors = build_sample(st)
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
                    append_manifest(self._manifest_fd, st.rid, rel, st.prompt_len)
                except BaseException:
                    os.unlink(path)  # not in the manifest: not a sample
                    raise
            except BaseException:
                self._unclaim(st.rid)
                raise
        except (DuplicateSampleError, RequestOptionsError) as e:
            msg.update(error=str(e), status=getattr(e, "status_code", 400))
        except OSError as e:
            status = 507 if e.errno in (errno.ENOSPC, errno.EDQUOT) else 500
            msg.update(
                error=f"could not write sample {st.rid} to {self.out_dir}: {e.strerror or e} "
                "(the server keeps serving; free space or fix permissions and resend)",
                status=status,
            )
        else:
            msg.update(ok=True, path=rel, num_tokens=st.prompt_len, bytes=size)
            with self._lock:
                self.stats["samples"] += 1
                self.stats["tokens"] += st.prompt_len
                self.stats["bytes"] += size
                self.stats["write_s"] += time.perf_counter() - t0
        if not msg["ok"]:
            with self._lock:
                self.stats["failed"] += 1
            logger.error("sglang-hs: sample %s not exported: %s", st.rid, msg.get("error"))
        self.notify(msg)

    def fail(self, st: ReqExport, error: str, status: int = 500) -> None:
        """Report a sample that cannot be exported (the rows were never complete)."""
        logger.error("sglang-hs: sample %s not exported: %s", st.rid, error)
        with self._lock:
            self.stats["failed"] += 1
        self.notify(st.message(ok=False, error=error, status=status))

    def flush(self) -> None:
        self._q.join()

    def close(self) -> None:
        self.flush()
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join()
        os.close(self._manifest_fd)
