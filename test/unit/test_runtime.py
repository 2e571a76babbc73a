"""ExportRuntime on two ranks: a writer (tp0, a real SampleWriter) and a rank that does not
write (tp1), fed the same forwards the way SGLang's tensor-parallel schedulers are. Whatever
only the writer sees (a forward that yields no rows, an abort swept after a chunk) must not
make the ranks cap a request's prefix differently: on GPUs the ranks would then run forwards
of different shapes and hang in their collectives."""

import os

import pytest
import torch

from sglang_hs.overlay.runtime import ExportRuntime
from sglang_hs.overlay.staging import SlabPool
from sglang_hs.overlay.writer import SampleWriter

PROMPT = list(range(100, 110))  # 10 tokens, prefilled in chunks of 4
H, AUX = 8, [1]


@pytest.fixture
def ranks(tmp_path):
    msgs = []
    writer = SampleWriter(str(tmp_path), "dp0", AUX, SlabPool(1 << 22, slab_bytes=1 << 12), msgs.append, threads=1)
    yield ExportRuntime(AUX, writer, "dp0-tp0"), ExportRuntime(AUX, None, "dp0-tp1"), msgs
    writer.close()


def states(ranks, aborted=lambda: False):
    w, n, _ = ranks
    return w.new_state("r", PROMPT, None, aborted), n.new_state("r", PROMPT, None, aborted)


def forward(rt, st, prefix, extend, stage=True):
    """One extend forward of this request alone on rank `rt`."""
    if rt.begin_forward([st], [prefix], [extend]):
        if stage:
            rows = torch.randn(extend, H)
            rt.stage(rows, [rows])
        rt.end_forward()


def caps_agree(ranks, sw, sn, upstream):
    w, n, _ = ranks
    assert w.prefix_cap(sw, upstream) == n.prefix_cap(sn, upstream)
    assert w.stats()["prefix_caps_digest"] == n.stats()["prefix_caps_digest"]


def test_a_forward_without_rows_on_the_writer_leaves_the_ranks_agreeing(ranks):
    w, n, msgs = ranks
    sw, sn = states(ranks)
    forward(w, sw, 0, 4, stage=False)  # the model bypassed its LogitsProcessor on the writer
    forward(n, sn, 0, 4)
    caps_agree(ranks, sw, sn, 8)
    forward(w, sw, 4, 4)
    forward(n, sn, 4, 4)
    caps_agree(ranks, sw, sn, 8)
    w.writer.flush()
    assert [m.rid for m in msgs if not m.ok] == ["r"]  # reported once, as failed
    assert not [m for m in msgs if m.ok]


def test_an_abort_swept_on_the_writer_leaves_the_ranks_agreeing(ranks):
    w, n, msgs = ranks
    flag = {"aborted": False}
    sw, sn = states(ranks, aborted=lambda: flag["aborted"])
    forward(w, sw, 0, 4)
    forward(n, sn, 0, 4)
    flag["aborted"] = True  # the client went away between two chunks
    forward(w, sw, 4, 4)
    forward(n, sn, 4, 4)
    caps_agree(ranks, sw, sn, 10)
    w.writer.flush()
    assert not [m for m in msgs if m.ok]


def test_a_complete_prompt_reuses_its_whole_prefix_on_every_rank(ranks):
    w, n, msgs = ranks
    sw, sn = states(ranks)
    for start in (0, 4, 8):
        extend = min(4, len(PROMPT) - start)
        forward(w, sw, start, extend)
        forward(n, sn, start, extend)
    caps_agree(ranks, sw, sn, 9)  # a retracted, complete request is never recomputed
    assert w.prefix_cap(sw, 9) == 9
    w.writer.flush()
    assert [m.rid for m in msgs if m.ok] == ["r"]


def test_a_failed_forward_fails_its_requests_and_frees_their_rows(ranks):
    w, n, msgs = ranks
    sw, _ = states(ranks)
    assert w.begin_forward([sw], [0], [4])
    w.stage(torch.randn(4, H), [torch.randn(4, H)])
    w.abort_forward()  # the model raised after the rows were staged
    w.writer.flush()
    assert [(m.rid, m.ok, m.status) for m in msgs] == [("r", False, 500)] and "forward pass failed" in msgs[0].error
    assert w.writer.pool.in_use == 0 and sw.dropped and not sw.pieces
    forward(w, sw, 4, 4)  # planning goes on (the other ranks do the same) but nothing is kept
    assert w.writer.pool.in_use == 0 and w.stats()["copies"] == 2


def test_only_the_writer_copies_rows():
    rt = ExportRuntime(AUX, None, "dp0-tp1")
    st = rt.new_state("r", PROMPT, None, lambda: False)
    assert not rt.begin_forward([st], [0], [10])  # nothing to stage on a rank that does not write
    assert st.planned and rt.stats()["copies"] == 0 and "writer" not in rt.stats()


def test_an_opted_out_request_has_no_state():
    rt = ExportRuntime(AUX, None)
    assert rt.new_state("r", PROMPT, {"sglang_hs": {"export": False}}, lambda: False) is None


# ---- property: a scheduler's worth of forwards on a writer and a non-writer rank ----------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as hs  # noqa: E402

from sglang_hs.format import load_sample, read_manifest  # noqa: E402

K_AUX = [1, 3]


def rows_of(batch):
    """A forward's rows: aux[k][:, 0] and final[:, 0] hold (request index * 10000 + position),
    column 1 holds the plane, for every extend token back to back."""
    codes = [i * 10000 + pos for i, p, e in batch for pos in range(p, p + e)]
    base = torch.tensor(codes, dtype=torch.float32)[:, None].repeat(1, H)
    aux = []
    for k in range(len(K_AUX)):
        a = base.clone()
        a[:, 1] = k
        aux.append(a)
    final = base.clone()
    final[:, 1] = -1
    return final, aux


@settings(max_examples=40, deadline=None)
@given(data=hs.data(), lengths=hs.lists(hs.integers(1, 40), min_size=1, max_size=5),
       slab_rows=hs.integers(1, 16))
def test_every_prompt_position_lands_once_and_every_slab_comes_back(data, lengths, slab_rows):
    """Random chunk sizes, batches, restarts after retraction (a shorter prefix than held),
    aborts mid-prefill and slab sizes: each written sample holds positions 0..T-1 once, in
    order, from its own request; aborted ones are never written; the ranks decide the same
    prefix caps; every slab returns to the pool."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        outcomes = []
        row_bytes = (len(K_AUX) + 1) * H * 4
        writer = SampleWriter(d, "dp0", K_AUX, SlabPool(1 << 24, slab_bytes=slab_rows * row_bytes), outcomes.append,
                              threads=2)
        ranks = [ExportRuntime(K_AUX, writer, "tp0"), ExportRuntime(K_AUX, None, "tp1")]
        aborted = [False] * len(lengths)
        prompts = [list(range(1000 * i, 1000 * i + n)) for i, n in enumerate(lengths)]
        sts = [[rt.new_state(f"r{i}", p, None, lambda i=i: aborted[i]) for i, p in enumerate(prompts)]
               for rt in ranks]
        for _ in range(40):
            live = [i for i, st in enumerate(sts[0]) if not st.planned and not aborted[i]]
            if not live:
                break
            batch = []
            for i in data.draw(hs.lists(hs.sampled_from(live), min_size=1, max_size=len(live), unique=True)):
                upstream = data.draw(hs.integers(0, lengths[i]))  # what the prefix cache could give
                cap = [rt.prefix_cap(s[i], upstream) for rt, s in zip(ranks, sts)]
                assert cap[0] == cap[1]
                p = data.draw(hs.integers(0, cap[0]))  # below the cap: a restart after retraction
                batch.append((i, p, data.draw(hs.integers(1, lengths[i] + 3 - p))))  # may run into output tokens
            if data.draw(hs.booleans()) and data.draw(hs.booleans()):
                aborted[data.draw(hs.sampled_from(live))] = True
            final, aux = rows_of(batch)
            for rt, s in zip(ranks, sts):
                if rt.begin_forward([s[i] for i, _, _ in batch], [p for _, p, _ in batch], [e for _, _, e in batch]):
                    rt.stage(final, aux)
                    rt.end_forward()
        # The requests still mid-prefill go away too; one more forward lets the writer sweep
        # every request aborted since its last chunk.
        for i, st in enumerate(sts[0]):
            aborted[i] = aborted[i] or not st.planned
        extra = [rt.new_state("sweep", [1], None, lambda: False) for rt in ranks]
        for rt, st in zip(ranks, extra):
            if rt.begin_forward([st], [0], [1]):
                rt.stage(*rows_of([(99, 0, 1)]))
                rt.end_forward()
        writer.close()
        assert ranks[0].stats()["prefix_caps_digest"] == ranks[1].stats()["prefix_caps_digest"]
        assert writer.pool.in_use == 0, "a slab was never given back"
        by_rid = {}
        for o in outcomes:
            assert o.rid not in by_rid, f"two outcomes for {o.rid}"
            by_rid[o.rid] = o
        listed = {e["id"]: e for e in read_manifest(d)}
        for i, st in enumerate(sts[0]):
            rid = f"r{i}"
            if aborted[i]:  # an abort before the commit is honoured: nothing written
                assert rid not in listed and (rid not in by_rid or by_rid[rid].aborted)
                continue
            assert by_rid[rid].ok and rid in listed
            t = load_sample(os.path.join(d, listed[rid]["path"]))
            want = torch.arange(lengths[i], dtype=torch.float32) + i * 10000
            assert torch.equal(t["final_hidden_states"][:, 0], want)
            assert torch.equal(t["aux_hidden_states"][:, :, 0], want[:, None].repeat(1, len(K_AUX)))
            assert t["aux_hidden_states"][:, :, 1].tolist() == [list(range(len(K_AUX)))] * lengths[i]
