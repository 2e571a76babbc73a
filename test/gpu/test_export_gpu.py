"""On a CUDA GPU, with CUDA graphs on (SGLang's default breakable prefill graph and decode
graphs) and off: exported rows agree between the two and match an HF transformers forward on
the same GPU within bf16 tolerance, under chunked prefill, prefix cache and 64 concurrent
requests. Every server runs our hooks under the sync check (SGLANG_HS_SYNC_CHECK=1). Run:
pytest -m gpu test/gpu (see benchmark/results/gpu_tests_h200.txt)."""

import concurrent.futures as cf
import json
import os
import random

import pytest
import torch

from harness.fixtures import prompts, record_gpu_result as record
from sglang_hs.format import load_sample, read_manifest, validate_export
from sglang_hs.tools.serve import LocalServer
from sglang_hs.tools.verify import verify_export

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU_FLAGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--skip-tokenizer-init",
             "--skip-server-warmup", "--mem-fraction-static", "0.3", "--chunked-prefill-size", "512"]


def mini_llama_dir(d):
    """A random Llama (hidden 1024, 8 layers) saved by HF, so HF and SGLang load the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, torch_dtype=torch.bfloat16, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def mini_llama(tmp_path_factory):
    return mini_llama_dir(str(tmp_path_factory.mktemp("mini-llama")))


def gpu_server(mini_llama, tmp_path_factory, name, *flags):
    logs = tmp_path_factory.mktemp("logs")
    out = str(tmp_path_factory.mktemp(name))
    args = ["--model-path", mini_llama, *GPU_FLAGS, "--export-aux-layer-ids", "1", "4", "7",
            "--export-hidden-states-dir", out, *flags]
    srv = LocalServer(args, str(logs / f"{name}.log"), cpu=False)
    srv.env["SGLANG_HS_SYNC_CHECK"] = "1"  # a host sync in our hooks fails the server's forward
    with srv:
        yield srv
    os.system(f"cp {srv.log_path} {os.environ.get('SGLANG_HS_LOGS', '/tmp')}/gpu-test-{name}.log")


@pytest.fixture(scope="module")
def graphs_on(mini_llama, tmp_path_factory):
    yield from gpu_server(mini_llama, tmp_path_factory, "graphs-on")


@pytest.fixture(scope="module")
def graphs_off(mini_llama, tmp_path_factory):
    yield from gpu_server(mini_llama, tmp_path_factory, "graphs-off", "--disable-cuda-graph")


@pytest.fixture(scope="module")
def servers(graphs_on, graphs_off):
    return graphs_on, graphs_off


def send(srv, rid, ids, **sp):
    r = srv.generate({"rid": rid, "input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0, **sp}})
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def rows(out, rid):
    e = {x["id"]: x for x in read_manifest(out)}[rid]
    t = load_sample(os.path.join(out, e["path"]))
    return t, torch.cat([t["aux_hidden_states"], t["final_hidden_states"][:, None]], 1).float()


def test_graphs_on_and_off_agree_and_match_hf(servers):
    on, off = servers
    lengths = [1, 7, 100, 511, 512, 513, 1500, 3000]  # up to 6 chunks of 512
    worst = 0.0
    for i, ids in enumerate(prompts(0, lengths, vocab=32000)):
        for s in (on, off):
            send(s, f"seq-{i}", ids)
        (ta, a), (tb, b) = rows(on.export_dir, f"seq-{i}"), rows(off.export_dir, f"seq-{i}")
        assert ta["token_ids"].tolist() == ids == tb["token_ids"].tolist()
        rel = float((a - b).norm() / b.norm())
        worst = max(worst, rel)
    record("graphs_on_vs_off_max_rel_diff", worst)
    assert worst < 2e-2, worst
    # export.json records the numerics as each scheduler saw them: the GPU and whether graphs ran.
    for s, graphs_off in ((on, False), (off, True)):
        numerics = json.load(open(os.path.join(s.export_dir, "export.json")))["numerics"]
        record(f"numerics_{'graphs_off' if graphs_off else 'graphs_on'}", numerics)
        assert numerics["gpu"]["capability"] == list(torch.cuda.get_device_capability())
        assert numerics["gpu"]["name"] == torch.cuda.get_device_name()
        assert numerics["disable_cuda_graph"] is graphs_off and numerics["attention_backend"] == "triton"
    for name, s in (("graphs_on", on), ("graphs_off", off)):
        rep = verify_export(s.export_dir, samples=None, device="cuda")
        print(name, "\n" + rep.table())
        record(f"hf_{name}", rep.to_dict())
        assert rep.ok, rep.table()


def test_prefix_cache_and_64_concurrent_mixed_lengths(graphs_on):
    on = graphs_on
    base, = prompts(1, [1200], vocab=32000)
    for rid in ("twice-a", "twice-b"):
        assert send(on, rid, base)["cached_tokens"] == 0
    for j, tail in enumerate(prompts(2, [5, 300], vocab=32000)):
        send(on, f"shared-{j}", base[:700] + tail)
    assert torch.equal(rows(on.export_dir, "twice-a")[1], rows(on.export_dir, "twice-b")[1])
    lengths = [random.Random(i).randrange(8, 4000) for i in range(64)]
    ps = prompts(3, lengths, vocab=32000)
    with cf.ThreadPoolExecutor(64) as ex:
        list(ex.map(lambda i: send(on, f"conc-{i}", ps[i], max_new_tokens=1 + i % 8), range(64)))
    rep = validate_export(on.export_dir, expected_tokens={f"conc-{i}": ps[i] for i in range(64)})
    assert rep.ok, rep.errors
    ver = verify_export(on.export_dir, samples=None, device="cuda")
    print(ver.table())
    record("hf_graphs_on_after_concurrency", ver.to_dict())
    assert ver.ok, ver.table()
    # The log shows this rank copying asynchronously (no per-request .cpu()): copies counted.
    stats = [ln for ln in open(on.log_path) if "sglang-hs stats:" in ln]
    record("server_stats_tail", stats[-1] if stats else None)


@pytest.fixture(scope="module")
def fp8_server(mini_llama, tmp_path_factory):
    """fp8 storage (quantized on the GPU before the copy) with final rows at loss positions only."""
    yield from gpu_server(mini_llama, tmp_path_factory, "fp8-loss", "--export-dtype", "fp8_e4m3",
                          "--export-final-rows", "loss")


def test_fp8_rows_quantized_on_the_gpu_match_the_bf16_export_of_the_same_requests(graphs_on, fp8_server):
    """The same requests on the bf16 server (graphs on) and the fp8 + loss-rows server: dequantized
    rows keep mean cosine >= 0.999 per plane, final rows exactly at the loss positions, and the
    file is about half the size or less."""
    from sglang_hs.format import decode_sample

    on = graphs_on
    lengths = [1, 9, 513, 2000]
    per_plane = {}
    sizes = {"bf16": 0, "fp8": 0}
    for i, ids in enumerate(prompts(40, lengths, vocab=32000)):
        mask = [int(j >= len(ids) // 2) for j in range(len(ids))]
        send(on, f"fp8ref-{i}", ids)
        r = fp8_server.generate({"rid": f"fp8ref-{i}", "input_ids": ids, "sampling_params": {
            "max_new_tokens": 2, "temperature": 0, "custom_params": {"sglang_hs": {"loss_mask": mask}}}})
        assert r.status_code == 200, r.text
        _, ref = rows(on.export_dir, f"fp8ref-{i}")
        e = {x["id"]: x for x in read_manifest(fp8_server.export_dir)}[f"fp8ref-{i}"]
        raw = load_sample(os.path.join(fp8_server.export_dir, e["path"]))
        assert raw["aux_hidden_states"].dtype == torch.float8_e4m3fn
        t = decode_sample(raw, torch.float32)
        pos = torch.nonzero(torch.tensor(mask)).flatten()
        assert torch.equal(t["final_positions"], pos)
        got = {f"aux{j}": (t["aux_hidden_states"][:, j], ref[:, j]) for j in range(3)}
        got["final"] = (t["final_hidden_states"], ref[pos, 3])
        for name, (a, b) in got.items():
            if a.shape[0]:
                per_plane.setdefault(name, []).append(torch.nn.functional.cosine_similarity(a, b, dim=-1))
        sizes["fp8"] += os.path.getsize(os.path.join(fp8_server.export_dir, e["path"]))
        e_on = {x["id"]: x for x in read_manifest(on.export_dir)}[f"fp8ref-{i}"]
        sizes["bf16"] += os.path.getsize(os.path.join(on.export_dir, e_on["path"]))
    cos = {k: {"mean": float(torch.cat(v).mean()), "min": float(torch.cat(v).min())} for k, v in per_plane.items()}
    record("fp8_loss_rows_vs_bf16_cosine", cos)
    record("fp8_loss_rows_bytes_vs_bf16", sizes["fp8"] / sizes["bf16"])
    assert all(c["mean"] >= 0.999 for c in cos.values()), cos
    assert sizes["fp8"] / sizes["bf16"] <= 0.5, sizes
    assert validate_export(fp8_server.export_dir).ok
    ver = verify_export(fp8_server.export_dir, samples=None, device="cuda")
    print(ver.table())
    record("hf_fp8_loss_rows", ver.to_dict())
    assert ver.ok, ver.table()


def decode_rows(srv, rid, ids, new, export=True):
    r = srv.generate({"rid": rid, "input_ids": ids, "sampling_params": {
        "max_new_tokens": new, "temperature": 0, "ignore_eos": True,
        "custom_params": {"sglang_hs": {"decode_rows": True} if export else {"export": False}}}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_decode_rows_under_decode_graphs(servers):
    """Decode rows with decode graphs on (rows from the graphs' static buffers) and off
    (eager): the same tokens as without export; one prompt sent twice gives bitwise the same
    rows within each mode; the decoded rows agree with the prefill export of the same final
    sequence and with HF; 32 concurrent requests of mixed lengths (several graph buckets) each
    get their own rows."""
    on, off = servers
    ids, = prompts(5, [300], vocab=32000)
    result = {}
    for name, s in (("graphs_on", on), ("graphs_off", off)):
        plain = decode_rows(s, f"dec-plain-{name}", ids, 64, export=False)
        outs = [decode_rows(s, f"dec-{k}", ids, 64) for k in "ab"]
        assert outs[0] == outs[1] == plain, f"{name}: export changed the greedy tokens"
        (ta, a), (tb, b) = rows(s.export_dir, "dec-a"), rows(s.export_dir, "dec-b")
        assert ta["token_ids"].tolist() == ids + plain and a.shape[0] == len(ids) + 63
        same = torch.equal(a, b)
        send(s, "dec-prefill", ids + plain, max_new_tokens=1)
        _, p = rows(s.export_dir, "dec-prefill")
        gen = slice(len(ids), a.shape[0])
        result[name] = {"sent_twice_bitwise_equal": same,
                        "decode_vs_prefill_rel": float((a[gen] - p[gen]).norm() / p[gen].norm()),
                        "prompt_rows_vs_prefill_rel": float((a[:len(ids)] - p[:len(ids)]).norm() / p[:len(ids)].norm())}
        assert same, f"{name}: one prompt sent twice gave other decode rows"
    ps = prompts(6, [random.Random(50 + i).randrange(8, 1500) for i in range(32)], vocab=32000)
    with cf.ThreadPoolExecutor(32) as ex:
        outs = list(ex.map(lambda i: decode_rows(on, f"dec-conc-{i}", ps[i], 1 + (7 * i) % 60), range(32)))
    rep = validate_export(on.export_dir, expected_tokens={f"dec-conc-{i}": ps[i] + outs[i] for i in range(32)})
    assert rep.ok, rep.errors
    graph_lines = [ln for ln in open(on.log_path) if "Decode batch" in ln]
    result["graphs_on_decode_batches_with_cuda_graph"] = sum("graph: True" in ln for ln in graph_lines)
    result["graphs_on_decode_batches"] = len(graph_lines)
    for name, s in (("graphs_on", on), ("graphs_off", off)):
        ver = verify_export(s.export_dir, samples=None, device="cuda")
        print(name, "\n" + ver.table())
        result[f"hf_{name}"] = ver.to_dict()
        assert ver.ok, ver.table()
    record("decode_rows", result)
    assert result["graphs_on_decode_batches_with_cuda_graph"] > 0, "no decode batch ran as a CUDA graph"
    for name in ("graphs_on", "graphs_off"):
        assert result[name]["decode_vs_prefill_rel"] < 2e-2, result
