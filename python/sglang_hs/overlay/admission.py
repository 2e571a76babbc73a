"""Request admission in the HTTP process: which entries of a /generate call are exported,
their checks, and holding the final response until each sample is durable.

Plain values in, plain values out: the seams read SGLang's request after its own
normalisation (every rid filled in, one sampling-params dict per entry) and call these.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import time
from typing import Container, List, Optional, Sequence, Set

from sglang_hs.format import check_sample_id
from sglang_hs.overlay.config import SINKS
from sglang_hs.protocol import (
    REQUEST_KEY,
    DuplicateSampleError,
    ExportError,
    RequestOptionsError,
    SampleInFlightError,
    check_spec_capture,
    parse_request_options,
)


@dataclasses.dataclass
class Admission:
    """The exported entries of one /generate call."""

    call_id: str
    rids: List[str]  # exported rids, in the call's order
    # Exported rids whose outcome this call has not taken (yet); dropped when the call ends.
    unclaimed: Set[str] = dataclasses.field(init=False)

    def __post_init__(self):
        self.unclaimed = set(self.rids)


def check_input_ids(input_ids, vocab_size: int) -> None:
    """Refuse token ids outside [0, vocab_size) with 400 before any work: from SGLang 0.5.21
    on nothing upstream checks them, and one such id kills the scheduler in the embedding
    lookup (releases.DIFFERENCES). Shapes that are not ids are left to SGLang's own checks."""
    seqs = input_ids if isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list) else [input_ids]
    for seq in seqs:
        if not isinstance(seq, list):
            continue
        bad = next((t for t in seq if isinstance(t, int) and not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestOptionsError(f"input_ids holds token id {bad}, outside the model's vocabulary "
                                      f"[0, {vocab_size})")


def take_spec_capture(obj, body: object) -> None:
    """Move SpecForge's `spec_capture` (one entry per prompt of a /generate body) into each
    entry's export options (`custom_params["sglang_hs"]["specforge"]`), giving a batch that
    shared one sampling-params dict a copy per entry. A body without it is left alone."""
    entries = body.get("spec_capture") if isinstance(body, dict) else None
    if entries is None:
        return
    batch = isinstance(obj.input_ids, list) and bool(obj.input_ids) and isinstance(obj.input_ids[0], list)
    n = len(obj.input_ids) if batch else 1
    entries = entries if isinstance(entries, list) else [entries]
    if len(entries) != n:
        raise RequestOptionsError(f"spec_capture has {len(entries)} entries for {n} prompts (input_ids): send one "
                                  "per prompt")
    params = obj.sampling_params
    if batch:
        params = [dict(p) for p in params] if isinstance(params, list) else [dict(params or {}) for _ in range(n)]
    else:
        params = [dict(params or {})]
    for sp, entry in zip(params, entries):
        cp = dict(sp.get("custom_params") or {})
        cp[REQUEST_KEY] = {**(cp.get(REQUEST_KEY) or {}), "specforge": check_spec_capture(entry)}
        sp["custom_params"] = cp
    obj.sampling_params = params if batch else params[0]


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which requests a server exports, and whether their answers wait for it.

    sample_rate: the share of requests exported when they do not say (`"export": true` or
    false always wins), chosen from the rid alone, so a replay exports the same requests.
    live: answers never wait for their sample (mode `live`; `held`, the default, answers
    only once the sample is durable). A live server exports prompt and answer (decode rows)
    and never refuses a request it chose itself: one it cannot export is served unexported."""

    sample_rate: float = 1.0
    live: bool = False


def sampled(rid: str, rate: float) -> bool:
    """Deterministic from the rid: the first 8 bytes of its SHA-256 as a fraction of 2^64."""
    if rate >= 1.0:
        return True
    return int.from_bytes(hashlib.sha256(str(rid).encode()).digest()[:8], "big") < rate * 2.0 ** 64


def admit(rids: Sequence[str], sampling_params: List[dict], parallel_sample_num: int,
          has_input_embeds: bool, exported: Container[str], call_id: str,
          skip_prefix: Optional[str] = None, need_loss_mask: bool = False, sink: str = "directory",
          in_flight: Set[str] = frozenset(), policy: Policy = Policy()) -> Admission:
    """Validate one normalised /generate call and tag each exported entry with `call_id`.

    rids: one per entry; sampling_params: one dict per entry (a batch that shared one dict
    lists it once per entry, the same object; an entry whose tags differ from the others'
    gets its own copy in the list); exported: ids already in the manifest; in_flight: ids
    being exported by calls not yet answered.
    An entry is exported when it opts in (`"export": true`), or says nothing and is sampled
    (`policy`), and is not SGLang's own health check (`skip_prefix`), which the schedulers
    skip too. On a server whose sink takes SpecForge's `spec_capture` (specforge), only
    entries that carry one are exported (they say where to); elsewhere such an entry is refused.
    Each error carries its HTTP status.
    """
    options = [parse_request_options(sp.get("custom_params")) for sp in sampling_params]
    if parallel_sample_num > 1:
        # No entry count is checked here: a single prompt with n > 1 has one rid up to SGLang
        # 0.5.17 and n rids from 0.5.18 on (releases.DIFFERENCES), and no entry is exported.
        # SGLang repeats the whole list n times, and sends n + 1 requests under new rids.
        # Refused when asked for: explicitly, or by default on a capture server (held, rate 1).
        every = policy.sample_rate >= 1 and not policy.live
        asked = any(o.export is True or (o.export is None and every) for o in options)
        if asked:
            raise RequestOptionsError(
                f"n={parallel_sample_num} samples one prompt {parallel_sample_num} times and its hidden "
                "states are the same each time: send n=1, or opt out with custom_params "
                f'{{"{REQUEST_KEY}": {{"export": false}}}}')
        for sp, o in zip(sampling_params, options):
            if o.export is None:  # not sampled: say so, or the scheduler would export it
                _tag(sp, export=False)
        return Admission(call_id, [])
    if len(sampling_params) != len(rids):
        raise ValueError(f"{len(rids)} rids but {len(sampling_params)} sampling params")
    keep, unsampled = [], []
    busy = set(in_flight)  # and the rids this call exports: one rid twice in a batch is refused too
    for i, (rid, opts) in enumerate(zip(rids, options)):
        if opts.export is False or (skip_prefix and str(rid).startswith(skip_prefix)):
            continue
        if (opts.specforge is not None) != SINKS[sink].takes_spec_capture:
            if opts.specforge is None:
                continue  # a specforge server exports what SpecForge asks it to
            raise RequestOptionsError(f"request {rid!r} carries spec_capture, but this server hands samples to "
                                      f"'{sink}': start it with --export-sink specforge for SpecForge")
        if opts.export is None and not sampled(rid, policy.sample_rate):
            unsampled.append(i)
            continue
        try:
            _check_entry(rid, opts, has_input_embeds, exported, busy, need_loss_mask, sink)
        except ExportError:
            if opts.export is True or not policy.live:
                raise
            unsampled.append(i)  # live capture chose it; serve it unexported
            continue
        keep.append(i)
        busy.add(rid)
    tags = {i: {"call_id": call_id, **({"decode_rows": True} if policy.live else {})} for i in keep}
    tags.update({i: {"export": False} for i in unsampled})
    shared = collections.Counter(id(sp) for sp in sampling_params)
    for i, t in tags.items():
        if shared[id(sampling_params[i])] > 1:  # a batch's one dict: each tagged entry gets its own
            sampling_params[i] = {**sampling_params[i]}
        _tag(sampling_params[i], **t)
    return Admission(call_id, [rids[i] for i in keep])


def _check_entry(rid: str, opts, has_input_embeds: bool, exported: Container[str], in_flight: Set[str],
                 need_loss_mask: bool, sink: str) -> None:
    if has_input_embeds:
        raise RequestOptionsError("hidden-state export needs text or input_ids, not input_embeds")
    if opts.decode_rows and not SINKS[sink].decode_rows:
        raise RequestOptionsError(f"request {rid!r} asks for decode_rows, which only the directory sink writes "
                                  f"yet; this server hands samples to '{sink}'")
    check_sample_id(rid)
    if need_loss_mask and opts.loss_mask is None:
        raise RequestOptionsError(
            f"request {rid!r} has no loss_mask, and this server keeps final-state rows only at loss "
            "positions (--export-final-rows loss): send custom_params "
            f'{{"{REQUEST_KEY}": {{"loss_mask": [0/1 per prompt token]}}}} (sglang-hs capture does), '
            "or use a server started with --export-final-rows all")
    # In flight first: a writer claims its rid in the index (`exported`) before it has written.
    if rid in in_flight:
        raise SampleInFlightError(f"sample id {rid!r} is being exported by a request in flight; "
                                  "retry after it finishes")
    if rid in exported:
        raise DuplicateSampleError(f"sample id {rid!r} is already exported; send a new rid "
                                   "(exported samples are never overwritten)")


def _tag(sp: dict, **fields) -> None:
    cp = sp.get("custom_params") or {}
    sp["custom_params"] = {**cp, REQUEST_KEY: {**(cp.get(REQUEST_KEY) or {}), **fields}}


async def hold_until_durable(out, adm: Admission, waiter, out_dir: str) -> None:
    """For each finished, exported request in one output of the call (a dict, or a list of
    them for a batch), wait for its outcome and add meta_info["hidden_states_export"]. An
    aborted request has nothing to wait for; a failed sample raises its ExportError.
    held_ms: how long the answer waited here, after SGLang had it, for its sample to be
    durable: the latency export adds to this request."""
    t0 = time.perf_counter()
    for item in out if isinstance(out, list) else [out]:
        mi = item.get("meta_info", {}) if isinstance(item, dict) else {}
        rid, fin = mi.get("id"), mi.get("finish_reason")
        if fin is None or rid not in adm.unclaimed:
            continue
        if isinstance(fin, dict) and fin.get("type") == "abort":
            continue
        outcome = await waiter.wait(rid, adm.call_id)
        adm.unclaimed.discard(rid)
        info = outcome.meta_info(out_dir)
        if info is not None:
            mi["hidden_states_export"] = {**info, "held_ms": round(1000 * (time.perf_counter() - t0), 1)}
            if SINKS[outcome.sink].answer_field == "spec_capture":  # where SpecForge's adapter reads it
                mi["spec_capture"] = outcome.answer

