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
from sglang_hs.overlay.sinks import DirectorySink
from sglang_hs.overlay.writer import SampleWriter

PROMPT = list(range(100, 110))  # 10 tokens, prefilled in chunks of 4
H, AUX = 8, [1]


@pytest.fixture
def ranks(tmp_path):
    msgs = []
    writer = SampleWriter(DirectorySink(str(tmp_path), "dp0", AUX), SlabPool(1 << 22, slab_bytes=1 << 12), msgs.append, threads=1)
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
    forward(w, sw, 4, 4)  # planning goes on (the other ranks do the same) but nothing is copied or kept
    assert w.writer.pool.in_use == 0 and w.stats()["copies"] == 1 and sw.next_pos == 8


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

from sglang_hs.format import Storage, decode_sample, load_sample, read_manifest, validate_export  # noqa: E402

K_AUX = [1, 3]
FINAL_PLANE = 7
DIGITS = H - 2  # base-8 digits of a row's code


def rows_of(batch):
    """A forward's rows, for every extend token back to back: column 0 is 15 (every row's
    largest entry, so even fp8 storage gives back each small integer after rounding), column 1
    the plane (aux k, or FINAL_PLANE), the rest the base-8 digits of request index * 10000 +
    position."""
    codes = torch.tensor([i * 10000 + pos for i, p, e in batch for pos in range(p, p + e)])
    base = torch.zeros(len(codes), H)
    base[:, 0] = 15
    for d in range(DIGITS):
        base[:, 2 + d] = (codes // 8 ** d) % 8
    aux = []
    for k in range(len(K_AUX)):
        a = base.clone()
        a[:, 1] = k
        aux.append(a)
    final = base.clone()
    final[:, 1] = FINAL_PLANE
    return final, aux


def codes_of(rows):
    """(code, plane) of each decoded row [..., H]."""
    r = rows.float().round().long()
    code = sum(r[..., 2 + d] * 8 ** d for d in range(DIGITS))
    return code, r[..., 1]


@settings(max_examples=60, deadline=None)
@given(data=hs.data(), lengths=hs.lists(hs.integers(1, 40), min_size=1, max_size=5),
       slab_rows=hs.integers(1, 16), export_dtype=hs.sampled_from([None, "bf16", "fp8_e4m3"]),
       final_rows=hs.sampled_from(["all", "loss"]))
def test_every_prompt_position_lands_once_and_every_slab_comes_back(data, lengths, slab_rows, export_dtype,
                                                                    final_rows):
    """Random chunk sizes, batches, restarts after retraction (a shorter prefix than held),
    aborts mid-prefill, slab sizes and storages (model dtype, bf16, fp8 with scales; final
    rows everywhere or at loss positions only): each written sample holds positions 0..T-1
    once, in order, from its own request (final rows: exactly those of its loss mask);
    aborted ones are never written; the ranks decide the same prefix caps; every slab returns
    to the pool; the directory validates."""
    import tempfile

    from harness.fixtures import write_test_export_json

    storage = Storage(export_dtype, final_rows)
    with tempfile.TemporaryDirectory() as d:
        write_test_export_json(d, hidden_size=H, aux_layer_ids=K_AUX, num_layers=8, dtype="float32",
                               export_dtype=export_dtype, final_rows=final_rows)
        outcomes = []
        row_bytes = (len(K_AUX) + 1) * H * 4
        writer = SampleWriter(DirectorySink(d, "dp0", K_AUX, storage), SlabPool(1 << 24, slab_bytes=slab_rows * row_bytes),
                              outcomes.append, threads=2)
        ranks = [ExportRuntime(K_AUX, writer, "tp0"), ExportRuntime(K_AUX, None, "tp1")]
        aborted = [False] * len(lengths)
        prompts = [list(range(1000 * i, 1000 * i + n)) for i, n in enumerate(lengths)]
        masks = [data.draw(hs.lists(hs.integers(0, 1), min_size=n, max_size=n)) for n in lengths]
        sts = [[rt.new_state(f"r{i}", p, {"sglang_hs": {"loss_mask": masks[i]}}, lambda i=i: aborted[i])
                for i, p in enumerate(prompts)] for rt in ranks]
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
        extra = [rt.new_state("sweep", [1], {"sglang_hs": {"loss_mask": [1]}}, lambda: False) for rt in ranks]
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
            raw = load_sample(os.path.join(d, listed[rid]["path"]))
            assert raw["aux_hidden_states"].dtype == storage.row_dtype(torch.float32)
            t = decode_sample(raw, torch.float32)
            want = torch.arange(lengths[i]) + i * 10000
            code, plane = codes_of(t["aux_hidden_states"])
            assert torch.equal(code, want[:, None].repeat(1, len(K_AUX)))
            assert plane.tolist() == [list(range(len(K_AUX)))] * lengths[i]
            code, plane = codes_of(t["final_hidden_states"])
            if final_rows == "loss":
                at = torch.nonzero(torch.tensor(masks[i])).flatten()
                assert torch.equal(t["final_positions"], at)
                want = want[at]
            assert torch.equal(code, want) and bool((plane == FINAL_PLANE).all())
        rep = validate_export(d)
        assert rep.ok, rep.errors


DECODE = {"sglang_hs": {"decode_rows": True}}


def decode(rt, st, seq_len, graph=False):
    """One decode forward of this request alone: eagerly the hook sees the rows; after a
    graph replay only the graph's static rows hold them."""
    rows = torch.randn(1, H)
    if graph:
        rt.capture_decode_graph(rows, [rows])  # what the replay left in the static buffers
    if rt.begin_decode([st], [seq_len]):
        if not graph:
            rt.stage(rows, [rows])
        rt.end_forward(graph_ran=graph)
    return rows


@pytest.mark.parametrize("graph", [False, True])
def test_decode_rows_are_written_when_the_request_finishes(ranks, graph):
    from sglang_hs.format import load_sample, read_manifest

    w, n, msgs = ranks
    sw, sn = w.new_state("d", PROMPT, DECODE, lambda: False), n.new_state("d", PROMPT, DECODE, lambda: False)
    for rt, st in ((w, sw), (n, sn)):
        forward(rt, st, 0, 10)
    got = [decode(w, sw, 11 + i, graph) for i in range(3)]
    for i in range(3):
        decode(n, sn, 11 + i)
    w.writer.flush()
    assert not msgs  # still generating: nothing written
    for rt, st in ((w, sw), (n, sn)):
        rt.finish(st, [7, 8, 9, 10], aborted=False)
    w.writer.flush()
    assert [(m.rid, m.ok, m.num_tokens) for m in msgs] == [("d", True, 14)]
    entry, = read_manifest(w.writer.sink.out_dir)
    t = load_sample(os.path.join(w.writer.sink.out_dir, entry["path"]))
    assert t["token_ids"].tolist() == PROMPT + [7, 8, 9, 10] and t["aux_hidden_states"].shape == (13, 1, H)
    assert torch.equal(t["final_hidden_states"][10:], torch.cat(got))
    caps_agree(ranks, sw, sn, 12)


def test_a_request_aborted_while_decoding_writes_nothing(ranks):
    w, n, msgs = ranks
    sw = w.new_state("d", PROMPT, DECODE, lambda: False)
    forward(w, sw, 0, 10)
    decode(w, sw, 11)
    w.finish(sw, [7, 8], aborted=True)
    w.writer.flush()
    assert [(m.rid, m.aborted) for m in msgs] == [("d", True)]
    assert w.writer.pool.in_use == 0


def test_live_capture_drops_what_the_full_host_buffer_cannot_hold_and_goes_on(tmp_path):
    """A live pool never waits: a forward whose rows find no free slab drops its samples
    (counted, reported 503), the ranks still plan alike, and once the writer frees the slab
    the next sample is exported."""
    msgs = []
    # one slab of 16 rows (H=8, one aux plane, float32: 64 bytes a row)
    pool = SlabPool(1 << 10, slab_bytes=1 << 10, drop_when_full=True)
    writer = SampleWriter(DirectorySink(str(tmp_path), "dp0", AUX), pool, msgs.append, threads=1)
    w, n = ExportRuntime(AUX, writer, "dp0-tp0"), ExportRuntime(AUX, None, "dp0-tp1")
    a = [rt.new_state("a", PROMPT, DECODE, lambda: False) for rt in (w, n)]
    b = [rt.new_state("b", PROMPT, DECODE, lambda: False) for rt in (w, n)]
    for rt, sa, sb in zip((w, n), a, b):
        forward(rt, sa, 0, 10)  # a's prompt rows hold 10 of the slab's 16 rows while it decodes
        forward(rt, sb, 0, 10)  # b's find no room: dropped on the writer
    for i in range(3):  # a decodes on: 3 more rows fit
        for rt, sa, sb in zip((w, n), a, b):
            assert rt.begin_decode([sa, sb], [11 + i, 11 + i]) == (rt is w)
            if rt is w:
                rows = torch.randn(2, H)
                rt.stage(rows, [rows])
            rt.end_forward()
    for rt, sa, sb in zip((w, n), a, b):
        rt.finish(sa, [7, 8, 9, 10], aborted=False)
        rt.finish(sb, [7, 8, 9, 10], aborted=False)
        assert rt.prefix_cap(sb, 12) == 12  # planning of the dropped sample went on alike
    writer.flush()
    assert sorted((m.rid, m.ok) for m in msgs) == [("a", True), ("b", False)] and msgs[0].status == 503
    assert writer.stats["dropped"] == 1 and writer.stats["failed"] == 0 and pool.full >= 1 and pool.overflow == 0
    c = w.new_state("c", PROMPT, None, lambda: False)  # the slab is free again
    forward(w, c, 0, 10)
    writer.flush()
    assert [m.rid for m in msgs if m.ok] == ["a", "c"] and pool.in_use == 0
    writer.close()


def test_a_full_live_buffer_keeps_the_samples_with_the_most_rows_and_drops_the_rest(tmp_path):
    msgs = []
    pool = SlabPool(1 << 10, slab_bytes=1 << 10, drop_when_full=True)  # 16 rows of 64 bytes
    writer = SampleWriter(DirectorySink(str(tmp_path), "dp0", AUX), pool, msgs.append, threads=1)
    w = ExportRuntime(AUX, writer, "dp0-tp0")
    sts = {rid: w.new_state(rid, PROMPT[:n], DECODE, lambda: False) for rid, n in (("a", 6), ("b", 4), ("c", 2))}
    for st in sts.values():
        forward(w, st, 0, st.prompt_len)  # 12 rows held
    for step in range(2):  # 3 rows fit; then room for 1: a, holding the most, keeps it
        seq = [st.prompt_len + 1 + step for st in sts.values()]
        assert w.begin_decode(list(sts.values()), seq)
        rows = torch.randn(3, H)
        w.stage(rows, [rows])
        w.end_forward()
    assert [rid for rid, st in sts.items() if st.dropped] == ["b", "c"]
    for st in sts.values():
        w.finish(st, [7, 8, 9], aborted=False)
    writer.flush()
    assert sorted((m.rid, m.ok, m.ok or m.status) for m in msgs) == [("a", True, True), ("b", False, 503), ("c", False, 503)]
    assert writer.stats["dropped"] == 2 and pool.in_use == 0
    writer.close()


def test_a_live_buffer_with_no_room_left_drops_one_sample_to_keep_the_other(tmp_path):
    """Both slabs full, each with one sample's rows, and a decode step of both: dropping one
    gives its slab back at once, so the other goes on (dropping every sample of the step, as
    keeping only what already fit did, lost both)."""
    msgs = []
    pool = SlabPool(2 << 10, slab_bytes=1 << 10, drop_when_full=True)  # 2 slabs of 16 rows of 64 bytes
    writer = SampleWriter(DirectorySink(str(tmp_path), "dp0", AUX), pool, msgs.append, threads=1)
    w = ExportRuntime(AUX, writer, "dp0-tp0")
    prompt = list(range(100, 116))
    sts = {rid: w.new_state(rid, prompt, DECODE, lambda: False) for rid in ("a", "b")}
    for st in sts.values():
        forward(w, st, 0, 16)  # a slab each, full
    assert pool.room(64) == 0
    for step in range(2):
        states = [st for st in sts.values() if not st.dropped]
        assert w.begin_decode(states, [17 + step] * len(states))
        rows = torch.randn(len(states), H)
        w.stage(rows, [rows])
        w.end_forward()
    kept = [rid for rid, st in sts.items() if not st.dropped]
    assert len(kept) == 1 and sts[kept[0]].rows_held == 18
    for st in sts.values():
        w.finish(st, [7, 8, 9], aborted=False)
    writer.flush()
    assert sorted((m.rid, m.ok) for m in msgs) == sorted((rid, rid in kept) for rid in sts)
    assert writer.stats["dropped"] == 1 and pool.in_use == 0
    writer.close()
