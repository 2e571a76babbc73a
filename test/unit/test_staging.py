import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_hs.overlay.staging import Piece, SlabPool, joined


def test_pool_is_bounded_applies_backpressure_and_never_deadlocks():
    pool = SlabPool(3 << 10, slab_bytes=1 << 10)  # three slabs at most
    held = [pool.take() for _ in range(3)]
    pool.enqueue()  # the writer has a sample whose slab it will free
    freed = threading.Event()

    def writer():
        time.sleep(0.3)
        held[0].unref()
        freed.set()
        pool.dequeue()

    threading.Thread(target=writer).start()
    t0 = time.perf_counter()
    again = pool.take()  # waits for the writer
    assert freed.is_set() and time.perf_counter() - t0 >= 0.25 and again is held[0]
    # Only unfinished prompts hold slabs and nothing is queued: waiting would hang, so an
    # unpooled slab is handed out and the pool itself never grows past its limit.
    extra = pool.take()
    assert not extra.pooled and pool.overflow == 1 and pool.pooled == 3
    extra.unref()
    assert pool.stats()["host_bytes_allocated"] == 3 << 10


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pieces_lay_rows_out_contiguously_in_slabs_and_return_them(dtype):
    k, h = 3, 8
    row_bytes = (k + 1) * h * torch.empty((), dtype=dtype).element_size()
    pool = SlabPool(1 << 20, slab_bytes=5 * row_bytes + 7)  # five rows per slab, a ragged tail unused
    pieces = pool.pieces(12, k, h, dtype)
    assert [p.rows for p in pieces] == [5, 5, 2] and pool.in_use == 3
    for i, p in enumerate(pieces):
        assert p.aux.shape == (p.rows, k, h) and p.final.shape == (p.rows, h)
        assert p.aux.is_contiguous() and p.final.is_contiguous() and p.aux.dtype == dtype
        p.aux.fill_(i)
        p.final.fill_(-i)
    # aux and final of one slab do not overlap
    assert all((p.aux == i).all() and (p.final == -i).all() for i, p in enumerate(pieces))
    for p in pieces:
        p.release()
    assert pool.in_use == 0 and len(pool._free) == 3


def test_a_row_larger_than_a_slab_is_refused():
    with pytest.raises(RuntimeError, match="exceeds a slab"):
        SlabPool(1 << 20, slab_bytes=64).pieces(1, 3, 64, torch.bfloat16)


def test_small_forwards_share_a_slab_so_decode_steps_do_not_take_one_each():
    # Decode rows: every decode step stages one row per request and the requests keep them
    # until they finish. 200 steps of 4 rows each fit in two slabs of 400 rows; a slab per
    # step would exhaust a pool of 8 (and hand out unpooled slabs) after 8 steps.
    k, h = 3, 8
    row_bytes = (k + 1) * h * 2
    pool = SlabPool(8 * 400 * row_bytes, slab_bytes=400 * row_bytes)
    kept = []
    for step in range(200):
        (p,) = pool.pieces(4, k, h, torch.bfloat16)
        p.aux.fill_(step)
        p.final.fill_(-step)
        kept.append(p)
    assert pool.overflow == 0 and pool.pooled == 2 and pool.in_use == 2
    assert all((p.aux == i).all() and (p.final == -i).all() for i, p in enumerate(kept))  # no overlap
    for p in kept[:100]:
        p.release()
    assert pool.in_use == 1  # the first slab went back once every row in it was released
    for p in kept[100:]:
        p.release()
    assert pool.in_use == 0


def test_a_pool_that_drops_when_full_never_waits_nor_overflows():
    # Live capture: the forward loop must not wait for the writer, so a full pool gives nothing.
    pool = SlabPool(2 << 10, slab_bytes=1 << 10, drop_when_full=True)
    a = pool.pieces(16, 3, 8, torch.bfloat16) + pool.pieces(16, 3, 8, torch.bfloat16)  # 64 B rows: 2 full slabs
    pool.enqueue()  # a queued sample that would free one, which a held pool waits for
    t0 = time.perf_counter()
    assert pool.pieces(1, 3, 8, torch.bfloat16) is None
    assert time.perf_counter() - t0 < 0.5 and pool.overflow == 0 and pool.full == 1
    for p in a:
        p.release()
    assert pool.in_use == 0 and pool.pieces(1, 3, 8, torch.bfloat16) is not None


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(deadline=None, max_examples=200)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 3)), min_size=1, max_size=40))
def test_room_says_exactly_what_a_dropping_pool_can_place_and_a_refusal_gives_it_all_back(ops):
    """Live capture decides which samples to keep from `room`: a request for at most that
    many rows is placed, one for more is refused and leaves the room as it was."""
    pool = SlabPool(4 * 640, slab_bytes=640, drop_when_full=True)  # 4 slabs of 10 rows of 64 bytes
    held = []
    for n, free in ops:
        for _ in range(min(free, len(held))):  # the writer frees the oldest samples' rows
            for p in held.pop(0):
                p.release()
        room = pool.room(64)
        got = pool.pieces(n, 1, 8, torch.float32)
        assert (got is not None) == (n <= room), (n, room)
        if got is None:
            assert pool.room(64) == room
        else:
            assert sum(p.rows for p in got) == n and pool.room(64) == room - n
            held.append(got)
    for ps in held:
        for p in ps:
            p.release()
    assert pool.in_use == 0 and pool.room(64) == 40 and pool.overflow == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=12), st.booleans())
def test_split_hands_out_each_run_of_rows_with_its_own_slab_reference(sizes, scaled):
    k, h, n = 2, 3, sum(sizes)
    pool = SlabPool(1 << 16, slab_bytes=1 << 14)
    (piece,) = pool.pieces(n, k, h, torch.float32, scaled=scaled)
    rows = torch.arange(n * k * h, dtype=torch.float32)
    piece.aux.copy_(rows.view(n, k, h))
    piece.final.copy_(rows[:n * h].view(n, h))
    cuts = piece.split(sizes)
    assert [c.rows for c in cuts] == sizes
    at = 0
    for c, r in zip(cuts, sizes):
        assert torch.equal(c.aux, piece.aux[at:at + r]) and torch.equal(c.final, piece.final[at:at + r])
        assert (c.aux_scale is None) == (not scaled) and (c.final_scale is None) == (not scaled)
        at += r
    piece.release()  # the forward's own reference: the cuts keep the slab
    assert pool.stats()["host_bytes_in_use"] > 0
    for c in cuts:
        c.release()
    assert pool.stats()["host_bytes_in_use"] == 0


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.lists(st.tuples(st.integers(1, 6), st.integers(0, 5), st.integers(1, 2)),
                                    min_size=1, max_size=60),
       st.sampled_from([1 << 11, 1 << 13]), st.booleans())
def test_joined_gathers_a_requests_decode_rows_as_the_pieces_views_hold_them(prompt, steps, slab_bytes, scaled):
    """A prompt staged whole, then decode steps of `bs` rows of which this request's are
    [at, at + n): joined() equals the pieces' own views put end to end, for every plane, in one
    tensor per prompt piece and one per run of decode rows in one slab."""
    K, H = 2, 8
    dtype = torch.float8_e4m3fn if scaled else torch.bfloat16
    pool = SlabPool(1 << 22, slab_bytes=slab_bytes)

    def staged(n):
        ps = pool.pieces(n, K, H, dtype, scaled=scaled)
        for p in ps:
            for x in p.planes():
                x.copy_(torch.randn(x.shape).to(x.dtype))
        return ps

    mine = staged(prompt)
    for bs, at, n in steps:
        at, n = min(at, bs - 1), min(n, bs - min(at, bs - 1))
        step = [c for p in staged(bs) for c in p.split([1] * p.rows)]  # a row of every request
        mine += step[at:at + n]
    for plane in ("aux", "final", "aux_scale", "final_scale"):
        want = [getattr(Piece._cut(p._of, p._at, p.rows, None), plane) if p._of is not None else getattr(p, plane)
                for p in mine]
        got = joined(mine, plane)
        if want[0] is None:
            assert got == [None]
            continue
        assert torch.equal(torch.cat(got).view(torch.uint8), torch.cat(want).view(torch.uint8))
        runs = sum(1 for i, p in enumerate(mine) if p._of is None or i == 0 or mine[i - 1]._of is None
                   or mine[i - 1].slab is not p.slab)
        assert len(got) == runs  # a tensor per prompt piece, a gather per run of decode rows in one slab
