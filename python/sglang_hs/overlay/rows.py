"""Row planning: which rows of a forward belong to which request, and stitching a request's
pieces (its rows, forward after forward) into one sample.

A row is a position of the request's sequence. A prompt-only sample has the rows of its prompt
positions and is complete when the whole prompt went through forwards. With decode rows, the
rows of generated tokens follow, one per decode step (or many, when a retracted request
prefills its prompt and answer again); the sample is complete when the request finishes, with
one row fewer than tokens: the last generated token never goes through a forward.

Plain Python/torch: the seams feed it numbers read off SGLang's batch, so every rule here
(chunked prefill, retraction, prefix caps, aborted requests) is unit-tested without a server.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from sglang_hs.format import Storage, coalesce, quantize_rows
from sglang_hs.overlay.staging import Piece, joined
from sglang_hs.protocol import Outcome, RequestOptions, RequestOptionsError


@dataclasses.dataclass
class RequestState:
    """Export state of one request; every TP rank keeps it, only the writer holds rows."""

    rid: str
    prompt_ids: Sequence[int]
    options: RequestOptions
    next_pos: int = 0  # positions [0, next_pos) have gone through a forward
    # Planning is over: the whole prompt went through forwards (decode rows: the request
    # finished), or planning failed it. Set identically on every rank, because prefix_cap
    # reads it there.
    planned: bool = False
    output_ids: Optional[List[int]] = None  # decode rows: the generated tokens, once finished
    # The writer keeps no rows for it and has reported its outcome (failed or aborted).
    # Writer rank only: planning goes on, so every rank still caps its prefix alike.
    dropped: bool = False
    error: Optional[str] = None
    pieces: List[Piece] = dataclasses.field(default_factory=list)  # writer only, in prompt order
    rows_held: int = 0
    # The newest device->host copy of these rows (a CUDA event; all copies go through one
    # stream, so it lands after the earlier ones); the writer waits on it.
    ready: List[Any] = dataclasses.field(default_factory=list)
    aborted: Callable[[], bool] = lambda: False

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def decode_rows(self) -> bool:
        return self.options.decode_rows

    @property
    def token_ids(self) -> List[int]:
        """The sample's true sequence: the prompt, then (decode rows) what was generated."""
        return [*self.prompt_ids, *(self.output_ids or ())]

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_ids or ())

    @property
    def num_rows(self) -> int:
        """Rows the finished sample holds: every prompt position, plus (decode rows) every
        generated position but the last, whose state no forward computes."""
        if self.output_ids:
            return self.prompt_len + len(self.output_ids) - 1
        return self.prompt_len

    @property
    def complete(self) -> bool:
        if self.decode_rows and self.output_ids is None:
            return False  # still generating
        return self.rows_held == self.num_rows

    def prefix_cap(self, upstream_max: int) -> int:
        """Cached prefix tokens never pass through the forward, so an exported request may
        only reuse a prefix as long as what it has already exported (0 at first: full
        recompute; later chunks: exactly its own earlier chunks)."""
        if self.planned:
            return upstream_max
        return min(upstream_max, self.next_pos)

    def outcome(self, **fields) -> Outcome:
        """What became of this request, for the HTTP process."""
        return Outcome(rid=self.rid, call_id=self.options.call_id, **fields)

    def fail(self, message: str) -> None:
        """Planning failed the sample (on every rank): never plan or write it again."""
        self.drop(message)
        self.planned = True

    def drop(self, message: Optional[str]) -> None:
        """Never write the sample; the caller releases its rows (writer rank)."""
        self.error = message
        self.dropped = True

    def add_rows(self, start: int, pieces: Sequence[Piece]) -> None:
        """Rows for positions [start, ...); a restart at start < held (re-prefill after
        retraction) replaces the overlap instead of duplicating it."""
        if start < self.rows_held:
            self.keep_rows(start)
        assert start == self.rows_held, (start, self.rows_held)
        for p in pieces:
            self.pieces.append(p)
            self.rows_held += p.rows

    def keep_rows(self, n: int) -> None:
        """Keep the rows of positions [0, n) and release the others."""
        keep, kept = n, []
        for p in self.pieces:
            if keep > 0:
                kept.append(p.head(min(keep, p.rows)))
                keep -= p.rows
            else:
                p.release()
        self.pieces, self.rows_held = kept, min(n, self.rows_held)

    def finish(self, output_ids: Sequence[int]) -> Optional[str]:
        """Decode rows: the request finished with these generated tokens. Rows of later
        positions (an overlap-scheduled forward that ran past the end) are released; returns
        why the sample cannot be written, if rows are missing."""
        self.output_ids = list(output_ids)
        self.planned = True
        if not self.output_ids:
            return f"request {self.rid} finished without generating a token, so it has no decode rows"
        if self.rows_held > self.num_rows:
            self.keep_rows(self.num_rows)
        if self.rows_held < self.num_rows and not self.dropped:
            return (f"request {self.rid} finished with rows for positions 0..{self.rows_held - 1} of "
                    f"0..{self.num_rows - 1}; this is a bug in sglang-hs, please report it")
        return None

    def release(self) -> None:
        """Give the rows' host memory back (after the write, or when the sample is dropped)."""
        pieces, _ = self.take_rows()
        for p in pieces:
            p.release()

    def take_rows(self) -> Tuple[List[Piece], List[Any]]:
        """Hand over the rows (pieces, and the copy events they wait on); the state keeps none."""
        pieces, ready = self.pieces, self.ready
        self.pieces, self.ready, self.rows_held = [], [], 0
        return pieces, ready


@dataclasses.dataclass
class Segment:
    state: RequestState
    start: int  # prompt position of the first row
    num_rows: int
    row: int = 0  # the forward's row holding it (its rows are rows row..row+num_rows-1)


def plan_forward(
    states: Sequence[Optional[RequestState]],
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
) -> Tuple[List[Segment], List[RequestState]]:
    """Rows of one extend forward to export: (one segment per request, in row order;
    requests that failed). Rows are spans, never one Python int per token. A sample the
    writer dropped is planned on (every rank caps its prefix alike) with no segment.

    The forward's rows are the requests' extend tokens back to back. A request contributes
    the rows of its prompt positions (decode rows: of every position it extends, which after a
    retraction include generated ones); finished samples contribute none. A prefix beyond what
    the request has exported would leave a hole, so it fails the sample with a message
    instead of writing wrong rows.
    """
    segments: List[Segment] = []
    failed: List[RequestState] = []
    offset = 0
    for st, p, e in zip(states, prefix_lens, extend_lens):
        if st is not None and not st.planned:
            if p > st.next_pos:
                st.fail(
                    f"rows {st.next_pos}..{p - 1} of request {st.rid} came from the prefix cache "
                    "and were never computed; this is a bug in sglang-hs, please report it"
                )
                failed.append(st)
            else:
                n = e if st.decode_rows else min(p + e, st.prompt_len) - p
                if n > 0:
                    if not st.dropped:  # planning goes on for a dropped sample; its rows are not kept
                        segments.append(Segment(st, p, n, offset))
                    st.next_pos = p + n
                    st.planned = not st.decode_rows and st.next_pos == st.prompt_len
        offset += e
    return segments, failed


def plan_decode(
    states: Sequence[Optional[RequestState]], seq_lens: Sequence[int]
) -> Tuple[List[Segment], List[RequestState]]:
    """Rows of one decode forward to export, as plan_forward: request i's row is row i, the
    position seq_lens[i] - 1 (the token this step feeds in). Only requests with decode rows
    that have not finished contribute."""
    segments: List[Segment] = []
    failed: List[RequestState] = []
    for i, (st, n) in enumerate(zip(states, seq_lens)):
        if st is None or not st.decode_rows or st.planned:
            continue
        pos = int(n) - 1
        if pos > st.next_pos:
            st.fail(f"decode row {pos} of request {st.rid} follows row {st.next_pos - 1}: rows "
                    f"{st.next_pos}..{pos - 1} were never computed; this is a bug in sglang-hs, please report it")
            failed.append(st)
            continue
        if not st.dropped:
            segments.append(Segment(st, pos, 1, i))
        st.next_pos = pos + 1
    return segments, failed


def spans(segments: Sequence[Segment]) -> List[Tuple[int, int]]:
    """The forward rows the segments take, as (first row, rows) runs: adjacent segments join."""
    out: List[Tuple[int, int]] = []
    for seg in segments:
        if out and out[-1][0] + out[-1][1] == seg.row:
            out[-1] = (out[-1][0], out[-1][1] + seg.num_rows)
        else:
            out.append((seg.row, seg.num_rows))
    return out


RowIndex = Union[slice, torch.Tensor]


def row_index(segments: Sequence[Segment], device: torch.device) -> RowIndex:
    """Which of a forward's rows to gather, for `gather_rows`: one run is a slice (no index at
    all: a decode step whose every request exports, a prefill of exported prompts only);
    otherwise an index built on the host from the runs (one torch call per forward, not a
    Python int per row) and copied from pinned memory without blocking the calling thread."""
    runs = spans(segments)
    if len(runs) == 1:
        return slice(runs[0][0], runs[0][0] + runs[0][1])
    starts, lengths = torch.tensor(runs, dtype=torch.long).unbind(1)
    offsets = torch.cumsum(lengths, 0) - lengths
    index = torch.repeat_interleave(starts - offsets, lengths) + torch.arange(int(lengths.sum()))
    if device.type != "cuda":
        return index
    return index.pin_memory().to(device, non_blocking=True)


AuxStates = Union[torch.Tensor, Sequence[torch.Tensor]]


def gather_rows(final: torch.Tensor, aux: AuxStates, index: RowIndex, num_aux: int):
    """(aux [n, K, H], final [n, H]) on the forward's device, rows in `index` order (a
    `row_index`), each contiguous, so every request's rows are two contiguous blocks. Always
    new tensors, never views of the forward's own (they are quantized in place and copied to
    the host after the next forward may have reused SGLang's buffers).

    `aux` is SGLang's list of K [N, H] tensors or its packed [N, K*H] buffer."""
    def take(x, own=True):  # own: a slice's rows copied out (index_select and stack copy anyway)
        return (x[index].clone() if own else x[index]) if isinstance(index, slice) else x.index_select(0, index)

    if isinstance(aux, torch.Tensor):
        rows = take(aux)
        aux_rows = rows.view(rows.shape[0], num_aux, -1)
    else:
        if len(aux) != num_aux:
            raise RuntimeError(f"model captured {len(aux)} aux layers, expected {num_aux}")
        aux_rows = torch.stack([take(x, own=False) for x in aux], dim=1)
    return aux_rows, take(final)


def storage_planes(aux_rows: torch.Tensor, final_rows: torch.Tensor, storage: Storage) -> List[torch.Tensor]:
    """A forward's gathered rows as they are stored, on their device, in `Piece.planes` order:
    [aux, final] in the stored dtype, or fp8 [aux, final, aux_scale, final_scale]. Quantizes
    the gathered rows in place (they are the caller's own copies)."""
    if storage.scaled:
        qa, sa = quantize_rows(aux_rows)
        qf, sf = quantize_rows(final_rows)
        return [qa, qf, sa, sf]
    dt = storage.row_dtype(final_rows.dtype)
    return [aux_rows.to(dt), final_rows.to(dt)]


def split_rows(staged: Sequence[Piece], segments: Sequence[Segment], ready: Any = None) -> List[RequestState]:
    """Hand each segment its rows out of the forward's staged pieces (which hold the
    exported rows back to back, in segment order); return the requests whose sample is now
    complete. Each piece's slab gains one reference per segment that uses it. One `split`
    per staged piece and plane makes every segment's views (a decode step: one piece, one
    row per request)."""
    pieces_of: List[List[Piece]] = [[] for _ in segments]
    i, left = 0, segments[0].num_rows if segments else 0  # the segment being filled, its rows still to place
    for piece in staged:
        sizes, owners, room = [], [], piece.rows
        while room and i < len(segments):
            take = min(room, left)
            sizes.append(take)
            owners.append(i)
            room, left = room - take, left - take
            if left == 0:
                i += 1
                left = segments[i].num_rows if i < len(segments) else 0
        for k, cut in zip(owners, piece.split(sizes)):
            pieces_of[k].append(cut)
    complete = []
    for seg, pieces in zip(segments, pieces_of):
        st = seg.state
        if st.dropped:  # failed or aborted meanwhile
            for p in pieces:
                p.release()
            continue
        st.add_rows(seg.start, pieces)
        if ready is not None:  # one copy stream: its newest event covers the earlier copies
            st.ready[:] = [ready]
        if st.complete:
            complete.append(st)
    return complete


def _select_rows(parts: Sequence[torch.Tensor], pos: torch.Tensor) -> List[torch.Tensor]:
    """Rows `pos` (sorted) of the parts taken as one tensor, a piece per (coalesced) part."""
    out, start = [], 0
    for p in coalesce(parts):
        out.append(p.index_select(0, pos[(pos >= start) & (pos < start + p.shape[0])] - start))
        start += p.shape[0]
    return out


def build_sample(st: RequestState, storage: Storage = Storage()) -> Dict[str, Union[torch.Tensor, List[torch.Tensor]]]:
    """The sample's tensors for `format.write_sample_file`: lists of pieces are written one
    after the other (the rows of successive chunks), never concatenated whole in memory; a
    request's decode rows are gathered out of their slab with one call per slab
    (`staging.joined`), not a view per generated token. With
    final rows at loss positions only, each piece's final rows at those positions are kept."""
    pieces = st.pieces
    tensors: Dict[str, Union[torch.Tensor, List[torch.Tensor]]] = {
        "token_ids": torch.tensor(st.token_ids, dtype=torch.int64),
        "aux_hidden_states": joined(pieces, "aux"),
    }
    mask = st.options.loss_mask
    if mask is not None:
        if len(mask) != st.prompt_len:
            raise RequestOptionsError(
                f"loss_mask has {len(mask)} entries but the prompt has "
                f"{st.prompt_len} tokens; send one 0/1 per prompt token"
            )
        # Generated tokens are the model's own answer: every one is trained on.
        tensors["loss_mask"] = torch.tensor([*mask, *[1] * len(st.output_ids or ())], dtype=torch.uint8)
    if storage.final_rows == "loss":
        if mask is None:  # admission refuses these; a guard, not a path
            raise RequestOptionsError("this server keeps final rows at loss positions only: send a loss_mask")
        pos = torch.nonzero(tensors["loss_mask"][: st.num_rows]).flatten()
        tensors["final_positions"] = pos
        finals = _select_rows(joined(pieces, "final"), pos)
        final_scales = _select_rows(joined(pieces, "final_scale"), pos) if storage.scaled else None
    else:
        finals = joined(pieces, "final")
        final_scales = joined(pieces, "final_scale") if storage.scaled else None
    tensors["final_hidden_states"] = finals
    if storage.scaled:
        tensors["aux_hidden_states_scale"] = joined(pieces, "aux_scale")
        tensors["final_hidden_states_scale"] = final_scales
    return tensors
