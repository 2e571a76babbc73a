"""Decode rows on a real SGLang server on CPU: a request that asks for them gets one sample of
prompt and answer, its generated tokens' rows taken as they were decoded. References come
from Hugging Face transformers (sglang_hs.tools.verify), independent of SGLang; the prefill
export of the same final sequence, from the same server, is the other side of the
runtime's own prefill-vs-decode difference."""

import concurrent.futures as cf
import os
import threading
import time

import pytest
import requests
import torch

from harness.fixtures import prompts
from sglang_hs.format import load_sample, read_export_json, read_manifest, sample_metadata, validate_export
from sglang_hs.tools.serve import LocalServer
from sglang_hs.tools.verify import hf_planes, load_hf, verify_export

pytestmark = pytest.mark.server

DECODE = {"sglang_hs": {"decode_rows": True}}


@pytest.fixture(scope="module")
def decode_server(tiny_path, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("export-decode"))
    log = str(tmp_path_factory.mktemp("logs") / "server.log")
    # Several decode forwards per scheduling round, chunked prefill and the prefix cache on.
    args = ["--model-path", tiny_path, "--export-hidden-states-dir", out, "--chunked-prefill-size", "16",
            "--num-continuous-decode-steps", "3", "--skip-server-warmup"]
    with LocalServer(args, log) as srv:
        yield srv


def generate(srv, rid, ids, new, custom=None, **sp):
    r = srv.generate({"rid": rid, "input_ids": ids, "sampling_params": {
        "max_new_tokens": new, "temperature": 0, "ignore_eos": True, "custom_params": custom or {}, **sp}})
    assert r.status_code == 200, r.text
    return r.json()


def sample(srv, rid):
    entry = {e["id"]: e for e in read_manifest(srv.export_dir)}[rid]
    path = os.path.join(srv.export_dir, entry["path"])
    return load_sample(path), sample_metadata(path), entry


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.core
def test_decode_rows_hold_prompt_and_answer_against_hf_and_the_prefill_export(decode_server, tiny_path):
    srv = decode_server
    ids, = prompts(40, [37])  # three chunks of 16, then 12 decode steps
    plain = generate(srv, "plain", ids, 12, {"sglang_hs": {"export": False}})
    out = generate(srv, "dec", ids, 12, DECODE)
    assert out["output_ids"] == plain["output_ids"], "export changed the greedy tokens"
    tokens = ids + out["output_ids"]
    assert out["meta_info"]["hidden_states_export"]["num_tokens"] == len(tokens)
    t, meta, entry = sample(srv, "dec")
    assert t["token_ids"].tolist() == tokens and entry["num_tokens"] == len(tokens)
    assert meta["prompt_tokens"] == str(len(ids))
    assert t["aux_hidden_states"].shape[0] == t["final_hidden_states"].shape[0] == len(tokens) - 1

    # The same final sequence exported by prefill: every row computed in one extend.
    generate(srv, "pre", tokens, 1)
    p, _, _ = sample(srv, "pre")
    assert p["token_ids"].tolist() == tokens and p["aux_hidden_states"].shape[0] == len(tokens)

    # Against HF: fp32 as the reference, HF's own bf16 forward as the error a bf16 runtime may have.
    info = read_export_json(srv.export_dir)
    ref = hf_planes(load_hf(tiny_path, torch.float32, "cpu"), torch.tensor(tokens), info["aux_layer_ids"])
    hf16 = hf_planes(load_hf(tiny_path, torch.bfloat16, "cpu"), torch.tensor(tokens), info["aux_layer_ids"])
    n = len(tokens) - 1
    gen = slice(len(ids), n)  # the decoded rows
    report = {}
    for j, name in enumerate([f"aux[{k}]" for k in info["aux_layer_ids"]] + ["final"]):
        d = t["final_hidden_states"] if name == "final" else t["aux_hidden_states"][:, j]
        q = p["final_hidden_states"][:n] if name == "final" else p["aux_hidden_states"][:n, j]
        report[name] = {"decode_vs_hf": rel(d[gen], ref[gen, j]), "prefill_vs_hf": rel(q[gen], ref[gen, j]),
                        "decode_vs_prefill": rel(d[gen], q[gen]), "hf_bf16_vs_hf": rel(hf16[gen, j], ref[gen, j])}
        # The prompt's rows come from the same chunked prefill in both requests.
        assert rel(d[: len(ids)], q[: len(ids)]) <= report[name]["hf_bf16_vs_hf"], name
    print("relative error of the generated positions' rows:", report)
    for name, r in report.items():
        bound = 2 * r["hf_bf16_vs_hf"] + 1e-6  # verify's own allowance: within twice HF bf16's error
        assert r["decode_vs_hf"] <= bound and r["prefill_vs_hf"] <= bound, (name, r)
        assert r["decode_vs_prefill"] <= 2 * bound, (name, r)
    rep = validate_export(srv.export_dir, expected_tokens={"dec": tokens, "pre": tokens})
    assert rep.ok, rep.errors
    # verify judges the generated positions apart, and finds "pre" as the prefill twin of "dec":
    # the decode-vs-prefill difference it measures is the one computed here.
    v = verify_export(srv.export_dir, samples=None)
    print(v.table())
    decode = {p.name.split(" ")[0]: p for p in v.planes if p.decode}
    assert sorted(decode) == sorted(report), v.table()
    for j, name in enumerate(report):
        d = t["final_hidden_states"] if name == "final" else t["aux_hidden_states"][:, j]
        q = p["final_hidden_states"][:n] if name == "final" else p["aux_hidden_states"][:n, j]
        gap = float((d[gen].float() - q[gen].float()).norm() / ref[gen, j].norm())
        assert decode[name].rel_gap_prefill == pytest.approx(gap, rel=1e-3, abs=1e-7), (name, v.table())
    assert v.ok, v.table()


def test_concurrent_decode_rows_with_shared_prefixes_and_prompt_only_neighbours(decode_server):
    """Mixed batches: decode-row and prompt-only requests decode side by side, some sharing a
    prompt (the prefix cache), with different answer lengths; every sample is exact vs HF."""
    srv = decode_server
    base, = prompts(41, [30])
    ps = [base + extra for extra in prompts(42, [1 + 7 * i for i in range(12)])]
    new = [1 + (5 * i) % 17 for i in range(12)]

    def send(i):
        return i, generate(srv, f"mix-{i}", ps[i], new[i], DECODE if i % 3 else None)

    with cf.ThreadPoolExecutor(12) as ex:
        outs = dict(ex.map(send, range(12)))
    expected = {f"mix-{i}": ps[i] + (outs[i]["output_ids"] if i % 3 else []) for i in range(12)}
    assert all(len(outs[i]["output_ids"]) == new[i] for i in range(12))
    rep = validate_export(srv.export_dir, expected_tokens=expected)
    assert rep.ok, rep.errors
    v = verify_export(srv.export_dir, samples=None)
    print(v.table())
    assert v.ok, v.table()


def test_a_request_aborted_mid_decode_writes_nothing_and_the_server_goes_on(decode_server):
    srv = decode_server
    ids, = prompts(43, [20])
    res = {}
    th = threading.Thread(target=lambda: res.setdefault("r", srv.generate({
        "rid": "dec-abort", "input_ids": ids, "sampling_params": {
            "max_new_tokens": 4000, "temperature": 0, "ignore_eos": True, "custom_params": DECODE}})))
    th.start()
    time.sleep(2.0)
    requests.post(srv.url + "/abort_request", json={"rid": "dec-abort"}, timeout=30)
    th.join(120)
    r = res["r"]  # SGLang answers an aborted request with its abort (the status varies by release)
    assert r.status_code != 200 or r.json()["meta_info"]["finish_reason"]["type"] == "abort", r.text
    assert "dec-abort" not in {e["id"] for e in read_manifest(srv.export_dir)}
    assert not any("dec-abort" in f for _, _, fs in os.walk(srv.export_dir) for f in fs)
    out = generate(srv, "dec-after-abort", ids, 3, DECODE)
    t, _, _ = sample(srv, "dec-after-abort")
    assert t["token_ids"].tolist() == ids + out["output_ids"]


def test_max_new_tokens_1_holds_the_prompt_rows_and_the_one_token(decode_server):
    srv = decode_server
    ids, = prompts(44, [9])
    out = generate(srv, "dec-one", ids, 1, DECODE)
    t, meta, _ = sample(srv, "dec-one")
    assert t["token_ids"].tolist() == ids + out["output_ids"] and t["aux_hidden_states"].shape[0] == len(ids)
    assert meta["prompt_tokens"] == "9"


def test_decode_row_samples_reach_speculators_with_a_row_per_token(decode_server, trainers, tmp_path):
    """speculators' own ArrowDataset over the converted export: a decode-row sample has its
    prompt and answer as input_ids and a row per token, the last one zero (no token follows it)."""
    from speculators.train.data import ArrowDataset

    from sglang_hs.tools.convert import ExportDataset, to_speculators

    srv = decode_server
    generate(srv, "dec-convert", prompts(45, [11])[0], 4, DECODE)
    dest = str(tmp_path / "spec")
    to_speculators(srv.export_dir, dest)
    order = [e["id"] for e in ExportDataset(srv.export_dir).entries]
    item = ArrowDataset(max_len=4096, datapath=dest, on_missing="raise")[order.index("dec-convert")]
    t, _, _ = sample(srv, "dec-convert")
    assert item["input_ids"].tolist() == t["token_ids"].tolist() and len(t["token_ids"]) == 15
    assert item["hidden_states"].shape[0] == 15
    assert torch.equal(item["hidden_states"][:14], t["aux_hidden_states"].reshape(14, -1))
    assert not item["hidden_states"][14].any()
