"""Background sample writer: each complete sample into its sink, one outcome per request."""

from __future__ import annotations

import collections
import errno
import logging
import queue
import threading
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

from sglang_hs.format import Storage
from sglang_hs.overlay.config import ExportConfig
from sglang_hs.overlay.rows import RequestState
from sglang_hs.overlay.staging import Piece, SlabPool
from sglang_hs.protocol import ExportError, Outcome

logger = logging.getLogger("sglang_hs.overlay.writer")

Notify = Callable[[Outcome], None]


class _Release(NamedTuple):
    """A writer job: rows to give back once their copies have landed."""

    pieces: List[Piece]
    ready: List[Any]


class SampleWriter:
    """Writes complete samples into a sink (`sinks.py`) on background threads and reports
    each outcome; a sample counts as exported once its sink says it is durable."""

    def __init__(self, sink, pool: SlabPool, notify: Notify, threads: int = ExportConfig.writer_threads,
                 counters: Optional[dict] = None):
        self.sink = sink
        self.storage: Storage = sink.storage  # how the forward stages rows for this sink
        self.pool = pool
        self.notify = notify
        self.stats: Dict[str, float] = {"samples": 0, "tokens": 0, "bytes": 0, "failed": 0, "dropped": 0,
                                          "write_s": 0.0}
        # The same counts for SGLang's /metrics (stat name -> a Prometheus counter), if it is on.
        self.counters = counters or {}
        # Seconds from a prompt's last rows leaving the forward to its sample being durable,
        # and the part of it spent waiting for their device->host copy, for the most recent samples.
        self._durable_s: "collections.deque[Tuple[float, float]]" = collections.deque(maxlen=4096)
        self._lock = threading.Lock()
        self._last_shed_log = float("-inf")
        self._q: "queue.Queue[Optional[Union[tuple, _Release]]]" = queue.Queue()
        self._samples_queued = 0
        self._threads = [
            threading.Thread(target=self._run, name=f"sglang-hs-writer-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for t in self._threads:
            t.start()

    def submit(self, st: RequestState, aborted: Callable[[], bool]) -> None:
        self.pool.enqueue()
        with self._lock:
            self._samples_queued += 1
        self._q.put((st, aborted, time.perf_counter()))

    def drop(self, st: RequestState) -> None:
        """Forget a request's rows (aborted, failed or shed); nothing is written."""
        self.release(*st.take_rows())

    def release(self, pieces: List[Piece], ready: List[Any]) -> None:
        """Give host rows back once the device->host copies into them (`ready`: their CUDA
        events) have landed: at once if they have (asked without waiting), else a writer
        thread waits for them, never the forward loop. The scheduler thread calls this on
        aborts, failures and live capture's shedding."""
        if all(ev.query() for ev in ready):  # nothing in flight (CPU: copies are synchronous)
            for p in pieces:
                p.release()
        elif pieces:
            self.pool.enqueue()  # rows on their way back: back-pressure may wait for them
            self._q.put(_Release(pieces, ready))

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            if isinstance(job, _Release):
                try:
                    for ev in job.ready:  # on this writer thread, never the scheduler's
                        ev.synchronize()
                finally:
                    for p in job.pieces:
                        p.release()
                    self.pool.dequeue()
                    self._q.task_done()
                continue
            st, aborted, submitted = job
            try:
                self._write(st, aborted, submitted)
            except Exception as e:  # never let one sample kill the writer or hang its request
                logger.exception("sglang-hs: writing sample %s failed", st.rid)
                self.notify(st.outcome(status=500, error=f"internal error writing sample {st.rid}: {e!r}"))
            finally:
                st.release()
                with self._lock:
                    self._samples_queued -= 1
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
            placed = self.sink.put(st)
        except ExportError as e:  # a duplicate id, a loss mask of the wrong length, a store refusing
            out = st.outcome(error=str(e), status=e.status_code)
        except OSError as e:
            status = 507 if e.errno in (errno.ENOSPC, errno.EDQUOT) else 500
            out = st.outcome(
                error=f"could not write sample {st.rid} ({self.sink.name}): {e.strerror or e} "
                "(the server keeps serving; free space or fix permissions and resend)",
                status=status,
            )
        else:
            out = st.outcome(ok=True, path=placed.path, num_tokens=st.num_tokens, bytes=placed.bytes,
                             sink=self.sink.name, answer=placed.answer)
            with self._lock:
                self._count(samples=1, tokens=st.num_tokens, bytes=placed.bytes, write_s=time.perf_counter() - t0)
                self._durable_s.append((time.perf_counter() - submitted, copied - submitted))
        if not out.ok:
            with self._lock:
                self._count(failed=1)
            logger.error("sglang-hs: sample %s not exported: %s", st.rid, out.error)
        self.notify(out)

    def fail(self, st: RequestState, error: str, status: int = 500) -> None:
        """Report a sample that cannot be exported (the rows were never complete)."""
        logger.error("sglang-hs: sample %s not exported: %s", st.rid, error)
        with self._lock:
            self._count(failed=1)
        self.notify(st.outcome(error=error, status=status))

    def shed(self, st: RequestState) -> None:
        """Live capture dropped a sample under back-pressure: count it, log at most one line
        a minute, and report it (the HTTP process keeps its rid in flight until then)."""
        with self._lock:
            self._count(dropped=1)
            n, log = self.stats["dropped"], time.monotonic() - self._last_shed_log >= 60
            if log:
                self._last_shed_log = time.monotonic()
        if log:
            logger.warning("sglang-hs: live capture dropped sample %s: the host buffer is full (%d dropped so far; "
                           "a larger --export-host-buffer-gib or a faster disk keeps more)", st.rid, n)
        self.notify(st.outcome(error=st.error, status=503))

    def _count(self, **deltas: float) -> None:  # with the lock held
        for k, v in deltas.items():
            self.stats[k] += v
            if k in self.counters:
                self.counters[k].inc(v)

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
        return self._samples_queued

    def flush(self) -> None:
        self._q.join()

    def close(self, timeout_s: Optional[float] = None) -> int:
        """Write what is queued (waiting at most timeout_s), stop the threads, close the
        manifest; return how many queued samples were left unwritten."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._q.unfinished_tasks and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.02)
        left = self.queued
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if not any(t.is_alive() for t in self._threads):
            self.sink.close()
        return left
