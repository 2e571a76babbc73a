"""What differs between the SGLang releases sglang-hs supports, in one place.

The window is SGLANG_WINDOW (pyproject.toml's `sglang>=0.5.17,<0.5.24` says the same). Every
difference a hook depends on is one `Difference` below, named by the release that introduced
it, saying what the adapter does before and from that release. The hooks in seams.py call the
adapters here and never test a version themselves; FORK_NOTES.md's release table lists the
same entries (test_seams.py checks it), and test/unit/test_releases.py checks each adapter
against the installed release.

This is the second (and last) module that reads SGLang internals, beside seams.py.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, List, Optional, Tuple

SGLANG_WINDOW = ("0.5.17", "0.5.23")


def version_tuple(v: str) -> Tuple[int, ...]:
    """"0.5.23" -> (0, 5, 23); a local or pre-release suffix ("0.5.23.post1", "0.5.24rc1")
    counts as its release."""
    nums = re.match(r"\d+(?:\.\d+)*", v)
    if not nums:
        raise ValueError(f"not a release number: {v!r}")
    return tuple(int(x) for x in nums.group(0).split("."))


def installed() -> str:
    import sglang

    return sglang.__version__


def in_window(v: str) -> bool:
    lo, hi = SGLANG_WINDOW
    return version_tuple(lo) <= version_tuple(v)[:3] <= version_tuple(hi)


@dataclasses.dataclass(frozen=True)
class Difference:
    name: str
    since: str  # the first release with the new behaviour
    change: str  # what upstream changed
    before: str  # what the adapter does on older releases
    after: str  # what it does from `since` on

    def applies(self, version: Optional[str] = None) -> bool:
        return version_tuple(version or installed()) >= version_tuple(self.since)


DIFFERENCES: List[Difference] = [
    Difference(
        "single_prompt_n_rids", "0.5.18",
        "a single prompt with n > 1 is normalised to n rids (rid_0, rid_1, ...) instead of one",
        "one rid, n sampling params", "n rids; admission counts entries only when n == 1 (n > 1 is never "
        "exported: refused, or opted out)"),
    Difference(
        "resolved_server_args", "0.5.19",
        "ServerArgs no longer resolves its fields at construction: records keep what the operator typed "
        "(tokenizer path, attention backend, device may be None) and resolution lives in declarations.",
        "fields hold resolved values; resolved_view() returns the same",
        "export.json provenance reads resolved_view(server_args) (sglang.srt.arg_groups.overrides), "
        "one code path in every release"),
    Difference(
        "layernorm_sp", "0.5.19",
        "--enable-layernorm-sp: LogitsProcessor receives sequence-sharded rows",
        "flag absent", "refused with export at start-up (rows would not be the request's positions)"),
    Difference(
        "parallel_ranks", "0.5.21",
        "ModelRunner.ps and distributed/parallel_state_wrapper.py removed",
        "ranks from ModelRunner.ps", "ranks from sglang.srt.runtime_context.get_parallel()"),
    Difference(
        "input_ids_vocab_check", "0.5.21",
        "TokenizerManager no longer checks input_ids against the vocabulary; an out-of-range id kills "
        "the scheduler in the embedding lookup",
        "SGLang answers 400", "sglang-hs answers 400 itself (admission.check_input_ids), in every release"),
    Difference(
        "encoder_swa_bounded_replay", "0.5.21",
        "--enable-encoder-swa-bounded-replay: replayed rows are folded into the forward (0.5.23)",
        "flag absent", "refused with export at start-up (forward rows != prefix/extend lengths)"),
    Difference(
        "layer_boundary_capture", "0.5.21",
        "decoder layers capture through layers/layer_boundary/ (flag families 0.5.21, list families "
        "0.5.22) instead of LayerCommunicator and the loop",
        "same index (residual entering layer i)",
        "same index per upstream's comments; proven per release by the HF comparison tests, no adapter"),
    Difference(
        "attn_dp_size", "0.5.22",
        "attention DP spelled --attn-dp-size; the raw enable_dp_attention stays False",
        "writer shard per attention-DP group when attn_dp_size > 1",
        "the same test (attn_dp_size > 1), which reads right in every release"),
    Difference(
        "minimax_m3_end_layer_read", "0.5.23",
        "MiniMaxM3Model's loop also reads `self.end_layer in self.layers_to_capture` (last layer only)",
        "loop reads flags", "that read is not counted as reading the list (aux_layers.loop_reads)"),
    Difference(
        "cpu_shim_draft_cache_locs", "0.5.23",
        "CPU mode imports sgl_kernel.assign_draft_cache_locs_contiguous_cpu at import time",
        "name unused", "the CPU shim provides it (raises if called)"),
    Difference(
        "upstream_aux_capture", "0.5.23",
        "capture-only mode --enable-return-aux-hidden-states (needs --speculative-algorithm EAGLE3)",
        "flag absent", "refused with export at start-up: both would set the aux layers"),
]
BY_NAME = {d.name: d for d in DIFFERENCES}


# Opt-in upstream flags whose rows cannot be planned per request, refused with export on:
# ServerArgs field -> (difference, why). An absent field (an older release) reads False.
ROW_BREAKING_FLAGS = {
    "enable_layernorm_sp": ("layernorm_sp", "--enable-layernorm-sp shards the final rows by sequence"),
    "enable_encoder_swa_bounded_replay": (
        "encoder_swa_bounded_replay",
        "--enable-encoder-swa-bounded-replay folds replayed rows into the forward"),
    "enable_return_aux_hidden_states": (
        "upstream_aux_capture",
        "--enable-return-aux-hidden-states is SGLang's own aux capture; sglang-hs sets the aux layers itself"),
}


def row_breaking_flags(server_args: Any) -> List[str]:
    """Why each row-breaking flag that is on is refused ([] when none is)."""
    return [why for field, (_, why) in ROW_BREAKING_FLAGS.items() if getattr(server_args, field, False)]


def resolved(server_args: Any) -> Any:
    """The server args with resolution applied, read-only (resolved_server_args): what the
    server really runs with, whatever the operator left unset."""
    from sglang.srt.arg_groups.overrides import resolved_view

    return resolved_view(server_args)


@dataclasses.dataclass(frozen=True)
class Ranks:
    attn_tp_rank: int
    attn_cp_rank: int
    attn_dp_rank: int
    attn_dp_size: int
    dp_rank: Optional[int]  # the replica under --dp-size without attention DP; None without a controller
    pp_rank: int
    pp_size: int

    @property
    def writer_shard(self) -> str:
        """One writer per data-parallel group: per attention-DP group when attention DP is on
        (whatever its spelling), else per replica."""
        return f"dp{self.attn_dp_rank if self.attn_dp_size > 1 else (self.dp_rank or 0)}"


def parallel_ranks(runner: Any) -> Ranks:
    """This scheduler's ranks (parallel_ranks)."""
    names = [f.name for f in dataclasses.fields(Ranks)]
    if not BY_NAME["parallel_ranks"].applies():
        ps = runner.ps
        return Ranks(**{n: getattr(ps, n) for n in names})
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    values = {n: getattr(p, n) for n in names if n != "dp_rank"}
    try:
        values["dp_rank"] = p.dp_rank
    except RuntimeError:  # written only by a data-parallel controller
        values["dp_rank"] = None
    return Ranks(**values)
