"""Which rows of a forward belong to which request, and stitching chunks into samples.

Plain Python/torch: the seams feed it numbers read off SGLang's batch, so every rule here
(chunked prefill, retraction, prefix caps, aborted requests) is unit-tested without a server.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

# Key of SamplingParams.custom_params under which a client passes export options.
REQUEST_KEY = "sglang_hs"
MAX_METADATA_CHARS = 16_384


class RequestOptionsError(ValueError):
    status_code = 400


@dataclasses.dataclass
class RequestOptions:
    export: bool = True
    loss_mask: Optional[List[int]] = None
    metadata: Optional[Dict[str, Any]] = None
    # Set by the HTTP process, one per /generate call: tells a request's outcome apart from
    # that of an earlier request with the same rid (e.g. one aborted when its client died).
    token: Optional[str] = None


def parse_request_options(custom_params: Optional[dict]) -> RequestOptions:
    """Read `sampling_params.custom_params["sglang_hs"]`: {"export", "loss_mask", "metadata"}
    (and "token", which the server sets itself)."""
    raw = (custom_params or {}).get(REQUEST_KEY) if isinstance(custom_params, dict) else None
    if raw is None:
        return RequestOptions()
    if not isinstance(raw, dict) or set(raw) - {"export", "loss_mask", "metadata", "token"}:
        raise RequestOptionsError(
            f"custom_params[{REQUEST_KEY!r}] must be a dict with keys export (bool), "
            f"loss_mask (list of 0/1, one per prompt token), metadata (dict); got {raw!r:.200}"
        )
    export = raw.get("export", True)
    if not isinstance(export, bool):  # bool("false") is True: a string must not mean yes
        raise RequestOptionsError(f"export must be true or false (a JSON boolean); got {export!r:.50}")
    opts = RequestOptions(export=export, token=raw.get("token"))
    lm = raw.get("loss_mask")
    if lm is not None:
        if not isinstance(lm, list) or any(v not in (0, 1) or isinstance(v, float) for v in lm):
            raise RequestOptionsError("loss_mask must be a list of 0/1 integers, one per prompt token")
        opts.loss_mask = [int(v) for v in lm]
    md = raw.get("metadata")
    if md is not None:
        import json

        if not isinstance(md, dict):
            raise RequestOptionsError("metadata must be a JSON object (dict)")
        if len(json.dumps(md)) > MAX_METADATA_CHARS:
            raise RequestOptionsError(f"metadata must serialize to at most {MAX_METADATA_CHARS} characters")
        opts.metadata = md
    return opts


@dataclasses.dataclass
class ReqExport:
    """Export state of one request; every TP rank keeps it, only the writer holds rows."""

    rid: str
    prompt_ids: Sequence[int]
    options: RequestOptions
    next_pos: int = 0  # prompt positions [0, next_pos) have gone through a forward
    # Planning is over: the whole prompt went through forwards, or planning failed it. Set
    # only by plan_forward, identically on every rank, because prefix_cap reads it there.
    done: bool = False
    # The writer keeps no rows for it and has reported its outcome (failed or aborted).
    # Writer rank only: planning goes on, so every rank still caps its prefix alike.
    dropped: bool = False
    error: Optional[str] = None
    chunks: List["Piece"] = dataclasses.field(default_factory=list)  # writer only, in prompt order
    rows_held: int = 0
    # Device->host copies still in flight for these rows (CUDA events); the writer waits on them.
    ready: List[Any] = dataclasses.field(default_factory=list)
    aborted: Callable[[], bool] = lambda: False

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    def prefix_cap(self, upstream_max: int) -> int:
        """Cached prefix tokens never pass through the forward, so an exported request may
        only reuse a prefix as long as what it has already exported (0 at first: full
        recompute; later chunks: exactly its own earlier chunks)."""
        if self.done:
            return upstream_max
        return min(upstream_max, self.next_pos)

    def message(self, **fields) -> dict:
        """A notification to the HTTP process about this request's outcome."""
        return {"rid": self.rid, "token": self.options.token, **fields}

    def fail(self, message: str) -> None:
        """Planning failed the sample (on every rank): never plan or write it again."""
        self.drop(message)
        self.done = True

    def drop(self, message: Optional[str]) -> None:
        """Never write the sample; the caller releases its rows (writer rank)."""
        self.error = message
        self.dropped = True

    def add_rows(self, start: int, pieces: Sequence["Piece"]) -> None:
        """Rows for prompt positions [start, ...); a restart at start < held (re-prefill
        after retraction) replaces the overlap instead of duplicating it."""
        if start < self.rows_held:
            keep, kept = start, []
            for c in self.chunks:
                if keep > 0:
                    kept.append(c.head(keep))
                    keep -= c.rows
                else:
                    c.release()
            self.chunks, self.rows_held = kept, start
        assert start == self.rows_held, (start, self.rows_held)
        for p in pieces:
            self.chunks.append(p)
            self.rows_held += p.rows

    def release(self) -> None:
        """Give the rows' host memory back (after the write, or when the sample is dropped)."""
        for c in self.chunks:
            c.release()
        self.chunks.clear()
        self.ready.clear()
        self.rows_held = 0


@dataclasses.dataclass
class Piece:
    """Consecutive rows of one request in host memory: aux [r, K, H] and final [r, H], both
    contiguous (so they stream to the file without a copy), and the slab that holds them."""

    aux: torch.Tensor
    final: torch.Tensor
    slab: Any = None  # sglang_hs.writer.Slab, reference-counted

    @property
    def rows(self) -> int:
        return self.aux.shape[0]

    def head(self, n: int) -> "Piece":
        return Piece(self.aux[:n], self.final[:n], self.slab) if n < self.rows else self

    def release(self) -> None:
        if self.slab is not None:
            self.slab.unref()
            self.slab = None


@dataclasses.dataclass
class Segment:
    state: ReqExport
    start: int  # prompt position of the first row
    num_rows: int


def plan_forward(
    states: Sequence[Optional[ReqExport]],
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
) -> Tuple[List[int], List[Segment], List[ReqExport]]:
    """Rows of one extend forward to export: (flat row indices, one segment per request,
    requests that failed).

    The forward's rows are the requests' extend tokens back to back. A request contributes
    the rows of its prompt positions; decode/output tokens and finished samples contribute
    none. A prefix beyond what the request has exported would leave a hole, so it fails the
    sample with a message instead of writing wrong rows.
    """
    rows: List[int] = []
    segments: List[Segment] = []
    failed: List[ReqExport] = []
    offset = 0
    for st, p, e in zip(states, prefix_lens, extend_lens):
        if st is not None and not st.done:
            if p > st.next_pos:
                st.fail(
                    f"rows {st.next_pos}..{p - 1} of request {st.rid} came from the prefix cache "
                    "and were never computed; this is a bug in sglang-hs, please report it"
                )
                failed.append(st)
            else:
                n = min(p + e, st.prompt_len) - p
                if n > 0:
                    rows.extend(range(offset, offset + n))
                    segments.append(Segment(st, p, n))
                    st.next_pos = p + n
                    st.done = st.next_pos == st.prompt_len
        offset += e
    return rows, segments, failed


AuxStates = Union[torch.Tensor, Sequence[torch.Tensor]]


def gather_rows(final: torch.Tensor, aux: AuxStates, index: torch.Tensor, num_aux: int):
    """(aux [n, K, H], final [n, H]) on the forward's device, rows in `index` order, each
    contiguous, so every request's rows are two contiguous blocks.

    `aux` is SGLang's list of K [N, H] tensors or its packed [N, K*H] buffer."""
    if isinstance(aux, torch.Tensor):
        aux_rows = aux.index_select(0, index).view(index.numel(), num_aux, -1)
    else:
        if len(aux) != num_aux:
            raise RuntimeError(f"model captured {len(aux)} aux layers, expected {num_aux}")
        aux_rows = torch.stack([a.index_select(0, index) for a in aux], dim=1)
    return aux_rows, final.index_select(0, index)


def split_rows(staged: Sequence[Piece], segments: Sequence[Segment], ready: Any = None) -> List[ReqExport]:
    """Hand each segment its rows out of the forward's staged pieces (which hold the
    exported rows back to back, in segment order); return the requests whose prompt is now
    complete. Each piece's slab gains one reference per segment that uses it."""
    complete = []
    it = iter(staged)
    cur, pos = None, 0  # current staged piece, rows of it already handed out
    for seg in segments:
        st, need, pieces = seg.state, seg.num_rows, []
        while need:
            if cur is None or pos == cur.rows:
                cur, pos = next(it), 0
            take = min(need, cur.rows - pos)
            if cur.slab is not None:
                cur.slab.ref()
            pieces.append(Piece(cur.aux[pos:pos + take], cur.final[pos:pos + take], cur.slab))
            pos += take
            need -= take
        if st.dropped:  # failed or aborted meanwhile
            for p in pieces:
                p.release()
            continue
        st.add_rows(seg.start, pieces)
        if ready is not None:
            st.ready.append(ready)
        if st.rows_held == st.prompt_len:
            complete.append(st)
    return complete


def build_sample(st: ReqExport) -> Dict[str, Union[torch.Tensor, List[torch.Tensor]]]:
    """The sample's tensors for `format.write_sample_file`: lists of pieces are written one
    after the other (the rows of successive chunks), never concatenated in memory."""
    tensors: Dict[str, Union[torch.Tensor, List[torch.Tensor]]] = {
        "token_ids": torch.tensor(list(st.prompt_ids), dtype=torch.int64),
        "aux_hidden_states": [c.aux for c in st.chunks],
        "final_hidden_states": [c.final for c in st.chunks],
    }
    if st.options.loss_mask is not None:
        if len(st.options.loss_mask) != st.prompt_len:
            raise RequestOptionsError(
                f"loss_mask has {len(st.options.loss_mask)} entries but the prompt has "
                f"{st.prompt_len} tokens; send one 0/1 per prompt token"
            )
        tensors["loss_mask"] = torch.tensor(st.options.loss_mask, dtype=torch.uint8)
    return tensors
