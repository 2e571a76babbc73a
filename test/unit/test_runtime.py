"""ExportRuntime on two ranks: a writer (tp0, a real SampleWriter) and a rank that does not
write (tp1), fed the same forwards the way SGLang's tensor-parallel schedulers are. Whatever
only the writer sees (a forward that yields no rows, an abort swept after a chunk) must not
make the ranks cap a request's prefix differently: on GPUs the ranks would then run forwards
of different shapes and hang in their collectives."""

import pytest
import torch

from sglang_hs.runtime import ExportRuntime
from sglang_hs.writer import SampleWriter, SlabPool

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


def forward(rt, st, prefix, extend, capture=True):
    """One extend forward of this request alone on rank `rt`."""
    if rt.begin_forward([st], [prefix], [extend]):
        if capture:
            rows = torch.randn(extend, H)
            rt.capture(rows, [rows])
        rt.end_forward()


def caps_agree(ranks, sw, sn, upstream):
    w, n, _ = ranks
    assert w.prefix_cap(sw, upstream) == n.prefix_cap(sn, upstream)
    assert w.stats()["prefix_caps_digest"] == n.stats()["prefix_caps_digest"]


def test_a_forward_without_rows_on_the_writer_leaves_the_ranks_agreeing(ranks):
    w, n, msgs = ranks
    sw, sn = states(ranks)
    forward(w, sw, 0, 4, capture=False)  # the model bypassed its LogitsProcessor on the writer
    forward(n, sn, 0, 4)
    caps_agree(ranks, sw, sn, 8)
    forward(w, sw, 4, 4)
    forward(n, sn, 4, 4)
    caps_agree(ranks, sw, sn, 8)
    w.writer.flush()
    assert [m["rid"] for m in msgs if not m.get("ok")] == ["r"]  # reported once, as failed
    assert not [m for m in msgs if m.get("ok")]


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
    assert not [m for m in msgs if m.get("ok")]


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
    assert [m["rid"] for m in msgs if m.get("ok")] == ["r"]
