"""The release table (sglang_hs.overlay.releases): its adapters on plain objects, and the
ledger in FORK_NOTES.md listing every difference it holds."""

import os
import re
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_hs.overlay import releases
from sglang_hs.overlay.releases import DIFFERENCES, ROW_BREAKING_FLAGS, SGLANG_WINDOW, Difference, Ranks

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.join(HERE, "..", "..")

release = st.tuples(st.integers(0, 3), st.integers(0, 9), st.integers(0, 40))


@given(release, release, st.sampled_from(["", ".post1", "rc1", "+local"]))
def test_a_difference_applies_from_its_release_on_whatever_the_suffix(since, v, suffix):
    d = Difference("x", ".".join(map(str, since)), "", "", "")
    assert d.applies(".".join(map(str, v)) + suffix) == (v >= since)


def test_version_tuple_refuses_what_is_not_a_release():
    with pytest.raises(ValueError):
        releases.version_tuple("main")


def test_the_window_matches_pyproject():
    lo, hi = SGLANG_WINDOW
    pyproject = open(os.path.join(REPO, "pyproject.toml")).read()
    upper = hi.rsplit(".", 1)[0] + "." + str(int(hi.rsplit(".", 1)[1]) + 1)
    assert f'"sglang>={lo},<{upper}"' in pyproject
    assert releases.in_window(lo) and releases.in_window(hi) and releases.in_window(hi + ".post1")
    assert not releases.in_window(upper) and not releases.in_window("0.5.16")


def test_every_difference_is_inside_the_window_and_named_once():
    names = [d.name for d in DIFFERENCES]
    assert len(names) == len(set(names))
    for d in DIFFERENCES:
        assert releases.in_window(d.since) and d.since != SGLANG_WINDOW[0], d.name
    assert [releases.version_tuple(d.since) for d in DIFFERENCES] == sorted(
        releases.version_tuple(d.since) for d in DIFFERENCES), "listed in release order"
    assert all(diff in releases.BY_NAME for diff, _ in ROW_BREAKING_FLAGS.values())


def test_fork_notes_release_table_lists_every_difference():
    notes = open(os.path.join(REPO, "FORK_NOTES.md")).read()
    rows = re.findall(r"^\| `(\w+)` \| (0\.5\.\d+) \|", notes, re.M)
    assert rows == [(d.name, d.since) for d in DIFFERENCES]


def test_row_breaking_flags_are_refused_only_when_on():
    on = types.SimpleNamespace(enable_layernorm_sp=True, enable_encoder_swa_bounded_replay=False)
    assert releases.row_breaking_flags(on) == [ROW_BREAKING_FLAGS["enable_layernorm_sp"][1]]
    # an older release has no such field at all: nothing to refuse
    assert releases.row_breaking_flags(types.SimpleNamespace()) == []


@pytest.mark.parametrize("attn_dp_size,attn_dp_rank,dp_rank,shard", [
    (1, 0, None, "dp0"),  # one server
    (1, 0, 3, "dp3"),  # replica 3 of --dp-size
    (4, 2, 0, "dp2"),  # attention DP (--enable-dp-attention, or --attn-dp-size from 0.5.22)
])
def test_one_writer_shard_per_data_parallel_group(attn_dp_size, attn_dp_rank, dp_rank, shard):
    r = Ranks(attn_tp_rank=0, attn_cp_rank=0, attn_dp_rank=attn_dp_rank, attn_dp_size=attn_dp_size,
              dp_rank=dp_rank, pp_rank=0, pp_size=1)
    assert r.writer_shard == shard


def test_installing_sglang_hs_keeps_the_sglang_and_torch_already_installed():
    """`pip install -e .` next to any release of the window finds every dependency already
    satisfied, so it changes nothing: no SGLang or torch downgrade."""
    import tomllib
    from importlib.metadata import version

    from packaging.requirements import Requirement

    deps = tomllib.load(open(os.path.join(REPO, "pyproject.toml"), "rb"))["project"]["dependencies"]
    reqs = [Requirement(d) for d in deps]
    assert "torch" not in {r.name for r in reqs}, "each SGLang pins its own torch"
    for r in reqs:
        assert r.specifier.contains(version(r.name), prereleases=True), (str(r), version(r.name))
