"""Per-scheduler-process export runtime: plans each forward, stages the exported rows in host
memory, and hands complete samples to the writer (a prompt once it went through forwards;
with decode rows, prompt and answer once the request finished). The seams call it with plain
values; every tensor-parallel rank runs it, only the writer rank stages and writes."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from sglang_hs.overlay.rows import (AuxStates, RequestState, Segment, gather_rows, plan_decode, plan_forward,
                                    row_index, split_rows, storage_planes)
from sglang_hs.overlay.staging import DeviceStager, GraphRows, Piece, SlabPool, copy_into
from sglang_hs.overlay.writer import SampleWriter
from sglang_hs.protocol import parse_request_options

logger = logging.getLogger("sglang_hs.overlay.runtime")

# Seconds between two stats lines of a rank (0: after every extend forward, for tests).
STATS_INTERVAL_ENV = "SGLANG_HS_STATS_INTERVAL_S"
# "1" (the GPU tests): a host sync in our hooks' own work fails loudly (SyncCheck).
SYNC_CHECK_ENV = "SGLANG_HS_SYNC_CHECK"


class SyncCheck:
    """Our hooks' own work on the scheduler thread, checked for host syncs: torch's CUDA sync
    debug mode at "error" (a blocking copy, `.item()` or `.tolist()` of a device tensor, a
    stream or device synchronize raise) and CUDA event waits refused on this thread, which
    that mode does not see. The seams enter it around the runtime's calls, never around
    SGLang's own forward. Used when SYNC_CHECK_ENV is "1"; otherwise `NO_CHECK` stands in."""

    def __init__(self):
        self._local = threading.local()
        wait = torch.cuda.Event.synchronize
        local = self._local

        def synchronize(event):  # writer threads (depth 0) wait as before; only the checked thread is refused
            if getattr(local, "depth", 0):
                raise RuntimeError("sglang-hs: a CUDA event wait on the scheduler thread inside an export hook")
            return wait(event)

        torch.cuda.Event.synchronize = synchronize

    def __enter__(self):
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            self._local.prev = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        self._local.depth = depth + 1

    def __exit__(self, *exc):
        self._local.depth -= 1
        if self._local.depth == 0:
            torch.cuda.set_sync_debug_mode(self._local.prev)


NO_CHECK = contextlib.nullcontext()


def sync_check():
    """The context the seams run the runtime's calls in (see SyncCheck)."""
    global _sync_check
    if _sync_check is None:
        _sync_check = SyncCheck() if os.environ.get(SYNC_CHECK_ENV) == "1" and torch.cuda.is_available() else NO_CHECK
    return _sync_check


_sync_check = None


@dataclasses.dataclass
class _Forward:
    segments: List[Segment]  # in the forward's row order
    decode: bool = False
    staged: Optional[List[Piece]] = None  # the exported rows in host slabs, in segment order
    ready: Optional[object] = None  # CUDA event: the staged rows have landed


def _rows(fwd: _Forward) -> int:
    return sum(seg.num_rows for seg in fwd.segments)


class ExportRuntime:
    def __init__(self, aux_layer_ids: Sequence[int], writer: Optional[SampleWriter], rank: str = "tp0"):
        self.rank = rank
        self.aux_layer_ids = list(aux_layer_ids)
        self.num_aux = len(self.aux_layer_ids)
        self.writer = writer  # None on ranks that do not write
        self._fwd: Optional[_Forward] = None
        self._in_progress: Dict[int, RequestState] = {}
        self._stager: Optional[DeviceStager] = None
        self._graph_rows = GraphRows(self.num_aux)  # decode CUDA graphs' rows (writer rank)
        self.copies = 0  # device->host copies issued by this rank (proves who copies)
        # Every prefix cap this rank decided, hashed in order: tensor-parallel ranks must agree
        # (a rank that reused a different prefix would run a different forward and, on GPUs,
        # hang its collectives), and the stats lines let a test or an operator compare them.
        self.prefix_caps = 0
        self._caps_digest = hashlib.sha256()
        self._stats_interval = float(os.environ.get(STATS_INTERVAL_ENV, "10"))
        self._last_log = time.monotonic()

    def prefix_cap(self, st: RequestState, upstream_max: int) -> int:
        cap = st.prefix_cap(upstream_max)
        self.prefix_caps += 1
        self._caps_digest.update(f"{st.rid}:{upstream_max}:{cap};".encode())
        return cap

    def new_state(
        self, rid: str, prompt_ids: Sequence[int], custom_params: Optional[dict], aborted: Callable[[], bool]
    ) -> Optional[RequestState]:
        opts = parse_request_options(custom_params)  # validated already by the HTTP process
        if opts.export is False:  # admission tags what it does not export (opted out, not sampled)
            return None
        return RequestState(rid=rid, prompt_ids=prompt_ids, options=opts, aborted=aborted)

    def begin_forward(self, states: Sequence[Optional[RequestState]], prefix_lens, extend_lens) -> bool:
        """Plan one extend forward; True when this rank must stage rows from it."""
        return self._begin(plan_forward(states, prefix_lens, extend_lens), decode=False)

    def begin_decode(self, states: Sequence[Optional[RequestState]], seq_lens) -> bool:
        """Plan one decode forward (the decode rows of its requests that want them)."""
        return self._begin(plan_decode(states, seq_lens), decode=True)

    def _begin(self, plan, decode: bool) -> bool:
        segments, failed = plan
        for st in failed:
            self._fail(st)
        self._maybe_log_stats()
        if self.writer is None or not segments:
            return False
        self._fwd = _Forward(segments, decode)
        return True

    def capture_decode_graph(self, final: torch.Tensor, aux: Optional[AuxStates]) -> None:
        """Called inside the LogitsProcessor while a decode CUDA graph is captured: the graph
        then copies every row into static buffers on each replay (writer rank only)."""
        if self.writer is not None and aux is not None:
            self._graph_rows.record(final, aux)

    def stage(self, final: torch.Tensor, aux: Optional[AuxStates]) -> None:
        """Called inside the model's LogitsProcessor with every row of the forward (or, after
        a decode graph's replay, with its static rows): copy the planned rows into host slabs.
        The calling thread never waits for the device: host room is found (or, in live
        capture, rows are shed) before any device work, the row index is a slice or a pinned
        non-blocking copy, and the device->host copy runs on a side stream."""
        fwd = self._fwd
        if fwd is None or fwd.staged is not None:
            return
        if aux is None:
            raise RuntimeError("sglang-hs: the model returned no aux hidden states in this forward")
        storage, pool = self.writer.storage, self.writer.pool
        hidden, dtype = final.shape[-1], storage.row_dtype(final.dtype)
        fwd.staged = pool.pieces(_rows(fwd), self.num_aux, hidden, dtype, scaled=storage.scaled)
        if fwd.staged is None:  # live capture and the host buffer is full: shed, never wait
            if not self._shed(fwd, SlabPool.row_bytes(self.num_aux, hidden, dtype, storage.scaled)):
                return
            fwd.staged = pool.pieces(_rows(fwd), self.num_aux, hidden, dtype, scaled=storage.scaled)
            if fwd.staged is None:  # room() counted it free; a guard, not a path
                self._shed_all(fwd)
                return
        aux_rows, final_rows = gather_rows(final, aux, row_index(fwd.segments, final.device), self.num_aux)
        planes = storage_planes(aux_rows, final_rows, storage)  # fp8: quantized here, before the copy
        if final.device.type == "cuda":
            if self._stager is None:
                self._stager = DeviceStager(final.device)
            fwd.ready = self._stager.copy(planes, fwd.staged)
        else:
            copy_into(planes, fwd.staged)
        self.copies += 1

    def _shed(self, fwd: _Forward, row_bytes: int) -> bool:
        """Make room for this forward's rows by dropping (and counting) its samples with the
        fewest rows held first, until the others fit: the most work is kept, and a dropped
        sample's rows come back to the pool at once where their copies have landed. Decided
        on the host before the rows are gathered. False (and no forward) when none is kept."""
        pool, need, dropped = self.writer.pool, _rows(fwd), set()
        for seg in sorted(fwd.segments, key=lambda g: g.state.rows_held):
            if need <= pool.room(row_bytes):
                break
            self._shed_one(seg.state)
            dropped.add(id(seg))
            need -= seg.num_rows
        fwd.segments = [seg for seg in fwd.segments if id(seg) not in dropped]
        if not fwd.segments:
            self._fwd = None
            return False
        return True

    def _shed_all(self, fwd: _Forward) -> None:
        for seg in fwd.segments:
            self._shed_one(seg.state)
        self._fwd = None

    def _shed_one(self, st: RequestState) -> None:
        self._in_progress.pop(id(st), None)
        st.drop("dropped: the host buffer was full (live capture)")
        self.writer.drop(st)
        self.writer.shed(st)

    def end_forward(self, graph_ran: bool = False) -> None:
        """After the forward was issued; graph_ran: it replayed a CUDA graph, so the hook did
        not run and a decode forward's rows are in the graph's static buffers."""
        if self._fwd is not None and self._fwd.decode and self._fwd.staged is None and graph_ran \
                and self._graph_rows.final is not None:
            self.stage(self._graph_rows.final, self._graph_rows.aux)
        fwd, self._fwd = self._fwd, None
        if fwd is None:
            return
        if fwd.staged is None:
            for seg in fwd.segments:
                self._drop(seg.state, "the forward produced no hidden states for this request "
                                      "(the model bypassed its LogitsProcessor)")
            return
        complete = split_rows(fwd.staged, fwd.segments, fwd.ready)
        for p in fwd.staged:  # the forward's own hold; the requests now hold the slabs
            p.release()
        for st in complete:
            self.writer.submit(st, st.aborted)
        if fwd.decode:  # its requests are generating, registered at their prefill; finish() ends them
            return
        for seg in fwd.segments:
            if seg.state.planned or seg.state.dropped:
                self._in_progress.pop(id(seg.state), None)
            else:
                self._in_progress[id(seg.state)] = seg.state
        self._sweep()

    def finish(self, st: RequestState, output_ids: Sequence[int], aborted: bool) -> None:
        """A request with decode rows finished (every rank): write its sample, or say why not."""
        if not st.decode_rows or st.planned:
            return
        error = st.finish(output_ids)
        self._in_progress.pop(id(st), None)
        if self.writer is None or st.dropped:
            return
        if aborted:
            st.drop(None)
            self.writer.drop(st)
            self.writer.notify(st.outcome(aborted=True))
        elif error:
            self._drop(st, error)
        else:
            self.writer.submit(st, st.aborted)

    def drain(self, timeout_s: float) -> None:
        """Shutdown: write every complete sample still queued, within timeout_s. Requests
        still mid-prefill (or, with decode rows, still generating) are not complete and are
        not written (their clients resend)."""
        if self.writer is None:
            return
        t0 = time.monotonic()
        queued = self.writer.queued
        left = self.writer.close(timeout_s)
        logger.warning("sglang-hs: %s drained: %d of %d queued samples written in %.1f s%s; %d unfinished (mid-prefill or generating) not written",
                       self.rank, queued - left, queued, time.monotonic() - t0,
                       f", {left} NOT written (timeout {timeout_s:.0f} s)" if left else "", len(self._in_progress))
        self.writer = None

    def _maybe_log_stats(self) -> None:
        if time.monotonic() - self._last_log >= self._stats_interval:
            self._last_log = time.monotonic()
            logger.info("sglang-hs stats: %s", json.dumps(self.stats()))

    def stats(self) -> dict:
        """What this rank did: it copies only where it writes; every rank plans the same caps."""
        d = {"rank": self.rank, "copies": self.copies, "prefix_caps": self.prefix_caps,
             "prefix_caps_digest": self._caps_digest.hexdigest()[:16]}
        w = self.writer
        if w is not None:
            d |= {"writer": {**w.stats, **w.durable_latency()}, "host": w.pool.stats()}
        return d

    def abort_forward(self) -> None:
        """The forward raised: its rows never arrived, so the affected samples fail."""
        fwd, self._fwd = self._fwd, None
        if fwd is not None:
            # The copy into these rows may still be landing: a writer thread waits for it.
            self.writer.release(fwd.staged or [], [fwd.ready] if fwd.ready is not None else [])
            for seg in fwd.segments:
                self._drop(seg.state, "the forward pass failed; see the server log")

    def _sweep(self) -> None:
        """Requests aborted mid chunked prefill: drop their rows, write nothing. Checked after
        extend forwards only: a request aborted while generating is finished (with an abort)
        by SGLang, and `finish` drops it."""
        for key, st in list(self._in_progress.items()):
            if st.aborted():
                del self._in_progress[key]
                st.drop(None)
                self.writer.drop(st)
                self.writer.notify(st.outcome(aborted=True))

    def _drop(self, st: RequestState, message: str) -> None:
        """A failure only the writer sees: report it, keep no rows; planning goes on."""
        st.drop(message)
        self._fail(st)

    def _fail(self, st: RequestState) -> None:
        self._in_progress.pop(id(st), None)
        if self.writer is not None:
            self.writer.drop(st)
            self.writer.fail(st, st.error or "unknown error")
