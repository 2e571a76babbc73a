"""Every family the README marks as tested: a miniature of it served by a real SGLang server on
CPU exports aux layers at non-default HF ids, the lowest (1) and the highest (L-1) included,
and `verify` finds them equal to Hugging Face's `output_hidden_states` at those ids. Families
that capture through per-layer flags (Qwen2/Qwen3-MoE) exported the wrong layers before
sglang_hs.overlay.aux_layers; Kimi-K2.5's wrapper class could not start."""

import concurrent.futures as cf
import json
import os

import pytest

from harness import models
from harness.fixtures import prompts
from sglang_hs.overlay.aux_layers import TESTED
from sglang_hs.format import validate_export
from sglang_hs.tools.serve import LocalServer
from sglang_hs.tools.verify import verify_export

pytestmark = [pytest.mark.server, pytest.mark.core]

MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".cache", "models")
NUM_LAYERS = 8
AUX = [1, 3, 7]  # the family default for 8 layers is [2, 4, 5]

# family (a key of models.TINY, or kimi_k25) -> the class SGLang serves it with. DeepSeek V3
# at [1, 4, 7] is test_deepseek_cpu.py, Llama at [1, 3, 7] test_tp_cpu.py (TP1 and TP2).
FAMILIES = {
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "kimi_k25": "KimiK25ForConditionalGeneration",
}


def tiny_model(family, tokenizer_dir):
    out = os.path.join(MODELS, f"tiny-{family}-{NUM_LAYERS}l")
    if family == "kimi_k25":
        return models.tiny_kimi_k25(out, tokenizer_dir, num_layers=NUM_LAYERS)  # as conftest.tiny_kimi_path
    return models.tiny(family, out, tokenizer_dir, num_layers=NUM_LAYERS)


def test_every_class_tested_on_cpu_is_exported_here_or_in_the_deepseek_and_tp_tests():
    elsewhere = {"DeepseekV3ForCausalLM", "LlamaForCausalLM"}
    assert {c for c, where in TESTED.items() if "CPU" in where} == set(FAMILIES.values()) | elsewhere


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_exports_hf_layers_at_the_lowest_and_highest_ids(family, smollm2_path, tmp_path):
    path = tiny_model(family, smollm2_path)
    out = str(tmp_path / "export")
    args = ["--model-path", path, "--export-hidden-states-dir", out, "--export-aux-layer-ids", *map(str, AUX),
            "--chunked-prefill-size", "64", "--skip-server-warmup"]
    if family == "kimi_k25":
        args.append("--trust-remote-code")  # its processor is remote code, as in the released checkpoint
    ids = {f"{family}-{i}": p for i, p in enumerate(prompts(family, [1, 64, 65, 300]))}
    ids[f"{family}-shared"] = ids[f"{family}-3"][:130] + [11, 12]  # a cached prefix it must recompute
    with LocalServer(args, str(tmp_path / "server.log")) as srv:
        def send(rid):
            return rid, srv.generate({"rid": rid, "input_ids": ids[rid], "sampling_params": {"max_new_tokens": 2}})

        with cf.ThreadPoolExecutor(4) as ex:
            for rid, r in ex.map(send, list(ids)):
                assert r.status_code == 200, r.text
        log = open(srv.log_path).read()
    assert f"aux capture on {FAMILIES[family]} layers {AUX}" in log
    meta = json.load(open(os.path.join(out, "export.json")))
    assert meta["architecture"] == FAMILIES[family] and meta["aux_layer_ids"] == AUX
    rep = validate_export(out, expected_tokens=ids)
    assert rep.ok and rep.samples == len(ids), rep.errors
    v = verify_export(out, samples=None)
    print(v.table())
    assert v.ok, v.table()


def test_a_refused_family_stops_at_start_up_and_says_why(smollm2_path, tmp_path):
    path = models.tiny("gemma3", os.path.join(MODELS, f"tiny-gemma3-{NUM_LAYERS}l"), smollm2_path,
                       num_layers=NUM_LAYERS)
    out = str(tmp_path / "export")
    args = ["--model-path", path, "--export-hidden-states-dir", out, "--export-aux-layer-ids", *map(str, AUX),
            "--skip-server-warmup"]
    with pytest.raises(RuntimeError) as e:
        with LocalServer(args, str(tmp_path / "server.log")):
            pass
    assert "Gemma3ForCausalLM: hidden-state export is refused" in str(e.value)
    assert not os.path.exists(os.path.join(out, "export.json"))
