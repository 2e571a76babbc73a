import os

import pytest

from sglang_hs.overlay.config import (
    ExportConfigError,
    check_aux_layer_ids,
    check_out_dir,
    is_writer_rank,
)


def test_layer_ids_in_hf_convention():
    assert check_aux_layer_ids([2, 15, 27], 30) == (2, 15, 27)
    assert check_aux_layer_ids([1, 29], 30) == (1, 29)


@pytest.mark.parametrize("ids,what", [
    ([0, 5], "out of range"),      # embeddings: upstream crashes at warm-up
    ([2, 30], "out of range"),     # after the last layer: upstream never captures it
    ([5, 5], "strictly increasing"),
    ([9, 3], "strictly increasing"),
    ([], "at least one"),
])
def test_bad_layer_ids_say_what_to_do(ids, what):
    with pytest.raises(ExportConfigError, match=what):
        check_aux_layer_ids(ids, 30)


def test_out_dir_created_and_probed(tmp_path):
    d = check_out_dir(str(tmp_path / "a" / "b"))
    assert os.path.isdir(d) and os.listdir(d) == []


def test_out_dir_not_creatable(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ExportConfigError, match="cannot create or write"):
        check_out_dir(str(f / "sub"))


@pytest.mark.parametrize("tp,dp,dp_attention,writers", [
    (1, 1, False, [0]),
    (2, 1, False, [0]),           # plain TP: one writer for the group
    (8, 1, False, [0]),
    (4, 2, True, [0, 2]),         # DP attention: attn_tp_size 2, one writer per DP group
    (8, 8, True, list(range(8))),
])
def test_one_writer_rank_per_data_parallel_group(tp, dp, dp_attention, writers):
    attn_tp = tp // dp if dp_attention else tp
    got = [r for r in range(tp) if is_writer_rank(r % attn_tp, 0, True)]
    assert got == writers
    assert not is_writer_rank(0, 0, False)  # not the last pipeline stage
    assert not is_writer_rank(0, 1, True)   # context-parallel peers hold the same rows


def test_live_capture_and_the_sample_rate_are_checked_at_start_up():
    from sglang_hs.overlay.config import check_policy

    check_policy("live", 0.1, "directory", "all")
    check_policy("held", 0.0, "specforge", "all")
    for mode, rate, sink, final_rows, what in (("held", 1.5, "directory", "all", r"\[0, 1\]"),
                                               ("live", 0.1, "specforge", "all", "--export-sink directory"),
                                               ("live", 1.0, "directory", "loss", "--export-final-rows all")):
        with pytest.raises(ExportConfigError, match=what):
            check_policy(mode, rate, sink, final_rows)
