"""Tensor parallelism on CPU (`--tp-size 2`, gloo; seam 10 in FORK_NOTES.md): the same
workload on a TP1 and a TP2 server gives the same samples, rows equal within bf16 tolerance
and equal to Hugging Face; one rank copies and writes; both ranks plan the same prefix caps.
The workload has chunked prefill, a shared prefix served from the cache, concurrency, and an
abort mid-prefill."""

import concurrent.futures as cf
import json
import os
import random
import re
import threading
import time

import pytest
import requests
import torch

from harness.fixtures import prompts
from sglang_hs.format import load_sample, read_manifest, validate_export
from sglang_hs.overlay.runtime import STATS_INTERVAL_ENV
from sglang_hs.tools.serve import LocalServer
from sglang_hs.tools.verify import hf_planes, load_hf, verify_export

pytestmark = pytest.mark.server
AUX = [1, 3, 7]
DECODE_RID = "tp-decode"


def prompt_set():
    lengths = [1, 63, 64, 65, 200, 700]
    ids = {f"tp-{i}": p for i, p in enumerate(prompts(5, lengths))}
    ids["tp-shared"] = ids["tp-5"][:300] + [21, 22, 23]
    return ids


def run(srv, ids):
    def send(rid):
        return rid, srv.generate({"rid": rid, "input_ids": ids[rid], "sampling_params": {"max_new_tokens": 2}})

    def send_decode():  # decode rows: tp-4's prompt and a greedy answer, decoded beside the others
        return DECODE_RID, srv.generate({"rid": DECODE_RID, "input_ids": ids["tp-4"], "sampling_params": {
            "max_new_tokens": 6, "temperature": 0, "ignore_eos": True,
            "custom_params": {"sglang_hs": {"decode_rows": True}}}})

    with cf.ThreadPoolExecutor(7) as ex:
        decoding = ex.submit(send_decode)
        for rid, r in [*ex.map(send, [r for r in ids if r != "tp-shared"]), decoding.result()]:
            assert r.status_code == 200, r.text
    rid, r = send("tp-shared")  # after tp-5 is in the prefix cache
    assert r.status_code == 200, r.text


def serve(path, tmp_path_factory, tp):
    out = str(tmp_path_factory.mktemp(f"export-tp{tp}"))
    log = str(tmp_path_factory.mktemp("logs") / f"tp{tp}.log")
    args = ["--model-path", path, "--export-hidden-states-dir", out, "--export-aux-layer-ids", *map(str, AUX),
            "--chunked-prefill-size", "64", "--skip-server-warmup", "--tp-size", str(tp), "--log-level", "info"]
    srv = LocalServer(args, log)
    srv.env[STATS_INTERVAL_ENV] = "0"  # a stats line per forward on every rank
    return srv


@pytest.fixture(scope="module")
def tp1_out(tiny_path, tmp_path_factory):
    with serve(tiny_path, tmp_path_factory, 1) as srv:
        run(srv, prompt_set())
    return srv.export_dir


@pytest.fixture(scope="module")
def tp2(tp1_out, tiny_path, tmp_path_factory):
    with serve(tiny_path, tmp_path_factory, 2) as srv:
        run(srv, prompt_set())
        yield srv


def samples(out):
    return {e["id"]: load_sample(os.path.join(out, e["path"])) for e in read_manifest(out)}


def planes(t):
    """[T, K+1, H] float32, the layout verify.hf_planes returns."""
    return torch.cat([t["aux_hidden_states"], t["final_hidden_states"][:, None]], dim=1).float()


@pytest.mark.core
def test_tp2_samples_equal_tp1_and_match_hf(tp1_out, tp2, tiny_path):
    a, b = samples(tp1_out), samples(tp2.export_dir)
    assert sorted(a) == sorted(b) == sorted([*prompt_set(), DECODE_RID])
    for t in (a[DECODE_RID], b[DECODE_RID]):  # prompt and answer; one row fewer than tokens
        assert t["token_ids"][:200].tolist() == prompt_set()["tp-4"] and len(t["token_ids"]) == 206
        assert t["aux_hidden_states"].shape[0] == t["final_hidden_states"].shape[0] == 205
    if not torch.equal(a[DECODE_RID]["token_ids"], b[DECODE_RID]["token_ids"]):
        del a[DECODE_RID]  # a near tie of a random model's logits went the other way: nothing to pair
    # "Within bf16 tolerance": the all-reduce sums the two halves in another order, so TP2
    # may differ from TP1 by rounding, measured against the rounding of HF's own bf16 forward
    # (vs its fp32 forward) on the same tokens; at most twice that, as verify allows vs HF.
    fp32, bf16 = load_hf(tiny_path, torch.float32), load_hf(tiny_path, torch.bfloat16)
    diff = hf_err = 0.0
    for rid in a:
        assert torch.equal(a[rid]["token_ids"], b[rid]["token_ids"])
        x, y = planes(a[rid]), planes(b[rid])
        ref = hf_planes(fp32, a[rid]["token_ids"], AUX)[: x.shape[0]]
        diff += float((x - y).pow(2).sum())
        hf_err += float((hf_planes(bf16, a[rid]["token_ids"], AUX)[: x.shape[0]] - ref).pow(2).sum())
        cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
        assert float(cos.min()) > 0.999, f"{rid}: a TP2 row points elsewhere than TP1's (cosine {float(cos.min())})"
    assert diff ** 0.5 <= 2 * hf_err ** 0.5, f"TP2 - TP1 {diff ** 0.5:.3e} vs HF bf16 - fp32 {hf_err ** 0.5:.3e}"
    assert json.load(open(os.path.join(tp2.export_dir, "export.json")))["tp_size"] == 2
    for out in (tp1_out, tp2.export_dir):  # Llama at the lowest and highest ids, on one rank and on two
        rep = validate_export(out, expected_tokens=prompt_set())
        assert rep.ok, rep.errors
        v = verify_export(out, samples=None)
        print(v.table())
        assert v.ok, v.table()


def test_an_abort_mid_prefill_writes_nothing_and_both_ranks_go_on(tp2):
    srv, rng = tp2, random.Random(9)
    aborted = []
    for attempt in range(4):
        rid, res = f"tp-abort-{attempt}", {}
        ids = [rng.randrange(3, 49152) for _ in range(3000)]
        th = threading.Thread(target=lambda: res.setdefault("r", srv.generate(
            {"rid": rid, "input_ids": ids, "sampling_params": {"max_new_tokens": 1}})))
        th.start()
        time.sleep(1.0 + 0.5 * attempt)
        requests.post(srv.url + "/abort_request", json={"rid": rid}, timeout=30)
        th.join(300)
        r = res["r"]
        if r.status_code != 200 or r.json()["meta_info"]["finish_reason"].get("type") == "abort":
            aborted.append(rid)
            assert rid not in {e["id"] for e in read_manifest(srv.export_dir)}
    assert aborted, "no request was aborted mid-prefill; the test did not exercise anything"
    r = srv.generate({"rid": "tp-after-abort", "input_ids": list(range(5, 205)), "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200, r.text


def last_stats(srv):
    """The last stats line of each rank, after one more forward (an opted-out request)."""
    r = srv.generate({"input_ids": [7, 8, 9], "sampling_params": {
        "max_new_tokens": 1, "custom_params": {"sglang_hs": {"export": False}}}})
    assert r.status_code == 200, r.text
    time.sleep(1)
    stats = {}
    for line in open(srv.log_path):
        m = re.search(r" (TP\d)\] sglang-hs stats: (\{.*\})", line)
        if m:
            stats[m.group(1)] = json.loads(m.group(2))
    return stats, open(srv.log_path).read()


def test_exactly_one_rank_copies_and_writes(tp2):
    stats, log = last_stats(tp2)
    assert sorted(stats) == ["TP0", "TP1"]
    writer_lines = re.findall(r" (TP\d)\] sglang-hs: aux capture on LlamaForCausalLM .* writer rank: (True|False)", log)
    assert sorted(writer_lines) == [("TP0", "True"), ("TP1", "False")]
    assert stats["TP1"]["copies"] == 0 and "writer" not in stats["TP1"]
    assert stats["TP0"]["copies"] > 0 and stats["TP0"]["writer"]["samples"] == len(read_manifest(tp2.export_dir))


def test_every_rank_plans_the_same_prefix_caps(tp2):
    stats, _ = last_stats(tp2)
    assert stats["TP0"]["prefix_caps"] > len(prompt_set())  # chunked requests ask once per chunk
    assert stats["TP0"]["prefix_caps"] == stats["TP1"]["prefix_caps"]
    assert stats["TP0"]["prefix_caps_digest"] == stats["TP1"]["prefix_caps_digest"]
