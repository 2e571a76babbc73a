import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from sglang_hs.overlay.rows import (RequestState, build_sample, gather_rows, plan_decode, plan_forward, row_index,
                                    spans, split_rows)
from sglang_hs.format import Storage
from sglang_hs.overlay.staging import GraphRows, Piece
from sglang_hs.protocol import RequestOptions, RequestOptionsError

H, K = 4, 2


def state(rid, n, decode_rows=False):
    return RequestState(rid=rid, prompt_ids=list(range(100, 100 + n)), options=RequestOptions(decode_rows=decode_rows))


def forward_rows(positions_per_req):
    """Rows of a fake forward: row value encodes (request, prompt position, plane)."""
    rows = []
    for r, positions in enumerate(positions_per_req):
        for p in positions:
            rows.append(torch.tensor([[r * 1000 + p + 0.1 * k] * H for k in range(K + 1)]))
    return torch.stack(rows) if rows else torch.zeros(0, K + 1, H)


def run(states, prefix, extend, piece_rows=3):
    """One forward: plan, make rows for every extend token, stage the planned ones in pieces
    of `piece_rows` rows (as slabs would), and hand them to the requests."""
    return stage(plan_forward(states, prefix, extend), [list(range(p, p + e)) for p, e in zip(prefix, extend)],
                 piece_rows)


def run_decode(states, seq_lens, piece_rows=3):
    """One decode forward: request i feeds the token at position seq_lens[i] - 1."""
    return stage(plan_decode(states, seq_lens), [[n - 1] for n in seq_lens], piece_rows)


def stage(plan, positions, piece_rows):
    segs, failed = plan
    all_rows = forward_rows(positions)
    host = gather_rows(all_rows[:, K], all_rows[:, :K].reshape(all_rows.shape[0], -1), row_index(segs, all_rows.device),
                       K) if segs else (all_rows[:, :K], all_rows[:, K])
    host = torch.cat([host[0], host[1][:, None]], 1)
    staged = [Piece(host[a:a + piece_rows, :K].contiguous(), host[a:a + piece_rows, K].contiguous())
              for a in range(0, host.shape[0], piece_rows)]
    done = split_rows(staged, segs) if segs else []
    return done, failed


def positions_of(st, r):
    rows = torch.cat([p.aux for p in st.pieces])
    finals = torch.cat([p.final for p in st.pieces])
    assert torch.allclose(finals[:, 0] - rows[:, 0, 0], torch.full((rows.shape[0],), 0.1 * K), atol=1e-2)
    return (rows[:, 0, 0] - r * 1000).round().long().tolist()


def test_batch_of_requests_rows_go_to_their_request():
    a, b = state("a", 3), state("b", 5)
    done, _ = run([a, None, b], [0, 7, 0], [3, 2, 5])  # a request that is not exported sits between
    assert [s.rid for s in done] == ["a", "b"]
    assert positions_of(a, 0) == [0, 1, 2]
    assert positions_of(b, 2) == [0, 1, 2, 3, 4]


def test_chunked_prefill_stitches_in_order():
    a = state("a", 10)
    assert run([a], [0], [4])[0] == []
    assert a.next_pos == 4
    assert run([a], [4], [4])[0] == []
    done, _ = run([a], [8], [2])
    assert done == [a] and positions_of(a, 0) == list(range(10))


def test_decode_and_output_tokens_are_not_exported():
    a = state("a", 3)
    assert run([a], [0], [3])[0] == [a] and a.planned  # handed to the writer
    segs, _ = plan_forward([a], [3], [1])  # mixed-chunk decode row
    assert segs == []


def test_retracted_request_prefilled_again_adds_no_rows():
    a = state("a", 6)
    done, _ = run([a], [0], [6])
    assert done == [a] and a.planned
    # After retraction SGLang prefills prompt + output again from position 0.
    segs, _ = plan_forward([a], [0], [8])
    assert segs == []


def test_restart_mid_prompt_replaces_overlap_instead_of_duplicating():
    a = state("a", 8)
    run([a], [0], [5])
    done, _ = run([a], [3], [5])  # recompute from position 3 (prefix shorter than held rows)
    assert done == [a] and positions_of(a, 0) == list(range(8))


def test_prefix_beyond_exported_rows_fails_instead_of_leaving_a_hole():
    a = state("a", 8)
    run([a], [0], [2])
    _, failed = run([a], [5], [3])
    assert failed == [a] and a.planned and a.dropped and "never computed" in a.error


def test_prefix_cap_forces_full_recompute_then_own_chunks():
    a = state("a", 10)
    assert a.prefix_cap(9) == 0  # nothing exported yet: recompute everything
    run([a], [0], [4])
    assert a.prefix_cap(9) == 4  # its own first chunk, never someone else's longer prefix
    run([a], [4], [6])
    assert a.planned and a.prefix_cap(9) == 9  # finished: the cache is free to use again


def test_gather_rows_list_and_packed_aux_agree():
    n = 6
    final = torch.randn(n, H)
    aux = [torch.randn(n, H) for _ in range(K)]
    idx = torch.tensor([4, 1, 2])
    a_aux, a_fin = gather_rows(final, aux, idx, K)
    b_aux, b_fin = gather_rows(final, torch.cat(aux, dim=-1), idx, K)
    assert a_aux.shape == (3, K, H) and a_aux.is_contiguous() and a_fin.is_contiguous()
    assert torch.equal(a_aux, b_aux) and torch.equal(a_fin, b_fin)
    assert torch.equal(a_fin, final[idx]) and torch.equal(a_aux[:, 0], aux[0][idx])


def test_build_sample_shapes_and_loss_mask():
    a = RequestState(rid="a", prompt_ids=[5, 6, 7], options=RequestOptions(loss_mask=[0, 1, 1]))
    run([a], [0], [3])
    t = build_sample(a)
    assert t["token_ids"].tolist() == [5, 6, 7]
    assert torch.cat(t["aux_hidden_states"]).shape == (3, K, H)
    assert torch.cat(t["final_hidden_states"]).shape == (3, H)
    assert t["loss_mask"].dtype == torch.uint8 and t["loss_mask"].tolist() == [0, 1, 1]
    a.options.loss_mask = [1]
    with pytest.raises(RequestOptionsError, match="one 0/1 per prompt token"):
        build_sample(a)


def test_decode_rows_follow_the_prompt_and_complete_when_the_request_finishes():
    a, b = state("a", 3, decode_rows=True), state("b", 2)
    assert run([a, b], [0, 0], [3, 2])[0] == [b]  # a prompt-only sample is complete; a decodes on
    assert not a.planned and a.prefix_cap(9) == 3
    assert run_decode([a, b], [4, 3])[0] == []  # feeds a's first generated token (position 3)
    run_decode([a, b], [5, 4])
    assert positions_of(a, 0) == [0, 1, 2, 3, 4] and not a.complete
    assert a.finish([7, 8, 9]) is None  # 3 tokens generated: the last one never went through a forward
    assert a.complete and a.planned and a.num_tokens == 6 and a.num_rows == 5
    t = build_sample(a)
    assert t["token_ids"].tolist() == [100, 101, 102, 7, 8, 9]
    assert torch.cat(t["aux_hidden_states"]).shape == (5, K, H)


def test_finishing_with_a_missing_decode_row_fails_instead_of_writing_a_hole():
    a = state("a", 3, decode_rows=True)
    run([a], [0], [3])
    assert "positions 0..2 of 0..3" in a.finish([7, 8])


def test_a_decode_row_past_a_missing_one_fails_the_sample():
    a = state("a", 3, decode_rows=True)
    run([a], [0], [3])
    _, failed = run_decode([a], [6])
    assert failed == [a] and a.dropped and "never computed" in a.error


def test_loss_mask_covers_the_answer():
    a = RequestState(rid="a", prompt_ids=[5, 6], options=RequestOptions(loss_mask=[0, 0], decode_rows=True))
    run([a], [0], [2])
    run_decode([a], [3])
    a.finish([1, 2])
    assert build_sample(a)["loss_mask"].tolist() == [0, 0, 1, 1]


@settings(max_examples=300, deadline=None)
@given(prompt=hs.integers(1, 12), answer=hs.integers(1, 10), chunk=hs.integers(1, 8), piece=hs.integers(1, 4),
       retract_at=hs.lists(hs.integers(0, 9), max_size=3), reuse=hs.lists(hs.integers(0, 30), min_size=3, max_size=3),
       overshoot=hs.booleans(), steps_per_round=hs.integers(1, 3))
def test_decode_rows_cover_every_position_exactly_once(prompt, answer, chunk, piece, retract_at, reuse, overshoot,
                                                       steps_per_round):
    """A request's life as the scheduler runs it: chunked prefill, decode steps (several per
    scheduling round, as --num-continuous-decode-steps), retractions that prefill prompt and
    answer again from whatever prefix the cap allows, and under overlap scheduling one more
    decode forward after the last token. Two tensor-parallel ranks plan alike; the writer's
    sample holds rows 0..T-2, each once."""
    ranks = [state("a", prompt, decode_rows=True), state("a", prompt, decode_rows=True)]
    writer = ranks[0]
    caps = [[], []]
    for r, st in enumerate(ranks):
        out = []  # generated tokens so far
        pos = 0
        while pos < prompt:  # chunked prefill of the prompt; the last chunk samples the first token
            e = min(chunk, prompt - pos)
            (run if r == 0 else plan_only)([st], [pos], [e], piece)
            pos += e
        out.append(0)
        retractions = iter(sorted(set(retract_at)))
        next_retract = next(retractions, None)
        while len(out) < answer:
            for _ in range(steps_per_round):
                if len(out) >= answer:
                    break
                seq_len = prompt + len(out)  # the decode step feeds out[-1] at position seq_len - 1
                (run_decode if r == 0 else plan_decode_only)([st], [seq_len], piece)
                out.append(len(out))
            if next_retract is not None and len(out) - 1 >= next_retract and len(out) < answer:
                # retracted: KV freed; later it prefills prompt + answer so far, reusing what the cap allows
                fill = prompt + len(out)
                cap = st.prefix_cap(min(reuse[len(caps[r]) % 3], fill - 1))
                caps[r].append(cap)
                (run if r == 0 else plan_only)([st], [cap], [fill - cap], piece)
                out.append(len(out))  # the re-prefill samples the next token
                next_retract = next(retractions, None)
        if overshoot:  # overlap scheduling ran one decode forward past the end before the finish was seen
            (run_decode if r == 0 else plan_decode_only)([st], [prompt + len(out)], piece)
        error = st.finish(out)  # a rank that does not write holds no rows: only the writer's answer counts
        assert error is None or r == 1
    assert caps[0] == caps[1]  # every rank reuses the same prefix
    assert writer.complete and writer.num_rows == prompt + answer - 1
    assert positions_of(writer, 0) == list(range(prompt + answer - 1))


def plan_only(states, prefix, extend, piece_rows):
    plan_forward(states, prefix, extend)


def plan_decode_only(states, seq_lens, piece_rows):
    plan_decode(states, seq_lens)


def test_graph_rows_hold_each_replay_s_rows_for_the_planned_gather():
    """The static buffers a decode graph writes: recorded at the largest bucket, refilled by a
    smaller one, gathered as the eager rows are (packed and list aux alike)."""
    g = GraphRows(K)
    big = torch.randn(8, H), [torch.randn(8, H) for _ in range(K)]
    g.record(*big)
    small = torch.randn(3, H), torch.randn(3, K * H)
    g.record(*small)
    idx = torch.tensor([2, 0])
    assert all(torch.equal(x, y) for x, y in zip(gather_rows(g.final, g.aux, idx, K),
                                                 gather_rows(small[0], small[1], idx, K)))
    with pytest.raises(RuntimeError, match="capture order"):
        g.record(torch.randn(9, H), torch.randn(9, K * H))
    with pytest.raises(RuntimeError, match="aux layers"):
        g.record(torch.randn(2, H), [torch.randn(2, H)])


def test_a_request_keeps_only_its_newest_copy_event():
    """Decode rows come one forward at a time; all device->host copies go through one stream,
    so the newest event covers the others. Kept one per forward, the writer waited on 257
    events per sample, each giving up the GIL to a busy scheduler thread."""
    a = state("a", 3, decode_rows=True)
    events = [object() for _ in range(5)]
    plan = plan_forward([a], [0], [3])
    split_rows([Piece(torch.zeros(3, K, H), torch.zeros(3, H))], plan[0], events[0])
    for n, ev in zip(range(4, 8), events[1:]):
        segs, _ = plan_decode([a], [n])
        split_rows([Piece(torch.zeros(1, K, H), torch.zeros(1, H))], segs, ev)
    assert a.ready == [events[-1]]


@settings(max_examples=200, deadline=None)
@given(rows=hs.lists(hs.integers(1, 6), min_size=1, max_size=12), data=hs.data())
def test_final_rows_at_loss_positions_are_the_masked_rows_whatever_the_pieces(rows, data):
    n = sum(rows)
    mask = data.draw(hs.lists(hs.integers(0, 1), min_size=n, max_size=n))
    a = RequestState(rid="a", prompt_ids=list(range(n)), options=RequestOptions(loss_mask=mask))
    whole = torch.randn(n, K + 1, H)
    at = 0
    for r in rows:
        a.add_rows(at, [Piece(whole[at:at + r, :K].contiguous(), whole[at:at + r, K].contiguous())])
        at += r
    t = build_sample(a, Storage(None, "loss"))
    pos = [i for i, m in enumerate(mask) if m]
    assert t["final_positions"].tolist() == pos
    assert torch.equal(torch.cat(t["final_hidden_states"]), whole[pos, K])


@settings(max_examples=300, deadline=None)
@given(reqs=hs.lists(hs.tuples(hs.booleans(), hs.integers(0, 5), hs.integers(1, 7)), min_size=1, max_size=10))
def test_row_index_gathers_exactly_the_planned_rows_in_order(reqs):
    """A forward of requests (exported or not, prefix, extend): the rows gathered through the
    planned spans are the planned positions' rows, request by request, as a per-row index of
    ints would give; one run of rows is a plain slice (no index built)."""
    states = [state(f"r{i}", p + e) if exported else None for i, (exported, p, e) in enumerate(reqs)]
    for st, (_, p, _) in zip(states, reqs):
        if st is not None:
            st.next_pos = p  # the request exported its first p positions in earlier chunks
    segs, failed = plan_forward(states, [p for _, p, _ in reqs], [e for _, _, e in reqs])
    assert not failed
    n = sum(e for _, _, e in reqs)
    final, aux = torch.randn(n, H), torch.randn(n, K * H)
    expected = [seg.row + j for seg in segs for j in range(seg.num_rows)]
    if not segs:
        return
    idx = row_index(segs, final.device)
    assert isinstance(idx, slice) == (len(spans(segs)) == 1)
    got_aux, got_final = gather_rows(final, aux, idx, K)
    ref = torch.tensor(expected)
    assert torch.equal(got_final, final[ref]) and torch.equal(got_aux, aux[ref].view(-1, K, H))
    assert got_final.data_ptr() != final.data_ptr()  # its own rows, never a view of the forward's
