"""Host staging of exported rows: from the device copy until the writer has them on disk.

A forward's exported rows are copied into fixed-size host slabs (pinned on a GPU, so the copy
is asynchronous, and reused, so memory stays bounded); each request holds its rows as
pieces that point into slabs, and a slab goes back to the pool when no piece uses it.
"""

from __future__ import annotations

import threading
import time
from typing import List, Optional, Sequence

import torch


class Piece:
    """Consecutive rows of one request in host memory: aux [r, K, H] and final [r, H], both
    contiguous (so they stream to the file without a copy), their fp8 scales [r, K] and [r]
    when stored as fp8, and the slab that holds them.

    A piece cut from another (`split`, `head`) is rows [at, at + r) of that one and makes its
    tensor views when they are first read: a decode step hands each request of its batch one
    row, and the scheduler thread then makes no tensor object per request (the writer thread
    makes them, when it writes the sample)."""

    __slots__ = ("_aux", "_final", "_aux_scale", "_final_scale", "slab", "_of", "_at", "_rows")

    def __init__(self, aux: torch.Tensor, final: torch.Tensor, slab: Optional["Slab"] = None,
                 aux_scale: Optional[torch.Tensor] = None, final_scale: Optional[torch.Tensor] = None):
        self._aux, self._final, self._aux_scale, self._final_scale = aux, final, aux_scale, final_scale
        self.slab = slab  # reference-counted
        self._of, self._at, self._rows = None, 0, aux.shape[0]

    @classmethod
    def _cut(cls, of: "Piece", at: int, rows: int, slab: Optional["Slab"]) -> "Piece":
        p = cls.__new__(cls)
        p._aux = p._final = p._aux_scale = p._final_scale = None
        p.slab, p._of, p._at, p._rows = slab, of, at, rows
        return p

    def _view(self) -> None:
        of, a, b = self._of, self._at, self._at + self._rows
        self._aux, self._final = of.aux[a:b], of.final[a:b]
        if of.aux_scale is not None:
            self._aux_scale, self._final_scale = of.aux_scale[a:b], of.final_scale[a:b]
        self._of = None

    @property
    def aux(self) -> torch.Tensor:
        if self._of is not None:
            self._view()
        return self._aux

    @property
    def final(self) -> torch.Tensor:
        if self._of is not None:
            self._view()
        return self._final

    @property
    def aux_scale(self) -> Optional[torch.Tensor]:
        if self._of is not None:
            self._view()
        return self._aux_scale

    @property
    def final_scale(self) -> Optional[torch.Tensor]:
        if self._of is not None:
            self._view()
        return self._final_scale

    @property
    def rows(self) -> int:
        return self._rows

    def planes(self) -> List[torch.Tensor]:
        """What the device copy fills, in the order `storage_planes` returns it."""
        return [x for x in (self.aux, self.final, self.aux_scale, self.final_scale) if x is not None]

    def head(self, n: int) -> "Piece":
        """Rows [0, n) in the same slab, taking over this piece's slab reference."""
        if n >= self.rows:
            return self
        return Piece._cut(self, 0, n, self.slab)

    def split(self, sizes: List[int]) -> List["Piece"]:
        """Consecutive runs of rows from the first, `sizes` long, in the same slab, each with
        its own slab reference and no tensor view until one is read."""
        if self.slab is not None:
            self.slab.ref(len(sizes))
        out, at = [], 0
        for n in sizes:
            out.append(Piece._cut(self, at, n, self.slab))
            at += n
        return out

    def release(self) -> None:
        if self.slab is not None:
            self.slab.unref()
            self.slab = None


PLANES = ("aux", "final", "aux_scale", "final_scale")


def joined(pieces: Sequence[Piece], plane: str) -> List[Optional[torch.Tensor]]:
    """One plane (a name in PLANES) of a request's pieces, in order, in as few tensors as
    their slabs allow: a piece with views of its own (a prompt's rows) is passed as it is;
    consecutive pieces cut for the request by decode steps (a row each, no view made yet)
    that lie in one slab are copied out of it by one gather (a torch call: it leaves the GIL),
    instead of a tensor view per generated token. Why: the writer thread made those views,
    and joined them, under the scheduler process's GIL; at live capture rate 1.0 on an H100
    that held the GIL 7.5% of the time and cost 8% of decode throughput
    (benchmark/results/gpu_live_discard_h100.json). [None] when the plane is not stored."""
    out: List[Optional[torch.Tensor]] = []
    run: List[int] = []  # byte offsets, in the run's slab, of its rows
    run_of = None  # (slab, a root plane tensor) of the run being gathered

    def flush():
        nonlocal run, run_of
        if run:
            slab, t = run_of
            rb = t.stride(0) * t.element_size()
            # every window of rb bytes in the slab, one per start byte; the run's rows are some of them
            windows = slab.data.as_strided((slab.data.numel() - rb + 1, rb), (1, 1))
            rows = windows.index_select(0, torch.tensor(run, dtype=torch.long))
            out.append(rows.view(t.dtype).view(len(run), *t.shape[1:]))
        run, run_of = [], None

    for p in pieces:
        if p._of is None or p.slab is None:
            flush()
            out.append(getattr(p, plane))
            continue
        root, at = p._of, p._at
        while root._of is not None:  # a cut of a cut
            at, root = at + root._at, root._of
        t = getattr(root, plane)
        if t is None:
            return [None]
        rb = t.stride(0) * t.element_size()
        first = t.data_ptr() - p.slab.data.data_ptr() + at * rb
        if not 0 <= first <= p.slab.data.numel() - p.rows * rb:  # rows not carved from its slab
            flush()
            out.append(getattr(p, plane))
            continue
        if run_of is not None and run_of[0] is not p.slab:
            flush()
        run_of = run_of or (p.slab, t)
        run.extend(range(first, first + p.rows * rb, rb))
    flush()
    return out


SLAB_BYTES = 32 << 20


class Slab:
    """A fixed-size block of (pinned) host memory holding rows of several requests; returned
    to its pool when the last request using it has been written or dropped."""

    __slots__ = ("data", "pool", "refs", "pooled")

    def __init__(self, data: torch.Tensor, pool: "SlabPool", pooled: bool):
        self.data, self.pool, self.refs, self.pooled = data, pool, 0, pooled

    def ref(self, n: int = 1) -> None:
        with self.pool._cv:
            self.refs += n

    def unref(self) -> None:
        with self.pool._cv:
            self.refs -= 1
            if self.refs == 0:
                self.pool._give(self)


class SlabPool:
    """Bounded, reusable host memory for exported rows, from device copy until on disk.

    At most limit/slab_bytes slabs are ever allocated (pinned on a GPU, so device->host copies
    are asynchronous); all have one size, so they are reused without fragmentation. Successive
    forwards' rows are packed into the current slab until it is full (a decode step stages a
    few rows, and with decode rows they are kept until their requests finish). When no slab is
    free, `take` blocks the forward loop (back-pressure) as long as the writer has queued
    samples whose slabs it will free. Rows of prompts still being chunk-prefilled cannot be
    written yet; if they alone hold every slab, waiting would deadlock, so an unpooled
    (pageable, freed after use) slab is handed out instead and counted as overflow.
    drop_when_full (live capture): never wait nor overflow; `pieces` returns None instead and
    the caller drops those rows.
    """

    ALIGN = 64  # bytes; each piece starts aligned, so every view of it is

    def __init__(self, limit_bytes: int, slab_bytes: int = SLAB_BYTES, pin: bool = False,
                 drop_when_full: bool = False):
        self.slab_bytes = slab_bytes
        self.max_slabs = max(1, limit_bytes // slab_bytes)
        self.pin = pin
        self.drop_when_full = drop_when_full
        self.pooled = 0
        self.in_use = 0
        self.peak_in_use = 0
        self.overflow = 0
        self.full = 0  # drop_when_full: times no slab was free
        self.queued = 0
        self.waited_s = 0.0
        self._free: List[Slab] = []
        self._cur: Optional[Slab] = None  # the slab new pieces are carved from
        self._at = 0  # its first free byte
        self._cv = threading.Condition()

    def take(self) -> Optional[Slab]:
        """A whole slab with one reference (None: drop_when_full and none is free)."""
        with self._cv:
            if self.drop_when_full and not self._free and self.pooled >= self.max_slabs:
                self.full += 1
                return None
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

    def pieces(self, n: int, num_aux: int, hidden: int, dtype: torch.dtype, scaled: bool = False) -> List[Piece]:
        """Host rows for n exported rows, in slabs: each holds r rows as (scales first, when
        `scaled`, so every view is aligned) aux [r, K, H] then final [r, H], contiguous."""
        k = num_aux
        es = dtype.itemsize
        row_bytes = self.row_bytes(num_aux, hidden, dtype, scaled)
        if self.slab_bytes // row_bytes < 1:
            raise RuntimeError(f"sglang-hs: one row ({row_bytes} bytes) exceeds a slab")
        pieces, a = [], 0
        with self._cv:
            start = (self._cur, self._at)
        while a < n:
            carved = self._carve(row_bytes, n - a)
            if carved is None:  # drop_when_full
                for p in pieces:
                    p.release()
                with self._cv:  # give the room these rows took back to the next forward's
                    cur, at = start
                    if cur is not None and cur.refs > 0:
                        self._cur, self._at = cur, at
                return None
            slab, at, r = carved

            def view(shape, dt, size):
                nonlocal at
                x = slab.data[at:at + size].view(dt).view(shape)
                at += size
                return x

            a_s = view((r, k), torch.float32, r * k * 4) if scaled else None
            f_s = view((r,), torch.float32, r * 4) if scaled else None
            aux = view((r, k, hidden), dtype, r * k * hidden * es)
            fin = view((r, hidden), dtype, r * hidden * es)
            pieces.append(Piece(aux, fin, slab, a_s, f_s))
            a += r
        return pieces

    @staticmethod
    def row_bytes(num_aux: int, hidden: int, dtype: torch.dtype, scaled: bool = False) -> int:
        """Host bytes one exported row takes: K aux planes and the final one, and (fp8) a
        float32 scale per plane."""
        return (num_aux + 1) * (hidden * dtype.itemsize + (4 if scaled else 0))

    def room(self, row_bytes: int) -> int:
        """Rows of row_bytes that `pieces` can place now without waiting or overflowing."""
        per = self.slab_bytes // row_bytes
        with self._cv:
            cur = (self.slab_bytes - self._at) // row_bytes if self._cur is not None else 0
            return cur + (len(self._free) + self.max_slabs - self.pooled) * per

    def _carve(self, row_bytes: int, want: int):
        """(slab, byte offset, rows) for up to `want` rows: from the current slab while it has
        room, else from a new one; the piece holds one reference to it."""
        with self._cv:
            cur = self._cur
            room = (self.slab_bytes - self._at) // row_bytes if cur is not None else 0
            if room >= 1:
                cur.refs += 1
            else:
                self._cur = None
        if room < 1:
            cur = self.take()
            if cur is None:
                return None
            room = self.slab_bytes // row_bytes
            with self._cv:
                self._cur, self._at = cur, 0
        with self._cv:
            at, r = self._at, min(room, want)
            self._at = -(-(at + r * row_bytes) // self.ALIGN) * self.ALIGN
        return cur, at, r

    def _give(self, slab: Slab) -> None:  # called with the lock held
        self.in_use -= 1
        if slab is self._cur:  # every piece carved from it is released: reuse it whole
            self._cur = None
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
                "host_bytes_in_use": self.in_use * self.slab_bytes,
                "host_bytes_peak_in_use": self.peak_in_use * self.slab_bytes, "overflow_slabs": self.overflow,
                "full": self.full,
                "backpressure_wait_s": round(self.waited_s, 3)}


class GraphRows:
    """The rows of a decode forward that ran as a CUDA graph. Inside a graph the forward runs
    without Python, so the LogitsProcessor hook runs only while each batch-size bucket is
    captured; there it records a copy of every row into these static buffers, which each
    replay then refills, and the planned rows are read from them after the replay (stream
    ordered, no synchronisation). Allocated at the first capture: upstream captures the
    largest bucket first (in every release of the window), so one buffer fits them all, and
    it lives as long as the graphs that write into it."""

    def __init__(self, num_aux: int):
        self.num_aux = num_aux
        self.final: Optional[torch.Tensor] = None  # [max_bs, H]
        self.aux: Optional[torch.Tensor] = None  # [max_bs, K*H], SGLang's packed layout

    def record(self, final: torch.Tensor, aux) -> None:
        n, h = final.shape[0], final.shape[-1]
        if not isinstance(aux, torch.Tensor) and len(aux) != self.num_aux:
            raise RuntimeError(f"model captured {len(aux)} aux layers, expected {self.num_aux}")
        if self.final is None:
            self.final = final.new_empty(final.shape)
            self.aux = final.new_empty(n, self.num_aux * h)
        if n > self.final.shape[0]:
            raise RuntimeError(f"sglang-hs: a decode CUDA graph of {n} rows was captured after one of "
                               f"{self.final.shape[0]}; upstream changed its capture order, please report it")
        self.final[:n].copy_(final)
        if isinstance(aux, torch.Tensor):
            self.aux[:n].copy_(aux)
        else:
            for k, a in enumerate(aux):
                self.aux[:n, k * h:(k + 1) * h].copy_(a)


class DeviceStager:
    """Device->host copies of exported rows without stalling the forward loop.

    The rows are gathered on the forward stream; a side stream then copies them into pinned
    slabs and records an event. Only the writer thread waits on that event.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copy(self, planes: List[torch.Tensor], pieces: List[Piece]):
        """planes: the forward's rows as `Piece.planes` orders them, on the device."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            copy_into(planes, pieces, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        # Keep the device rows alive until the side stream has read them.
        for x in planes:
            x.record_stream(self.stream)
        return ready


def copy_into(planes: List[torch.Tensor], pieces: List[Piece], non_blocking: bool = False) -> None:
    """Rows of `planes` (aux, final[, aux_scale, final_scale]) into the pieces, in order."""
    a = 0
    for p in pieces:
        for dst, src in zip(p.planes(), planes):
            dst.copy_(src[a:a + p.rows], non_blocking=non_blocking)
        a += p.rows


