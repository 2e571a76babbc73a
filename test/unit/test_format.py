import json
import os

import pytest
import torch

from harness.fixtures import write_test_export_json
from sglang_hs.format import (
    DuplicateSampleError,
    SampleIdError,
    append_manifest,
    check_compatible,
    check_sample_id,
    open_manifest,
    read_manifest,
    repair_export,
    validate_export,
    write_sample_file,
)

H, K = 8, 3


def export_dir(tmp_path, n=2, t=5, **overrides):
    d = str(tmp_path)
    write_test_export_json(d, H)
    fd = open_manifest(d)
    os.makedirs(os.path.join(d, "dp0-00000"))
    for i in range(n):
        sid = f"s{i}"
        tensors = {"token_ids": torch.arange(t), "aux_hidden_states": torch.randn(t, K, H).bfloat16(),
                   "final_hidden_states": torch.randn(t, H).bfloat16(),
                   "loss_mask": torch.tensor([0, 1] * (t // 2) + [1] * (t % 2), dtype=torch.uint8)}
        tensors.update(overrides.get(sid, {}))
        rel = f"dp0-00000/{sid}.safetensors"
        write_sample_file(os.path.join(d, rel), tensors, {"id": sid, "aux_layer_ids": json.dumps([2, 5, 7])})
        append_manifest(fd, sid, rel, t)
    os.close(fd)
    return d


@pytest.mark.parametrize("rid", ["sample-000123", "a", "A.b_c-9", "x" * 200])
def test_safe_ids(rid):
    assert check_sample_id(rid) == rid


@pytest.mark.parametrize("rid", ["", "../etc/passwd", "a/b", ".hidden", "-flag", "a b", "x" * 201,
                                 "a\x00b", "名前", "s.tmp", None, 5, "..", "/abs"])
def test_hostile_ids_are_rejected(rid):
    with pytest.raises(SampleIdError):
        check_sample_id(rid)


def test_valid_export_validates(tmp_path):
    rep = validate_export(export_dir(tmp_path), expected_tokens={"s0": list(range(5)), "s1": list(range(5))})
    assert rep.ok, rep.errors
    assert rep.samples == 2 and rep.tokens == 10 and rep.bytes > 0


def test_validator_finds_each_kind_of_damage(tmp_path):
    bad_nan = torch.randn(5, H).bfloat16()
    bad_nan[2, 3] = float("nan")
    d = export_dir(tmp_path, n=2, s0={"final_hidden_states": bad_nan},
                   s1={"aux_hidden_states": torch.randn(5, 2, H).bfloat16()})
    rep = validate_export(d, expected_tokens={"s0": [9, 9, 9, 9, 9], "s9": [1]})
    text = "\n".join(rep.errors)
    assert "NaN or Inf" in text and "aux_hidden_states (5, 2, 8)" in text
    assert "differ from the client's tokens" in text and "'s9': expected but not exported" in text
    os.remove(os.path.join(d, "dp0-00000", "s0.safetensors"))
    assert "missing" in "\n".join(validate_export(d).errors)


def test_write_is_atomic_and_never_overwrites(tmp_path):
    p = str(tmp_path / "a.safetensors")
    t = {"x": torch.zeros(2)}
    write_sample_file(p, t, {"id": "a"})
    with pytest.raises(DuplicateSampleError):
        write_sample_file(p, {"x": torch.ones(2)}, {"id": "a"})
    assert os.listdir(tmp_path) == ["a.safetensors"]  # no temporary file left behind


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(Exception):
        write_sample_file(str(tmp_path / "a.safetensors"), {"x": "not a tensor"}, {})
    assert os.listdir(tmp_path) == []


def test_torn_manifest_line_is_skipped_and_reported(tmp_path):
    d = export_dir(tmp_path, n=1)
    with open(os.path.join(d, "manifest.jsonl"), "a") as f:
        f.write('{"id": "b", "pa')
    assert [e["id"] for e in read_manifest(d)] == ["s0"]
    assert any("torn write" in e for e in validate_export(d).errors)


def test_existing_directory_must_match(tmp_path):
    check_compatible({"model_path": "m", "aux_layer_ids": [1, 2]}, {"model_path": "m"})
    with pytest.raises(ValueError, match="aux_layer_ids"):
        check_compatible({"model_path": "m", "aux_layer_ids": [1, 2]}, {"aux_layer_ids": [1, 3]})


# ---- repair: what a crash leaves behind ---------------------------------------------------


def crash_leftovers(tmp_path):
    """A directory as a crash leaves it: s0 and s1 listed; s2 committed but its line never
    written; a torn last line; an interrupted temporary file; an unlisted file that is not a
    sample."""
    d = export_dir(tmp_path, n=3)
    lines = open(os.path.join(d, "manifest.jsonl")).read().splitlines(keepends=True)
    with open(os.path.join(d, "manifest.jsonl"), "w") as f:
        f.writelines(lines[:2])
        f.write('{"id": "s2", "path": "dp0-0')  # torn: the crash hit mid-append
    open(os.path.join(d, "dp0-00000", ".s9.safetensors.1a2b3c4d.tmp"), "wb").write(b"half a file")
    open(os.path.join(d, "dp0-00000", "junk.safetensors"), "wb").write(b"not safetensors")
    return d


def test_repair_dry_run_reports_and_changes_nothing(tmp_path):
    d = crash_leftovers(tmp_path)
    before = {p: open(os.path.join(r, p), "rb").read() for r, _, fs in os.walk(d) for p in fs}
    rep = repair_export(d)
    assert rep.changed and not rep.applied and rep.adopted == ["s2"] and rep.torn_lines == ["line 3"]
    assert "dry run" in rep.lines()[0]
    assert {p: open(os.path.join(r, p), "rb").read() for r, _, fs in os.walk(d) for p in fs} == before


def test_repair_lists_committed_samples_cuts_torn_lines_and_cleans_up(tmp_path):
    d = crash_leftovers(tmp_path)
    assert not validate_export(d).ok  # the torn line
    rep = repair_export(d, apply=True)
    assert rep.adopted == ["s2"] and rep.torn_lines == ["line 3"]
    assert rep.temp_files == ["dp0-00000/.s9.safetensors.1a2b3c4d.tmp"]
    assert len(rep.quarantined) == 1 and rep.quarantined[0].startswith("dp0-00000/junk.safetensors")
    v = validate_export(d)
    assert v.ok and v.samples == 3, v.errors
    assert [e["id"] for e in read_manifest(d)] == ["s0", "s1", "s2"]
    assert os.path.exists(os.path.join(d, "dp0-00000", "junk.safetensors.corrupt"))
    assert not repair_export(d, apply=True).changed, "a second repair finds nothing"


def test_repair_unlists_a_sample_whose_file_is_gone_and_a_duplicate_line(tmp_path):
    d = export_dir(tmp_path, n=3)
    os.unlink(os.path.join(d, "dp0-00000", "s1.safetensors"))
    with open(os.path.join(d, "manifest.jsonl"), "a") as f:
        f.write(json.dumps(read_manifest(d)[0]) + "\n")
    rep = repair_export(d, apply=True)
    assert rep.missing == ["s1"] and rep.duplicates == ["s0"]
    assert validate_export(d).ok and [e["id"] for e in read_manifest(d)] == ["s0", "s2"]


SHORT_WRITE = r"""
import os, resource, signal, sys
from sglang_hs.format import append_manifest, open_manifest
d = sys.argv[1]
fd = open_manifest(d)
append_manifest(fd, "a", "dp0-00000/a.safetensors", 3)
size = os.fstat(fd).st_size
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, resource.RLIM_INFINITY))
try:
    append_manifest(fd, "b", "dp0-00000/b.safetensors", 3)  # only 10 bytes fit: a short write
    print("RETURNED")
except OSError as e:
    print("RAISED", e.errno)
"""


def test_a_short_manifest_write_raises_and_leaves_no_torn_line(tmp_path):
    """A full disk used to leave half a line behind, reported as success, and the next
    append glued onto it. A real file-size limit (RLIMIT_FSIZE) makes the write short."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", SHORT_WRITE, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.stdout.startswith("RAISED"), r.stdout + r.stderr
    assert open(tmp_path / "manifest.jsonl").read() == '{"id": "a", "path": "dp0-00000/a.safetensors", "num_tokens": 3}\n'


# --------------------------------------------------------------------------------------
# Storage: fp8 planes with a scale per row and plane, final rows at loss positions
# --------------------------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as hs  # noqa: E402

from sglang_hs.format import FP8_MAX, Storage, decode_sample, dequantize_rows, quantize_rows  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(rows=hs.integers(1, 6), width=hs.integers(1, 64), log_mag=hs.floats(-44, 38), dtype=hs.sampled_from(
    [torch.float32, torch.bfloat16, torch.float16]), zero_row=hs.booleans(), outlier=hs.floats(1, 1e6),
    seed=hs.integers(0, 2 ** 16))
def test_fp8_scaling_never_makes_nan_or_inf_and_keeps_each_row(rows, width, log_mag, dtype, zero_row, outlier, seed):
    """Zero rows, rows near float32's largest and smallest (subnormal) values, one huge
    outlier per row: finite fp8 and scales, and each row back within fp8's rounding (3
    mantissa bits: 1/16 relative per entry) plus what falls below its subnormals."""
    g = torch.Generator().manual_seed(seed)
    mag = min(10.0 ** log_mag, torch.finfo(dtype).max / 4 / max(outlier, 1))
    x = (torch.randn(rows, width, generator=g) * mag)
    x[:, 0] *= outlier
    if zero_row:
        x[0] = 0
    x = x.to(dtype)
    if not torch.isfinite(x).all():
        return  # the input itself overflowed this dtype
    want = x.float()
    q, scale = quantize_rows(x.clone())
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and tuple(scale.shape) == (rows,)
    assert torch.isfinite(q.float()).all() and torch.isfinite(scale).all() and (scale > 0).all()
    assert q.float().abs().max() <= FP8_MAX
    back = dequantize_rows(q, scale)
    assert torch.isfinite(back).all()
    amax = want.abs().amax(dim=-1, keepdim=True)
    # per entry: 1/16 relative in fp8's normal range, at most half its smallest subnormal step below
    bound = want.abs() / 16 + amax * (2.0 ** -9 / FP8_MAX) * 1.01 + 2 * torch.finfo(torch.float32).tiny
    assert bool(((back - want).abs() <= bound).all())
    if zero_row:
        assert bool((back[0] == 0).all())


def test_fp8_rows_of_hidden_state_statistics_keep_cosine_above_0999():
    """Rows shaped like a transformer's residual stream (a few massive-activation channels)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 3, 576, generator=g)
    x[..., [7, 300]] *= 200
    back = dequantize_rows(*quantize_rows(x.clone()))
    cos = torch.nn.functional.cosine_similarity(back, x, dim=-1)
    assert float(cos.mean()) >= 0.9995 and float(cos.min()) >= 0.999


def storage_export(tmp_path, storage, overrides=None, decode_rows=False):
    """A directory of two fp8/loss-row samples written the way the writer lays them out;
    decode_rows: 5 rows of 6 tokens (3 prompt tokens, 3 generated)."""
    d = str(tmp_path)
    os.makedirs(d, exist_ok=True)
    write_test_export_json(d, H, export_dtype=storage.dtype, final_rows=storage.final_rows)
    fd = open_manifest(d)
    os.makedirs(os.path.join(d, "dp0-00000"))
    mask = torch.tensor([0, 1, 1, 0, 1] + [1] * decode_rows, dtype=torch.uint8)
    pos = torch.nonzero(mask[:5]).flatten()
    for i in range(2):
        sid = f"s{i}"
        aux, fin = torch.randn(5, K, H).bfloat16(), torch.randn(5, H).bfloat16()
        if storage.final_rows == "loss":
            fin = fin[pos]
        t = {"token_ids": torch.arange(5 + decode_rows), "loss_mask": mask}
        if storage.scaled:
            (qa, sa), (qf, sf) = quantize_rows(aux), quantize_rows(fin)
            t |= {"aux_hidden_states": qa, "aux_hidden_states_scale": sa, "final_hidden_states": qf,
                  "final_hidden_states_scale": sf}
        else:
            t |= {"aux_hidden_states": aux, "final_hidden_states": fin}
        if storage.final_rows == "loss":
            t["final_positions"] = pos
        t.update((overrides or {}).get(sid, {}))
        rel = f"dp0-00000/{sid}.safetensors"
        meta = {"id": sid, "aux_layer_ids": json.dumps([2, 5, 7])} | ({"prompt_tokens": "3"} if decode_rows else {})
        write_sample_file(os.path.join(d, rel), t, meta)
        append_manifest(fd, sid, rel, 5 + decode_rows)
    os.close(fd)
    return d


@pytest.mark.parametrize("storage", [Storage("fp8_e4m3"), Storage(None, "loss"), Storage("fp8_e4m3", "loss")])
def test_fp8_and_loss_row_exports_validate_and_decode(tmp_path, storage):
    d = storage_export(tmp_path, storage)
    rep = validate_export(d)
    assert rep.ok, rep.errors
    from sglang_hs.format import final_at_every_position, load_sample

    t = decode_sample(load_sample(os.path.join(d, "dp0-00000/s0.safetensors")), torch.bfloat16)
    assert not any(k.endswith("_scale") for k in t) and t["aux_hidden_states"].dtype == torch.bfloat16
    full = final_at_every_position(t)
    assert full.shape == (5, H) and bool((full[[0, 3]] == 0).all()) == (storage.final_rows == "loss")


def test_validator_finds_storage_damage(tmp_path):
    bad_scale = torch.ones(5, K)
    bad_scale[1, 2] = float("inf")
    d = storage_export(tmp_path / "a", Storage("fp8_e4m3", "loss"),
                       {"s0": {"aux_hidden_states_scale": bad_scale},
                        "s1": {"final_positions": torch.tensor([1, 2, 3])}})
    text = "\n".join(validate_export(d).errors)
    assert "scales must be finite and > 0" in text and "final_positions must be the loss mask's positions" in text
    d = storage_export(tmp_path / "b", Storage("fp8_e4m3"), {"s0": {"final_hidden_states_scale": torch.ones(4)}})
    assert "fp8 planes need float32 scales" in "\n".join(validate_export(d).errors)


def test_a_directory_of_another_storage_is_refused(tmp_path):
    info = write_test_export_json(str(tmp_path), H)
    old = {k: v for k, v in info.items() if k not in ("export_dtype", "final_rows")}  # format sglang-hs/1
    check_compatible(old, {"export_dtype": None, "final_rows": "all"})
    with pytest.raises(ValueError, match="export_dtype"):
        check_compatible(old, {"export_dtype": "fp8_e4m3"})
    with pytest.raises(ValueError, match="final_rows"):
        check_compatible(info, {"final_rows": "loss"})


@pytest.mark.parametrize("storage", [Storage(), Storage("fp8_e4m3"), Storage(None, "loss"), Storage("fp8_e4m3", "loss")])
def test_decode_row_samples_have_no_row_for_the_last_token_and_read_with_one(tmp_path, storage):
    from sglang_hs.format import load_sample, row_at_every_token

    d = storage_export(tmp_path, storage, decode_rows=True)
    rep = validate_export(d, expected_tokens={"s0": list(range(6)), "s1": list(range(6))})
    assert rep.ok, rep.errors
    raw = load_sample(os.path.join(d, "dp0-00000/s0.safetensors"))
    full = row_at_every_token(raw)
    assert full["aux_hidden_states"].shape[0] == 6
    assert torch.equal(full["aux_hidden_states"][:5].float(), raw["aux_hidden_states"].float())
    assert not full["aux_hidden_states"][5].float().any()
    if storage.scaled:
        assert full["aux_hidden_states_scale"][5].tolist() == [1.0] * K
    if storage.final_rows == "loss":  # loss-position rows keep their positions
        assert torch.equal(full["final_hidden_states"].float(), raw["final_hidden_states"].float())
    else:
        assert full["final_hidden_states"].shape[0] == 6


def test_validator_checks_decode_rows_against_prompt_tokens(tmp_path):
    d = storage_export(tmp_path / "a", Storage(), {"s0": {"aux_hidden_states": torch.randn(6, K, H).bfloat16()}},
                       decode_rows=True)
    assert "aux_hidden_states (6, 3, 8) != (5, 3, 8)" in "\n".join(validate_export(d).errors)
    # Without prompt_tokens a sample has a row for every token.
    d = storage_export(tmp_path / "b", Storage(), {"s0": {"token_ids": torch.arange(6)}})
    assert "aux_hidden_states (5, 3, 8) != (6, 3, 8)" in "\n".join(validate_export(d).errors)


@settings(max_examples=200, deadline=None)
@given(rows=hs.lists(hs.integers(0, 40), min_size=1, max_size=30), max_rows=hs.integers(1, 64))
def test_coalesce_keeps_every_row_in_order_and_joins_only_small_pieces(rows, max_rows):
    from sglang_hs.format import coalesce

    whole = torch.randn(sum(rows), K, H).bfloat16()
    parts, at = [], 0
    for r in rows:
        parts.append(whole[at:at + r])
        at += r
    row_bytes = K * H * 2
    out = coalesce(parts, max_rows * row_bytes)
    assert torch.equal(torch.cat(out), whole)
    for t in out:  # a joined tensor never exceeds the bound; a bigger one is a piece left alone
        assert t.shape[0] <= max_rows or any(t.data_ptr() == p.data_ptr() and t.shape == p.shape for p in parts)
    assert len(out) <= len(parts)


def test_a_sample_of_many_one_row_pieces_is_written_in_a_few_writes(tmp_path, monkeypatch):
    """A sample with decode rows arrives as one piece per generated token. Each write (and each
    torch call) gives up the GIL, which a busy scheduler thread holds up to 5 ms at a time: 257
    pieces written one by one took 3.0 s instead of 13 ms (benchmark/results/cpu_gil_writer.json)."""
    from unittest import mock

    aux = [torch.randn(300, K, H).bfloat16()] + [torch.randn(1, K, H).bfloat16() for _ in range(256)]
    fin = [torch.randn(300, H).bfloat16()] + [torch.randn(1, H).bfloat16() for _ in range(256)]
    path = str(tmp_path / "s.safetensors")
    with mock.patch("sglang_hs.format.os.write", wraps=os.write) as writes:
        write_sample_file(path, {"token_ids": torch.arange(557), "aux_hidden_states": aux, "final_hidden_states": fin},
                          {"id": "s"})
    assert writes.call_count <= 8, writes.call_count
    from sglang_hs.format import load_sample

    t = load_sample(path)
    assert torch.equal(t["aux_hidden_states"], torch.cat(aux)) and torch.equal(t["final_hidden_states"], torch.cat(fin))
