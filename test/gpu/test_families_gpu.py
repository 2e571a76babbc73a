"""Model families on a CUDA GPU, CUDA graphs on, triton attention: the flagship's class
(Kimi-K2.5, MLA + MoE), a flag-capturing MoE (Qwen3-MoE), and the families that cannot run
on CPU (GPT-OSS: attention sinks; Qwen3-Next: gated delta-net) export HF layers at the lowest
and highest ids, compared with HF transformers on the same GPU by `verify`.
Needs SGLANG_HS_TOKENIZER: a folder with the SmolLM2 tokenizer (the GPU host has no hub)."""

import json
import os

import pytest
import torch

from harness import models
from harness.fixtures import prompts
from sglang_hs.format import validate_export
from sglang_hs.tools.serve import LocalServer
from sglang_hs.tools.verify import verify_export

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU_FLAGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--skip-server-warmup",
             "--mem-fraction-static", "0.3", "--chunked-prefill-size", "64"]
AUX = [1, 3, 7]
FAMILIES = {"kimi_k25": "KimiK25ForConditionalGeneration", "qwen3_moe": "Qwen3MoeForCausalLM",
            "gpt_oss": "GptOssForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}
RESULTS = os.environ.get("SGLANG_HS_GPU_RESULTS")


def test_every_class_tested_on_the_h200_is_exported_here():
    from sglang_hs.overlay.aux_layers import TESTED

    assert {c for c, where in TESTED.items() if "H200" in where} == set(FAMILIES.values())

# SGLang's GPU kernels do not take the CPU tests' 16-wide heads: its fused rope + KV-cache
# write wants head_dim 64 or more, and its triton MLA kernels the released MLA geometry.
MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
GEOMETRY = {"kimi_k25": MLA, "qwen3_moe": dict(head_dim=64), "gpt_oss": dict(head_dim=64),
            "qwen3_next": dict(head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_on_gpu_exports_hf_layers(family, tmp_path):
    tok = os.environ["SGLANG_HS_TOKENIZER"]
    work = os.environ.get("SGLANG_HS_LOGS", str(tmp_path))
    path = os.path.join(work, f"tiny-{family}")
    path = (models.tiny_kimi_k25(path, tok, **GEOMETRY[family]) if family == "kimi_k25"
            else models.tiny(family, path, tok, **GEOMETRY[family]))
    out = str(tmp_path / "export")
    args = ["--model-path", path, "--export-hidden-states-dir", out, "--export-aux-layer-ids", *map(str, AUX),
            *GPU_FLAGS, *(["--trust-remote-code"] if family == "kimi_k25" else [])]
    ids = {f"{family}-{i}": p for i, p in enumerate(prompts(family, [1, 64, 65, 300]))}
    with LocalServer(args, os.path.join(work, f"{family}.log"), cpu=False) as srv:
        for rid, p in ids.items():
            r = srv.generate({"rid": rid, "input_ids": p, "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 200, r.text
    meta = json.load(open(os.path.join(out, "export.json")))
    assert meta["architecture"] == FAMILIES[family] and meta["aux_layer_ids"] == AUX
    rep = validate_export(out, expected_tokens=ids)
    assert rep.ok, rep.errors
    v = verify_export(out, samples=None, device="cuda")
    print(v.table())
    if RESULTS:
        data = json.load(open(RESULTS)) if os.path.exists(RESULTS) else {}
        data[f"family_{family}"] = v.to_dict()
        json.dump(data, open(RESULTS, "w"), indent=2)
    assert v.ok, v.table()
