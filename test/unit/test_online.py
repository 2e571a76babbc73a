"""What the trainers read besides the states: the manifest tail that `convert --follow`
reads, the record key that names a row, SpecForge's vocabulary mapping. The server side of
`--follow` (a real capture, speculators' reader on the growing index) is in
test/server/test_online_cpu.py."""

import json

import torch
from hypothesis import given, settings, strategies as st

from sglang_hs.format import MANIFEST
from sglang_hs.tools.online import ManifestTail, record_key, specforge_vocab_mapping
from sglang_hs.tools.records import sample_id


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12), cuts=st.lists(st.integers(0, 2000), max_size=8), data=st.data())
def test_a_manifest_read_while_it_is_appended_yields_each_entry_once_in_order(tmp_path_factory, n, cuts, data):
    """Appends land in arbitrary pieces (a line can be half there when the tail reads): every
    complete entry comes out exactly once, in order, and a torn line is skipped."""
    d = tmp_path_factory.mktemp("tail")
    lines = [json.dumps({"id": f"s{i}", "path": f"dp0-00000/s{i}.safetensors", "num_tokens": i}) + "\n"
             for i in range(n)]
    torn = data.draw(st.integers(-1, n - 1))
    if torn >= 0:  # a crash mid-line: the rest of that line never comes, the next one does
        lines[torn] = lines[torn][: len(lines[torn]) // 2] + "\n"
    blob = "".join(lines).encode()
    points = sorted({c % (len(blob) + 1) for c in cuts} | {len(blob)})
    tail, got, start = ManifestTail(str(d)), [], 0
    assert tail.read() == []  # no manifest yet
    for p in points:
        with open(d / MANIFEST, "ab") as f:
            f.write(blob[start:p])
        start = p
        got += tail.read()
    assert [e["id"] for e in got] == [f"s{i}" for i in range(n) if i != torn]
    assert tail.read() == []


def test_the_record_key_is_the_same_whatever_the_id_prefix():
    rec = {"id": "conv/7", "messages": [{"role": "user", "content": "hi"}]}
    keys = {record_key(sample_id(p, 41, rec)) for p in ("", "run2-", "a.b_c-")}
    assert len(keys) == 1 and next(iter(keys)).startswith("00000041-")
    assert record_key(sample_id("", 42, rec)) not in keys
    assert record_key("row-3") is None  # a client's own rid names no record


@settings(max_examples=40, deadline=None)
@given(data=st.data(), draft=st.integers(1, 40))
def test_the_vocab_mapping_is_specforges_own_for_the_same_counts(trainers, data, draft):
    """`specforge_vocab_mapping` against SpecForge 0.2.0's `process_token_dict_to_mappings`
    (distinct counts: it breaks ties by insertion order, which a file of rows does not fix)."""
    import collections

    from specforge.data.preprocessing import process_token_dict_to_mappings

    target = 64
    tokens = data.draw(st.lists(st.integers(0, target - 1), unique=True, max_size=50))
    counts = data.draw(st.lists(st.integers(1, 10_000), unique=True, min_size=len(tokens), max_size=len(tokens)))
    rows = [([t] * c, [1] * c) for t, c in zip(tokens, counts)] + [([5, 6, 7], [0, 0, 0])]  # unmasked: not counted
    got = specforge_vocab_mapping(rows, draft, target)
    d2t, t2d = process_token_dict_to_mappings(collections.Counter(dict(zip(tokens, counts))), draft, target)
    assert torch.equal(got["d2t"], d2t) and torch.equal(got["t2d"], t2d)
