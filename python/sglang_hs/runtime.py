"""Per-scheduler-process export runtime: plans each extend forward, captures the exported
rows, and hands complete prompts to the writer. The seams call it with plain values."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from sglang_hs.capture import (
    AuxStates,
    ReqExport,
    Segment,
    gather_rows,
    parse_request_options,
    plan_forward,
    split_rows,
)
from sglang_hs.writer import SampleWriter

logger = logging.getLogger("sglang_hs.runtime")


@dataclasses.dataclass
class _Forward:
    rows: List[int]
    segments: List[Segment]
    host: Optional[torch.Tensor] = None
    ready: Optional[object] = None  # CUDA event: the host rows have landed
    reserved: int = 0


class DeviceStager:
    """Device->host copies of exported rows without stalling the forward loop.

    The rows are gathered on the forward stream, then a side stream copies them into pinned
    host memory (PyTorch's caching host allocator: a reusable pool, whose live size the host
    budget bounds) and records an event. Only the writer thread waits on that event.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copy(self, rows: torch.Tensor):
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(rows, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        rows.record_stream(self.stream)  # keep the device rows alive until the copy is done
        return host, ready


class ExportRuntime:
    def __init__(self, aux_layer_ids: Sequence[int], writer: Optional[SampleWriter]):
        self.aux_layer_ids = list(aux_layer_ids)
        self.num_aux = len(self.aux_layer_ids)
        self.writer = writer  # None on ranks that do not write
        self._fwd: Optional[_Forward] = None
        self._in_progress: Dict[int, ReqExport] = {}
        self._stager: Optional[DeviceStager] = None
        self.copies = 0  # device->host copies issued by this rank (proves who copies)
        self._last_log = time.monotonic()

    def new_state(
        self, rid: str, prompt_ids: Sequence[int], custom_params: Optional[dict], aborted: Callable[[], bool]
    ) -> Optional[ReqExport]:
        opts = parse_request_options(custom_params)  # validated already by the HTTP process
        if not opts.export:
            return None
        return ReqExport(rid=rid, prompt_ids=prompt_ids, options=opts, aborted=aborted)

    def begin_forward(self, states: Sequence[Optional[ReqExport]], prefix_lens, extend_lens) -> bool:
        """Plan one extend forward; True when this rank must capture rows from it."""
        rows, segments, failed = plan_forward(states, prefix_lens, extend_lens)
        for st in failed:
            self._fail(st)
        if not segments:
            return False
        if self.writer is None:
            for seg in segments:
                if seg.state.next_pos == seg.state.prompt_len:
                    seg.state.done = True
            return False
        self._fwd = _Forward(rows, segments)
        return True

    def capture(self, final: torch.Tensor, aux: Optional[AuxStates]) -> None:
        """Called inside the model's LogitsProcessor with every row of the forward."""
        fwd = self._fwd
        if fwd is None or fwd.host is not None:
            return
        if aux is None:
            raise RuntimeError("sglang-hs: aux hidden-state capture is off in this forward")
        n, hidden = len(fwd.rows), final.shape[-1]
        fwd.reserved = n * (self.num_aux + 1) * hidden * final.element_size()
        self.writer.budget.reserve(fwd.reserved)
        index = torch.tensor(fwd.rows, dtype=torch.long)
        if final.device.type == "cpu":
            fwd.host = gather_rows(final, aux, index, self.num_aux)
        else:
            rows = gather_rows(final, aux, index.pin_memory().to(final.device, non_blocking=True), self.num_aux)
            if self._stager is None:
                self._stager = DeviceStager(final.device)
            fwd.host, fwd.ready = self._stager.copy(rows)
        self.copies += 1

    def end_forward(self) -> None:
        fwd, self._fwd = self._fwd, None
        if fwd is None:
            return
        if fwd.host is None:
            for seg in fwd.segments:
                seg.state.fail("the forward produced no hidden states for this request "
                               "(the model bypassed its LogitsProcessor)")
                self._fail(seg.state)
            return
        for st in split_rows(fwd.host, fwd.segments, fwd.ready):
            st.done = True
            self._in_progress.pop(id(st), None)
            self.writer.submit(st, st.aborted)
        for seg in fwd.segments:
            if not seg.state.done:
                self._in_progress[id(seg.state)] = seg.state
        self._sweep()
        if time.monotonic() - self._last_log > 10:
            self._last_log = time.monotonic()
            logger.info("sglang-hs stats: %s", json.dumps(self.stats()))

    def stats(self) -> dict:
        w = self.writer
        d = {"copies": self.copies, "writer": dict(w.stats), "host_budget_peak": w.budget.peak,
             "host_budget_limit": w.budget.limit, "backpressure_wait_s": round(w.budget.waited_s, 3)}
        if self._stager is not None:
            d["pinned"] = {k: v for k, v in torch.cuda.host_memory_stats().items() if "bytes" in k}
        return d

    def abort_forward(self) -> None:
        """The forward raised: its rows never arrived, so the affected samples fail."""
        fwd, self._fwd = self._fwd, None
        if fwd is not None:
            self.writer.budget.release(fwd.reserved, queued=False)
            for seg in fwd.segments:
                seg.state.fail("the forward pass failed; see the server log")
                self._fail(seg.state)

    def _sweep(self) -> None:
        """Requests aborted mid chunked prefill: drop their rows, write nothing."""
        for key, st in list(self._in_progress.items()):
            if st.aborted():
                del self._in_progress[key]
                st.done = True
                self.writer.drop(st)
                self.writer.notify({"rid": st.rid, "ok": False, "aborted": True})

    def _fail(self, st: ReqExport) -> None:
        self._in_progress.pop(id(st), None)
        if self.writer is not None:
            self.writer.drop(st)
            self.writer.fail(st, st.error or "unknown error")
