import os
import time

import torch

from harness.fixtures import write_test_export_json
from sglang_hs.format import read_manifest, validate_export
from sglang_hs.overlay.rows import RequestState, plan_forward, split_rows
from sglang_hs.overlay.staging import Piece, SlabPool
from sglang_hs.overlay.sinks import DirectorySink
from sglang_hs.overlay.writer import SampleWriter
from sglang_hs.protocol import Outcome, RequestOptions

H, K = 8, 3


def complete_state(rid, n, loss_mask=None, pool=None):
    """A request whose n prompt rows arrived in two chunks, staged in slabs of `pool`."""
    st = RequestState(rid=rid, prompt_ids=list(range(n)), options=RequestOptions(loss_mask=loss_mask, call_id=f"c-{rid}"))
    for start, end in ((0, n // 2), (n // 2, n)):
        segs, _ = plan_forward([st], [start], [end - start])
        if not segs:
            continue
        r = end - start
        slab = pool.take() if pool else None
        piece = Piece(torch.randn(r, K, H).bfloat16(), torch.randn(r, H).bfloat16(), slab)
        split_rows([piece], segs)
        piece.release()  # the forward's own hold
    assert st.planned
    return st


def submit(w, st, aborted=lambda: False):
    w.submit(st, aborted)


def make_writer(d, budget=None):
    msgs = []
    write_test_export_json(d, H)
    w = SampleWriter(DirectorySink(d, "dp0", [2, 5, 7]), budget or SlabPool(1 << 30, slab_bytes=1 << 16), msgs.append, threads=2)
    return w, msgs


def test_writes_files_manifest_and_reports(tmp_path):
    d = str(tmp_path)
    w, msgs = make_writer(d)
    for i in range(20):
        submit(w, complete_state(f"r{i}", 3 + i, loss_mask=[1] * (3 + i), pool=w.pool))
    w.close()
    assert sorted(m.rid for m in msgs) == sorted(f"r{i}" for i in range(20))
    assert all(m.ok for m in msgs)
    assert len(read_manifest(d)) == 20
    rep = validate_export(d)
    assert rep.ok, rep.errors
    assert rep.tokens == sum(3 + i for i in range(20))
    # Every slab came back to the pool and is reused: none in use, none queued.
    assert w.pool.in_use == 0 and w.pool.queued == 0 and w.pool.overflow == 0
    lat = w.durable_latency()  # each sample's time from complete rows to durable
    assert lat["durable_n"] == 20 and 0 < lat["durable_ms_p50"] <= lat["durable_ms_p99"] <= lat["durable_ms_max"]
    assert 0 <= lat["copy_wait_ms_p50"] <= lat["copy_wait_ms_max"] <= lat["durable_ms_max"]


def test_duplicate_id_is_refused_not_overwritten(tmp_path):
    d = str(tmp_path)
    w, msgs = make_writer(d)
    submit(w, complete_state("same", 4), lambda: False)
    w.flush()
    submit(w, complete_state("same", 6), lambda: False)
    w.close()
    assert [m.ok for m in msgs] == [True, False] and msgs[1].status == 409
    assert [e["num_tokens"] for e in read_manifest(d)] == [4]


def test_aborted_before_commit_writes_nothing(tmp_path):
    d = str(tmp_path)
    w, msgs = make_writer(d)
    submit(w, complete_state("gone", 4), lambda: True)
    w.close()
    # The call's id travels back, so the HTTP side matches it to that call only.
    assert msgs == [Outcome("gone", "c-gone", aborted=True)]
    assert read_manifest(d) == [] and not any(f.endswith(".safetensors") for _, _, fs in os.walk(d) for f in fs)


def test_io_error_fails_that_sample_and_the_writer_goes_on(tmp_path):
    d = str(tmp_path)
    w, msgs = make_writer(d)
    # A real I/O error: the shard folder's name is taken by a file.
    (tmp_path / "dp0-00000").write_text("in the way")
    submit(w, complete_state("a", 4), lambda: False)
    w.flush()
    os.remove(tmp_path / "dp0-00000")
    submit(w, complete_state("b", 4), lambda: False)
    w.close()
    assert not msgs[0].ok and "could not write sample a" in msgs[0].error and msgs[0].status == 500
    assert msgs[1].ok
    assert [e["id"] for e in read_manifest(d)] == ["b"]


def test_shards_hold_at_most_files_per_shard(tmp_path, monkeypatch):
    import sglang_hs.overlay.sinks as sinks

    monkeypatch.setattr(sinks, "FILES_PER_SHARD", 3)
    d = str(tmp_path)
    w, _ = make_writer(d)
    for i in range(7):
        submit(w, complete_state(f"r{i}", 2), lambda: False)
        w.flush()
    w.close()
    counts = sorted(len(os.listdir(os.path.join(d, s))) for s in os.listdir(d) if s.startswith("dp0-"))
    assert counts == [1, 3, 3]
    w2, _ = make_writer(d)  # a restarted server continues the last shard
    submit(w2, complete_state("r7", 2), lambda: False)
    w2.close()
    assert len(os.listdir(os.path.join(d, "dp0-00002"))) == 2


class SlowCopy:
    """Stands in for a CUDA event of an in-flight device->host copy: the rows are only
    valid once synchronize() returns."""

    def __init__(self, st, value):
        self.st, self.value, self.waited = st, value, False

    def synchronize(self):
        time.sleep(0.05)
        for c in self.st.pieces:
            c.aux.fill_(self.value)  # the copy lands
            c.final.fill_(self.value)
        self.waited = True


def test_writer_waits_for_the_device_copy_before_reading_rows(tmp_path):
    d = str(tmp_path)
    w, msgs = make_writer(d)
    st = complete_state("gpu", 5)
    for c in st.pieces:
        c.aux.fill_(float("nan"))  # what the pinned buffer holds before the copy lands
        c.final.fill_(float("nan"))
    ev = SlowCopy(st, 1.5)
    st.ready.append(ev)
    submit(w, st)
    w.close()
    assert ev.waited and msgs[0].ok
    rep = validate_export(d)
    assert rep.ok, rep.errors  # no NaN: the rows were read after the copy


def test_durable_latency_says_how_much_was_waiting_for_the_copy(tmp_path):
    d = str(tmp_path)
    w, msgs = make_writer(d)
    for i in range(4):
        st = complete_state(f"r{i}", 5, pool=w.pool)
        st.ready.append(SlowCopy(st, 1.0))  # lands 50 ms after the writer starts waiting
        submit(w, st)
    w.close()
    assert all(m.ok for m in msgs)
    lat = w.durable_latency()
    assert 50 <= lat["copy_wait_ms_p50"] < lat["durable_ms_p50"]  # the write (and its fsyncs) comes after
    assert lat["copy_wait_ms_max"] <= lat["durable_ms_max"]
