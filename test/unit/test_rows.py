import pytest
import torch

from sglang_hs.overlay.rows import RequestState, build_sample, gather_rows, plan_forward, split_rows
from sglang_hs.overlay.staging import Piece
from sglang_hs.protocol import RequestOptions, RequestOptionsError

H, K = 4, 2


def state(rid, n):
    return RequestState(rid=rid, prompt_ids=list(range(100, 100 + n)), options=RequestOptions())


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
    rows, segs, failed = plan_forward(states, prefix, extend)
    positions = [list(range(p, p + e)) for p, e in zip(prefix, extend)]
    all_rows = forward_rows(positions)
    host = all_rows[torch.tensor(rows, dtype=torch.long)] if rows else all_rows
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
    rows, segs, _ = plan_forward([a], [3], [1])  # mixed-chunk decode row
    assert rows == [] and segs == []


def test_retracted_request_prefilled_again_adds_no_rows():
    a = state("a", 6)
    done, _ = run([a], [0], [6])
    assert done == [a] and a.planned
    # After retraction SGLang prefills prompt + output again from position 0.
    rows, segs, _ = plan_forward([a], [0], [8])
    assert rows == [] and segs == []


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
