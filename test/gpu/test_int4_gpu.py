"""Kimi-K2.5 INT4's layout on a CUDA GPU: a miniature DeepSeek V3 (MLA at the released head
geometry, MoE with a shared expert) whose routed experts are compressed-tensors W4A16
pack-quantized, group 32, symmetric, so SGLang serves them with its Marlin WNA16 MoE method.
Exported rows match a Hugging Face forward of the dequantized weights (bf16 tolerance, via
`verify`), graphs on vs off agree, under chunked prefill and the prefix cache.
Needs SGLANG_HS_TOKENIZER on the GPU host (see test_families_gpu.py)."""

import json
import os

import pytest
import torch

from harness import models
from harness.fixtures import prompts
from sglang_hs.format import load_sample, read_manifest, validate_export
from sglang_hs.tools.serve import LocalServer
from sglang_hs.tools.verify import verify_export

MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
# Marlin's tiles want the MoE GEMMs' sizes in multiples of 128 (and the group size).
GEOMETRY = dict(MLA, hidden_size=1024, intermediate_size=512, moe_intermediate_size=256, n_routed_experts=8)
FLAGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--skip-server-warmup",
         "--mem-fraction-static", "0.3", "--chunked-prefill-size", "64", "--export-aux-layer-ids", "1", "4", "7",
         "--log-level", "info"]
# Graphs for the sizes this test runs (one request at a time, prefill chunks of <= 64 tokens):
# every forward still replays a graph, and start-up skips capturing hundreds of unused sizes.
GRAPH_SIZES = ["--cuda-graph-max-bs-decode", "8", "--cuda-graph-max-bs-prefill", "64"]
RESULTS = os.environ.get("SGLANG_HS_GPU_RESULTS")


def checkpoints(work, tokenizer):
    src = models.tiny("deepseek_v3", os.path.join(work, "tiny-deepseek-v3-int4-src"), tokenizer, **GEOMETRY)
    return models.int4_experts(src, os.path.join(work, "tiny-deepseek-v3-int4"))


def test_the_int4_checkpoint_unpacks_to_its_dequantized_twin(tmp_path, smollm2_path):
    """CPU: compressed-tensors' own unpacker gives back the int4 values whose q * scale the
    reference checkpoint holds, so the reference is what the INT4 weights mean."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file

    small = dict(GEOMETRY, hidden_size=256, intermediate_size=256, moe_intermediate_size=128, n_routed_experts=2)
    src = models.tiny("deepseek_v3", str(tmp_path / "src"), smollm2_path, num_layers=2, **small)
    q_dir, deq_dir = models.int4_experts(src, str(tmp_path / "int4"))
    q, deq = load_file(os.path.join(q_dir, "model.safetensors")), load_file(os.path.join(deq_dir, "model.safetensors"))
    experts = [k for k in q if k.endswith(".weight_packed")]
    assert experts and json.load(open(os.path.join(q_dir, "config.json")))["quantization_config"]["format"] == \
        "pack-quantized"
    for k in experts:
        stem = k[: -len(".weight_packed")]
        shape = torch.Size(q[f"{stem}.weight_shape"].tolist())
        ints = unpack_from_int32(q[k], 4, shape).float()
        assert ints.min() >= -8 and ints.max() <= 7
        scale = q[f"{stem}.weight_scale"].float().repeat_interleave(models.INT4_GROUP, dim=1)
        assert torch.equal((ints * scale).to(torch.bfloat16), deq[f"{stem}.weight"])
        assert f"{stem}.weight" not in q


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_int4_moe_mla_export_matches_hf_of_the_dequantized_weights_graphs_on_and_off(tmp_path):
    tok = os.environ["SGLANG_HS_TOKENIZER"]
    work = os.environ.get("SGLANG_HS_LOGS", str(tmp_path))
    q_dir, deq_dir = checkpoints(work, tok)
    base, = prompts(50, [300])
    ids = {f"int4-{i}": p for i, p in enumerate(prompts(51, [1, 63, 64, 65, 700]))}
    ids |= {"int4-twice-a": base, "int4-twice-b": base, "int4-shared": base[:200] + prompts(52, [90])[0]}
    rows, results = {}, {}
    for graphs in ("off", "on"):  # off first: it starts sooner (no graph capture)
        out = os.path.join(work, f"int4-export-graphs-{graphs}")
        log = os.path.join(work, f"int4-{graphs}.log")
        args = ["--model-path", q_dir, "--export-hidden-states-dir", out, *FLAGS,
                *(["--disable-cuda-graph"] if graphs == "off" else GRAPH_SIZES)]
        with LocalServer(args, log, cpu=False) as srv:
            for rid, p in ids.items():
                r = srv.generate({"rid": rid, "input_ids": p, "sampling_params": {"max_new_tokens": 2}})
                assert r.status_code == 200, r.text
        assert "CompressedTensorsWNA16MarlinMoEMethod" in open(log, errors="replace").read(), \
            "the INT4 experts were not served by SGLang's Marlin WNA16 MoE method"
        rep = validate_export(out, expected_tokens=ids)
        assert rep.ok, rep.errors
        v = verify_export(out, model_path=deq_dir, samples=None, device="cuda")
        print(graphs, "\n" + v.table())
        rows[graphs] = {e["id"]: load_sample(os.path.join(out, e["path"])) for e in read_manifest(out)}
        results[f"graphs_{graphs}"] = v.to_dict()
        save(results)
        assert v.ok, v.table()
    # Layer 0 is dense, so the rows up to it (aux[1]) repeat bit for bit. From the first MoE
    # layer on they did not on the H200 (same prompt twice, graphs on); likely because SGLang's
    # Marlin MoE GEMM reduces with atomic adds on SM >= 9 (fused_marlin_moe's use_atomic_add),
    # and a random bf16 MoE turns last bits into other routing choices. Such differences must
    # stay below the error HF's own bf16 forward has on that plane; misattributed rows would not.
    on, off = rows["on"], rows["off"]
    bf16_err = {p["name"]: p["rel_err_hf_bf16"] for p in results["graphs_off"]["planes"]}
    names = [f"aux[{k}]" for k in json.load(open(os.path.join(out, "export.json")))["aux_layer_ids"]] + ["final"]
    a, b = on["int4-twice-a"], on["int4-twice-b"]
    assert torch.equal(a["aux_hidden_states"][:, 0], b["aux_hidden_states"][:, 0])
    diffs = {"same_prompt_twice": {n: plane_diff(a, b, j) for j, n in enumerate(names)},
             "graphs_on_vs_off": {n: max(plane_diff(on[r], off[r], j) for r in ids) for j, n in enumerate(names)}}
    results["rel_diff_vs_hf_bf16_err"] = {"hf_bf16_err": bf16_err, **diffs}
    save(results)
    for what, d in diffs.items():
        for n, x in d.items():
            assert x <= bf16_err[n], f"{what}: {n} differs by {x:.3e}, more than HF bf16's own error {bf16_err[n]:.3e}"


def plane_diff(x: dict, y: dict, j: int) -> float:
    """Relative difference of plane j (aux planes, then final) between two samples' rows."""
    def plane(t):
        return (t["aux_hidden_states"][:, j] if j < t["aux_hidden_states"].shape[1] else t["final_hidden_states"]).float()
    return float((plane(x) - plane(y)).norm() / plane(y).norm())


def save(results):
    if RESULTS:
        data = json.load(open(RESULTS)) if os.path.exists(RESULTS) else {}
        data["int4"] = results
        json.dump(data, open(RESULTS, "w"), indent=2)
