"""Miniature models of SGLang's families for tests and benchmarks (dev harness, not shipped).

`tiny(family, ...)` builds randomly initialised miniatures with SmolLM2's tokenizer;
`tiny_kimi_k25` wraps the DeepSeek V3 one in the Kimi-K2.5 checkpoint layout.
"""

from __future__ import annotations

import json
import os

from sglang_hs.tools.models import checkpoint_ready, edit_config, replace_dir

# The SmolLM2 vocabulary (49152) but a hidden size of 64: each family's layer structure
# (attention kind, MoE routing, norms) as SGLang and transformers build it, at a size whose
# server starts in seconds once SGLang is imported.
_COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=4096)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
# SGLang's CPU rope for DeepSeek requires a rope scaling (the real models use yarn).
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32,
         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
_DEEPSEEK_V3 = dict(
    intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
    topk_group=1, max_position_embeddings=4096, rope_scaling=_YARN, hidden_size=64)
# Keys every released DeepSeek V3 / Kimi K2 config carries and SGLang reads; transformers'
# config class does not write them.
_DEEPSEEK_V3_EXTRA = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}

# family -> (transformers config class, model class, config kwargs, extra config.json keys)
TINY = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_COMMON, tie_word_embeddings=True), {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_COMMON, sliding_window=None), {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_COMMON, pad_token_id=0), {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_COMMON, tie_word_embeddings=True), {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_COMMON, head_dim=16), {}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(_COMMON, **_MOE, shared_expert_intermediate_size=64), {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(_COMMON, **_MOE, head_dim=16), {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(_COMMON, head_dim=16, sliding_window=64, query_pre_attn_scalar=16), {}),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(_COMMON, head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                      n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1), {}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(_COMMON, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=64,
                     layer_types=None), {"swiglu_limit": 7.0}),
    # Gated delta-net (linear attention) layers with a full-attention layer every fourth,
    # MoE with a gated shared expert: triton kernels in SGLang, so GPU only.
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(_COMMON, **_MOE, head_dim=16, shared_expert_intermediate_size=64, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                        layer_types=None), {"full_attention_interval": 4}),
    # MLA attention, yarn rope, a dense first layer then MoE layers with sigmoid noaux_tc
    # routing and a shared expert: the architecture of Kimi K2.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(_DEEPSEEK_V3, tie_word_embeddings=False),
                    _DEEPSEEK_V3_EXTRA),
}


def tiny(family: str, out_dir: str, tokenizer_dir: str, seed: int = 0, num_layers: int = 8, **geometry) -> str:
    """A randomly initialised model of `family` (a key of TINY) with SmolLM2's tokenizer;
    `geometry` overrides config values (GPU kernels want larger heads than the CPU tests)."""
    if checkpoint_ready(out_dir):
        return out_dir
    import torch
    import transformers
    from transformers import AutoTokenizer

    cfg_name, model_name, kwargs, extra = TINY[family]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = getattr(transformers, cfg_name)(
        vocab_size=len(tok), num_hidden_layers=num_layers, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, torch_dtype=torch.bfloat16, **{**kwargs, **geometry})
    return _save_random(getattr(transformers, model_name), cfg, tok, out_dir, seed,
                        (lambda c: c.update(extra)) if extra else None)


def _save_random(model_cls, cfg, tok, out_dir: str, seed: int, config_edit=None) -> str:
    import torch

    torch.manual_seed(seed)
    model = model_cls(cfg)
    # Larger weights than the default init keep the residual stream far from trivially small.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model = model.to(torch.bfloat16)
    tmp = out_dir + ".tmp"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if config_edit is not None:
        edit_config(tmp, config_edit)
    replace_dir(tmp, out_dir)
    return out_dir


# Kimi-K2.5's checkpoint ships its processor as remote code, and SGLang loads the processor
# of a multimodal class at start-up even with --skip-tokenizer-init. This stand-in gives what
# start-up reads for text-only serving: the tokenizer and the media settings (the values of
# the released Kimi-K2.5 preprocessor config). It processes no image.
_KIMI_PROCESSOR = '''
from types import SimpleNamespace

from transformers import AutoTokenizer


class TextOnlyKimiK25Processor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.image_processor = None
        self.media_processor = SimpleNamespace(media_proc_cfg={
            "patch_size": 14, "merge_kernel_size": [2, 2], "in_patch_limit": 16384,
            "patch_limit_on_one_side": 512, "fixed_output_tokens": None,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]})

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoProcessor"):
        pass  # transformers registers remote classes; nothing to register for a stand-in

    @classmethod
    def from_pretrained(cls, path, *args, **kwargs):
        return cls(AutoTokenizer.from_pretrained(path))
'''


def tiny_kimi_k25(out_dir: str, tokenizer_dir: str, seed: int = 0, num_layers: int = 8, **geometry) -> str:
    """The Kimi-K2.5 checkpoint layout around a miniature DeepSeek V3: class
    `KimiK25ForConditionalGeneration`, the text config under `text_config`, the text weights
    under `language_model.`, a small vision config (`language_only`: no vision weights), and
    a text-only processor as remote code (serve with --trust-remote-code)."""
    if checkpoint_ready(out_dir):
        return out_dir
    import shutil

    from safetensors.torch import load_file, save_file

    text_dir = tiny("deepseek_v3", out_dir + ".text", tokenizer_dir, seed, num_layers, **geometry)
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(text_dir, tmp)
    weights = load_file(os.path.join(tmp, "model.safetensors"))
    save_file({f"language_model.{k}": v for k, v in weights.items()}, os.path.join(tmp, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json")) as f:
        text = json.load(f)
    cfg = {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": text, "language_only": True, "encoder_only": False, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "media_placeholder_token_id": text["vocab_size"] - 1,
        # The released config names the tower's width twice: MoonViT reads hidden_size, the
        # projector vt_hidden_size.
        "vision_config": {"hidden_size": 32, "vt_hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                          "intermediate_size": 64, "mm_hidden_size": 32, "text_hidden_size": text["hidden_size"],
                          "init_pos_emb_height": 8, "init_pos_emb_width": 8, "init_pos_emb_time": 2},
    }
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(tmp, "text_only_kimi_k25_processor.py"), "w") as f:
        f.write(_KIMI_PROCESSOR)
    with open(os.path.join(tmp, "processor_config.json"), "w") as f:
        json.dump({"auto_map": {"AutoProcessor": "text_only_kimi_k25_processor.TextOnlyKimiK25Processor"}}, f)
    replace_dir(tmp, out_dir)
    return out_dir


# Kimi-K2.5 INT4's scheme (its config's quantization_config): routed experts' linears as
# compressed-tensors "pack-quantized" int4, symmetric, one scale per group of 32 inputs;
# attention, shared experts, dense MLPs and lm_head stay bf16.
INT4_GROUP = 32
_INT4_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": INT4_GROUP, "dynamic": False, "actorder": None,
                                              "observer": "minmax", "block_structure": None}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}
_EXPERT = r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$"


def int4_experts(src_dir: str, out_dir: str) -> tuple:
    """(quantized, dequantized) checkpoints of the model in `src_dir` (a bf16 DeepSeek V3 /
    Kimi K2 layout): `out_dir` holds the routed experts as int4 (weight_packed int32 packed
    along the input dim by compressed-tensors' own packer, weight_scale bf16 [out, in/32],
    weight_shape) and its quantization_config; `out_dir + ".dequantized"` holds the same
    model with those experts as the bf16 values q * scale, which Hugging Face loads as the
    reference the INT4 server must match."""
    deq_dir = out_dir + ".dequantized"
    if checkpoint_ready(out_dir) and checkpoint_ready(deq_dir):
        return out_dir, deq_dir
    import re
    import shutil

    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import load_file, save_file

    weights = load_file(os.path.join(src_dir, "model.safetensors"))
    quant, deq = {}, {}
    for key, w in weights.items():
        if not re.search(_EXPERT, key):
            quant[key] = deq[key] = w
            continue
        out_f, in_f = w.shape
        g = w.float().view(out_f, in_f // INT4_GROUP, INT4_GROUP)
        # compressed-tensors' symmetric minmax: amax over the half range of int4's 15 steps
        scale = (g.abs().amax(dim=-1) / 7.5).clamp_min(1e-8).to(torch.bfloat16)
        q = torch.round(g / scale.float()[..., None]).clamp(-8, 7).to(torch.int8)
        stem = key[: -len(".weight")]
        quant[f"{stem}.weight_packed"] = pack_to_int32(q.view(out_f, in_f), 4)
        quant[f"{stem}.weight_scale"] = scale
        quant[f"{stem}.weight_shape"] = torch.tensor([out_f, in_f], dtype=torch.int32)
        deq[key] = (q.float() * scale.float()[..., None]).view(out_f, in_f).to(torch.bfloat16)
    for d, tensors, config_edit in ((out_dir, quant, lambda c: c.update(quantization_config=_INT4_CONFIG)),
                                    (deq_dir, deq, None)):
        tmp = d + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src_dir, tmp)
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if config_edit is not None:
            edit_config(tmp, config_edit)
        replace_dir(tmp, d)
    return out_dir, deq_dir
