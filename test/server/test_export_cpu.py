"""A real SGLang server on CPU, started with the stock launcher and our flag; references from
Hugging Face transformers (sglang_hs.tools.verify runs the HF forward, independent of SGLang)."""

import concurrent.futures as cf
import errno
import os
import random
import subprocess
import threading
import time

import pytest
import requests
from hypothesis import HealthCheck, given, settings, strategies as st
import torch

from harness.bench import measure_prefill
from harness.fixtures import prompts
from sglang_hs.format import load_sample, read_manifest, validate_export
from sglang_hs.tools.serve import LocalServer
from sglang_hs.tools.verify import verify_export

pytestmark = pytest.mark.server

CHUNK = 64


def export(srv, rid, ids, max_new_tokens=1, **extra):
    r = srv.generate({"rid": rid, "input_ids": ids,
                      "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, **extra.pop("sp", {})},
                      **extra})
    return r


def sample(out_dir, rid):
    entry = {e["id"]: e for e in read_manifest(out_dir)}[rid]
    return load_sample(os.path.join(out_dir, entry["path"]))


def assert_exact_vs_hf(out_dir):
    rep = verify_export(out_dir, samples=None)
    print(rep.table())
    assert rep.ok, rep.table() + "\n" + "\n".join(rep.format_errors)
    return rep


@pytest.fixture(scope="module")
def tiny_server(tiny_path, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("export"))
    log = str(tmp_path_factory.mktemp("logs") / "server.log")
    args = ["--model-path", tiny_path, "--export-hidden-states-dir", out, "--chunked-prefill-size", str(CHUNK),
            "--enable-return-hidden-states", "--skip-server-warmup", "--log-level", "info"]
    with LocalServer(args, log) as srv:
        yield srv


@pytest.mark.core
def test_rows_equal_return_hidden_states_and_match_hf_across_many_chunks(tiny_server):
    srv = tiny_server
    lengths = [1, 2, 63, 64, 65, 200, 700]  # up to 11 chunks of 64
    for i, ids in enumerate(prompts(1, lengths)):
        t0 = time.perf_counter()
        r = export(srv, f"exact-{i}", ids, return_hidden_states=True)
        wall_ms = 1000 * (time.perf_counter() - t0)
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert meta["hidden_states_export"]["num_tokens"] == len(ids)
        assert 0 <= meta["hidden_states_export"]["held_ms"] < wall_ms  # a part of the request's latency
        t = sample(srv.export_dir, f"exact-{i}")
        assert t["token_ids"].tolist() == ids
        # The runtime's own rows (packed aux, as upstream returns them with aux capture on):
        # equal where they overlap (upstream returns the rows of the last prefill chunk).
        rt = torch.tensor(meta["hidden_states"][0], dtype=torch.float32)
        if rt.dim() == 1:
            rt = rt[None]
        ours = t["aux_hidden_states"].float().flatten(1)[-rt.shape[0]:]
        assert rt.shape[0] >= 1 and torch.equal(ours, rt), f"prompt {i}: differs from return_hidden_states"
    assert_exact_vs_hf(srv.export_dir)


@pytest.mark.core
def test_prefix_cache_same_prompt_twice_and_shared_prefixes(tiny_server):
    srv = tiny_server
    base, = prompts(2, [150])
    tails = prompts(3, [1, 40, 130])
    cases = {"twice-a": base, "twice-b": base, **{f"shared-{j}": base[:100] + t for j, t in enumerate(tails)},
             "first-token-only": base[:1] + tails[2]}
    for rid, ids in cases.items():
        r = export(srv, rid, ids)
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["cached_tokens"] == 0  # exported requests recompute in full
    for rid, ids in cases.items():
        t = sample(srv.export_dir, rid)
        assert t["token_ids"].tolist() == ids and t["final_hidden_states"].shape[0] == len(ids)
    a, b = sample(srv.export_dir, "twice-a"), sample(srv.export_dir, "twice-b")
    assert torch.equal(a["aux_hidden_states"], b["aux_hidden_states"])
    # Other traffic keeps using the cache.
    r = export(srv, "not-exported", base, sp={"custom_params": {"sglang_hs": {"export": False}}})
    assert r.status_code == 200 and r.json()["meta_info"]["cached_tokens"] > 0
    assert "hidden_states_export" not in r.json()["meta_info"]
    assert "not-exported" not in {e["id"] for e in read_manifest(srv.export_dir)}


def test_a_benchmark_round_reads_how_long_export_held_its_answers(tiny_server):
    m = measure_prefill(tiny_server.url, prompts(4, [40] * 8), 4, rid_prefix="held")
    assert 0 <= m["held_ms_p50"] <= m["held_ms_p99"] <= m["held_ms_max"] < 1000 * m["seconds"]
    assert m["held_ms_last"] <= m["held_ms_max"]
    opted_out = measure_prefill(tiny_server.url, prompts(5, [40] * 4), 4, export=False)
    assert "held_ms_max" not in opted_out


def test_32_concurrent_requests_of_mixed_lengths(tiny_server):
    srv = tiny_server
    lengths = [random.Random(i).randrange(2, 400) for i in range(32)]
    ps = prompts(4, lengths)
    with cf.ThreadPoolExecutor(32) as ex:
        rs = list(ex.map(lambda i: export(srv, f"conc-{i}", ps[i], max_new_tokens=1 + i % 4), range(32)))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
    rep = validate_export(srv.export_dir, expected_tokens={f"conc-{i}": ps[i] for i in range(32)})
    assert rep.ok, rep.errors
    assert_exact_vs_hf(srv.export_dir)


def test_loss_mask_and_metadata_land_in_the_file(tiny_server):
    srv = tiny_server
    ids, = prompts(5, [90])
    mask = [i % 3 == 0 for i in range(90)]
    r = export(srv, "masked", ids, sp={"custom_params": {"sglang_hs": {"loss_mask": [int(m) for m in mask],
                                                                       "metadata": {"source": "unit", "n": 3}}}})
    assert r.status_code == 200, r.text
    t = sample(srv.export_dir, "masked")
    assert t["loss_mask"].tolist() == [int(m) for m in mask]
    from sglang_hs.format import sample_metadata

    path = os.path.join(srv.export_dir, r.json()["meta_info"]["hidden_states_export"]["path"])
    assert '"source": "unit"' in sample_metadata(path)["metadata"]
    r = export(srv, "bad-mask", ids, sp={"custom_params": {"sglang_hs": {"loss_mask": [1, 0]}}})
    assert r.status_code == 400 and "one 0/1 per prompt token" in r.text
    r = export(srv, "bad-mask-2", ids, sp={"custom_params": {"sglang_hs": {"loss_mask": [2] * 90}}})
    assert r.status_code == 400
    assert not {"bad-mask", "bad-mask-2"} & {e["id"] for e in read_manifest(srv.export_dir)}


HOSTILE = ["../escape", "/etc/passwd", "a/b", ".hidden", "x" * 300, "a\nb", "sp ace", "..", "s.tmp"]


def test_hostile_rids_are_rejected_and_the_server_goes_on(tiny_server, tmp_path):
    srv = tiny_server
    before = set(os.listdir(os.path.dirname(srv.export_dir)))
    for rid in HOSTILE:
        r = export(srv, rid, [5, 6, 7])
        assert r.status_code == 400 and "cannot name an exported sample" in r.text, (rid, r.text)
    assert set(os.listdir(os.path.dirname(srv.export_dir))) == before
    assert not any(rid in {e["id"] for e in read_manifest(srv.export_dir)} for rid in HOSTILE)
    r = export(srv, "after-hostile", [5, 6, 7])
    assert r.status_code == 200


def test_an_exported_rid_is_never_overwritten(tiny_server):
    srv = tiny_server
    assert export(srv, "dup", [5, 6, 7]).status_code == 200
    r = export(srv, "dup", [8, 9])
    assert r.status_code == 409 and "already exported" in r.text
    assert sample(srv.export_dir, "dup")["token_ids"].tolist() == [5, 6, 7]


def test_aborted_request_writes_nothing_and_leaks_nothing(tiny_server):
    srv = tiny_server
    # Only what the aborts log counts (SGLang 0.5.23 logs a traceback of its own at start-up:
    # its /freeze_gc call to itself before the port is open).
    log_start = os.path.getsize(srv.log_path)
    aborted = []
    for attempt in range(4):
        rid = f"abort-{attempt}"
        ids, = prompts(10 + attempt, [4000])  # about 63 chunks of 64
        res = {}
        th = threading.Thread(target=lambda: res.setdefault("r", export(srv, rid, ids)))
        th.start()
        time.sleep(0.5 + 0.3 * attempt)
        requests.post(srv.url + "/abort_request", json={"rid": rid}, timeout=30)
        th.join(120)
        fin = res["r"].json()["meta_info"]["finish_reason"] if res["r"].status_code == 200 else {"type": "abort"}
        if fin.get("type") == "abort":
            aborted.append(rid)
            assert rid not in {e["id"] for e in read_manifest(srv.export_dir)}
            assert not any(rid in f for _, _, fs in os.walk(srv.export_dir) for f in fs)
    assert aborted, "no request was aborted mid-prefill; the test did not exercise anything"
    # Nothing leaked: the server serves and exports the next request normally.
    r = export(srv, "after-abort", prompts(20, [300])[0])
    assert r.status_code == 200
    # An aborted rid may be sent again; the new request gets its own outcome, never the
    # first one's abort (which the scheduler may report after the first handler has left).
    ids = prompts(21, [100])[0]
    r = export(srv, aborted[0], ids)
    assert r.status_code == 200 and r.json()["meta_info"]["hidden_states_export"]["num_tokens"] == 100, r.text
    assert sample(srv.export_dir, aborted[0])["token_ids"].tolist() == ids
    with open(srv.log_path, errors="replace") as f:
        f.seek(log_start)
        assert "Traceback" not in f.read()


def test_a_batch_sharing_one_opted_out_sampling_params_is_answered_at_once(tiny_server):
    """Every prompt of the batch is opted out; none is waited for (it used to wait the full
    write timeout for all but the first)."""
    srv = tiny_server
    before = {e["id"] for e in read_manifest(srv.export_dir)}
    r = requests.post(srv.url + "/generate", timeout=60, json={
        "input_ids": prompts(30, [5, 7, 9]), "sampling_params": {
            "max_new_tokens": 1, "custom_params": {"sglang_hs": {"export": False}}}})
    assert r.status_code == 200 and len(r.json()) == 3, r.text
    assert {e["id"] for e in read_manifest(srv.export_dir)} == before


def test_health_checks_are_answered_and_never_exported(tiny_server):
    srv = tiny_server
    before = [e["id"] for e in read_manifest(srv.export_dir)]
    r = requests.get(srv.url + "/health_generate", timeout=60)
    assert r.status_code == 200, r.text
    time.sleep(1)
    assert [e["id"] for e in read_manifest(srv.export_dir)] == before


_RIDS = st.one_of(
    st.none(), st.integers(), st.booleans(), st.text(max_size=12), st.lists(st.text(max_size=4), max_size=3),
    st.sampled_from(["../up", "a/b", ".hidden", "x.tmp", "", "a" * 201, "_x", "-x", "a\x00b", "fz-ok"]))
_IDS = st.one_of(
    st.lists(st.integers(0, 49151), min_size=1, max_size=40),
    st.lists(st.integers(-3, 10**7), min_size=1, max_size=4),
    st.just([]), st.text(max_size=8), st.none(),
    st.lists(st.lists(st.integers(0, 500), min_size=1, max_size=5), min_size=1, max_size=3))
_OPTIONS = st.one_of(
    st.none(), st.text(max_size=5), st.lists(st.integers(), max_size=2),
    st.fixed_dictionaries({}, optional={
        "export": st.one_of(st.booleans(), st.sampled_from(["false", "true", 0, 1, None])),
        "loss_mask": st.one_of(st.none(), st.text(max_size=4), st.lists(st.integers(-1, 2), max_size=42),
                               st.lists(st.sampled_from([0.0, 1.0, True]), max_size=4)),
        "metadata": st.one_of(st.none(), st.text(max_size=4), st.lists(st.integers(), max_size=2),
                              st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
                              st.just({"big": "x" * 20000})),
        "call_id": st.text(max_size=6),
        "unknown": st.integers()}))


@given(rid=_RIDS, ids=_IDS, options=_OPTIONS, custom_params_is_a_dict=st.booleans())
@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_hostile_request_shapes_get_a_clear_answer_and_the_server_keeps_serving(
        tiny_server, rid, ids, options, custom_params_is_a_dict):
    srv = tiny_server
    sp = {"max_new_tokens": 1, "custom_params": {"sglang_hs": options} if custom_params_is_a_dict else options}
    body = {"input_ids": ids, "sampling_params": sp}
    if rid is not None:
        body["rid"] = rid
    r = srv.generate(body, timeout=120)
    assert r.status_code < 500, (body, r.status_code, r.text[:500])
    assert requests.get(srv.url + "/health", timeout=30).status_code == 200
    if r.status_code == 200 and isinstance(rid, str) and isinstance(ids, list) and ids and isinstance(ids[0], int):
        info = r.json()["meta_info"].get("hidden_states_export")
        exporting = not (isinstance(options, dict) and options.get("export") is False)
        assert (info is not None) == exporting, r.json()["meta_info"]
        if info is not None:
            assert sample(srv.export_dir, rid)["token_ids"].tolist() == ids


def test_the_whole_directory_validates(tiny_server):
    rep = validate_export(tiny_server.export_dir)
    assert rep.ok, rep.errors
    assert rep.samples >= 45  # every test above adds samples


@pytest.fixture(scope="module")
def full_disk_server(tiny_path, tmp_path_factory):
    mnt = str(tmp_path_factory.mktemp("tmpfs"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mnt], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip()}); the full-disk test needs one")
    log = str(tmp_path_factory.mktemp("logs") / "server.log")
    out = os.path.join(mnt, "hs")
    args = ["--model-path", tiny_path, "--export-hidden-states-dir", out, "--chunked-prefill-size", "24",
            "--skip-server-warmup"]
    try:
        with LocalServer(args, log) as srv:
            yield srv
    finally:
        subprocess.run(["umount", "-l", mnt])


def test_second_chunk_size_matches_hf(full_disk_server):
    srv = full_disk_server
    for i, ids in enumerate(prompts(30, [23, 24, 25, 250])):  # up to 11 chunks of 24
        assert export(srv, f"c24-{i}", ids).status_code == 200
    assert_exact_vs_hf(srv.export_dir)


def fill(path):
    """Write zeros to `path` until the file system says it is full."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e


def assert_listed_once_and_valid(out_dir, expected):
    ids = [e["id"] for e in read_manifest(out_dir)]
    assert len(ids) == len(set(ids)), "a sample is listed twice"
    assert set(expected) <= set(ids), f"missing {set(expected) - set(ids)}"
    rep = validate_export(out_dir, expected_tokens=expected)
    assert rep.ok, rep.errors


def test_full_disk_fails_those_requests_the_server_keeps_serving_and_a_resend_completes(full_disk_server):
    srv = full_disk_server
    filler = os.path.join(os.path.dirname(srv.export_dir), "filler")
    fill(filler)
    batch = {f"full-{i}": ids for i, ids in enumerate(prompts(31, [200, 300, 400]))}
    try:
        codes = {rid: export(srv, rid, ids) for rid, ids in batch.items()}
        assert {r.status_code for r in codes.values()} == {507}, {k: r.text for k, r in codes.items()}
        assert "No space left" in codes["full-0"].text and "resend" in codes["full-0"].text
        assert requests.get(srv.url + "/health", timeout=30).status_code == 200
        # No partial or temporary files of the failed samples.
        assert not any(f.endswith(".tmp") for _, _, fs in os.walk(srv.export_dir) for f in fs)
        assert validate_export(srv.export_dir).ok
    finally:
        os.remove(filler)  # space freed: the same server exports the resends
    for rid, ids in batch.items():
        assert export(srv, rid, ids).status_code == 200
    assert_listed_once_and_valid(srv.export_dir, batch)


def test_a_directory_that_turns_read_only_fails_those_requests_until_it_is_writable_again(full_disk_server):
    srv = full_disk_server
    d = srv.export_dir
    # A read-only bind mount over the directory: new files fail with EROFS (as an NFS share
    # gone read-only would), while files the server already holds open stay as they are.
    subprocess.run(["mount", "--bind", d, d], check=True)
    batch = {f"ro-{i}": ids for i, ids in enumerate(prompts(32, [50, 90]))}
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", d], check=True)
        for rid, ids in batch.items():
            r = export(srv, rid, ids)
            assert r.status_code == 500 and "Read-only file system" in r.text, r.text
        assert requests.get(srv.url + "/health", timeout=30).status_code == 200
    finally:
        subprocess.run(["umount", d], check=True)
    for rid, ids in batch.items():
        assert export(srv, rid, ids).status_code == 200
    assert_listed_once_and_valid(d, batch)


SMOL_CONVS = 8


def smol_ids_and_masks(smollm2_path):
    """The demo's first chats with their assistant-turn masks, as `capture` makes them."""
    from transformers import AutoTokenizer

    from sglang_hs.tools.demo import demo_conversations
    from sglang_hs.tools.masks import chat_ids_and_mask

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    convs = [c["messages"] + [{"role": "assistant", "content": f"Answer {i}: " + "fine, " * (5 * i + 3)}]
             for i, c in enumerate(demo_conversations()[:SMOL_CONVS])]
    return [chat_ids_and_mask(tok, m) for m in convs]


def smol_export(smollm2_path, out, log, *flags):
    with LocalServer(["--model-path", smollm2_path, "--export-hidden-states-dir", out, "--skip-server-warmup",
                      "--chunked-prefill-size", "32", *flags], log) as srv:
        for i, (ids, mask) in enumerate(smol_ids_and_masks(smollm2_path)):
            r = export(srv, f"smol-{i}", ids, sp={"custom_params": {"sglang_hs": {"loss_mask": mask}}})
            assert r.status_code == 200, r.text
        if "loss" in flags:  # a request without a mask is refused, and the server goes on
            r = export(srv, "no-mask", ids)
            assert r.status_code == 400 and "--export-final-rows loss" in r.text, r.text
            assert requests.get(srv.url + "/health", timeout=30).status_code == 200
    return out


@pytest.fixture(scope="module")
def smol_bf16(smollm2_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("smol-bf16")
    return smol_export(smollm2_path, str(d / "out"), str(d / "server.log"))


def test_smollm2_bf16_rows_match_hf(smol_bf16):
    """The embedded default model, in its own dtype (bf16), with its chat template."""
    rep = assert_exact_vs_hf(smol_bf16)
    assert rep.samples == SMOL_CONVS and all(p.mean_cos >= 0.999 for p in rep.planes)


def test_smollm2_fp8_with_final_rows_on_loss_vs_the_bf16_export_of_the_same_requests(smol_bf16, smollm2_path,
                                                                                      tmp_path):
    """fp8 storage and final rows at loss positions: per plane, the dequantized rows against
    the bf16 export of the same requests (mean cosine >= 0.999; error reported), and against
    HF fp32 with the storage error reported apart; under half the bytes."""
    from sglang_hs.format import decode_sample

    out = smol_export(smollm2_path, str(tmp_path / "fp8"), str(tmp_path / "server.log"),
                      "--export-dtype", "fp8_e4m3", "--export-final-rows", "loss")
    assert validate_export(out).ok
    fp8, ref = ({e["id"]: os.path.join(d, e["path"]) for e in read_manifest(d)} for d in (out, smol_bf16))
    cos, err = {}, {}
    for rid in ref:
        a, b = decode_sample(load_sample(fp8[rid]), torch.float32), load_sample(ref[rid])
        assert torch.equal(a["final_positions"], torch.nonzero(b["loss_mask"]).flatten())
        pairs = {f"aux{j}": (a["aux_hidden_states"][:, j], b["aux_hidden_states"][:, j].float()) for j in range(3)}
        pairs["final"] = (a["final_hidden_states"], b["final_hidden_states"][a["final_positions"]].float())
        for k, (x, y) in pairs.items():
            cos.setdefault(k, []).append(torch.nn.functional.cosine_similarity(x, y, dim=-1))
            err.setdefault(k, []).append(float((x - y).norm() / y.norm()))
    summary = {k: (float(torch.cat(v).mean()), max(err[k])) for k, v in cos.items()}
    print("plane: mean cosine, worst relative error vs the bf16 export:", summary)
    assert all(m >= 0.999 for m, _ in summary.values()), summary
    size = {d: validate_export(d).bytes for d in (out, smol_bf16)}
    assert size[out] <= 0.5 * size[smol_bf16], size
    rep = verify_export(out, samples=None)
    print(rep.table())
    assert rep.ok and all(p.rel_err_storage > 0 for p in rep.planes), rep.table()
