"""Test scaffolding shared by the unit, server and GPU tests."""

from __future__ import annotations

import json
import os
import random
from typing import List, Sequence

from sglang_hs.format import Storage, write_export_json
from sglang_hs.overlay.build import Served, export_info


def prompts(seed: int, lengths: Sequence[int], vocab: int = 49152) -> List[List[int]]:
    """Random token ids (never the first three, which are special in SmolLM2's vocabulary)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def write_test_export_json(out_dir: str, hidden_size: int, aux_layer_ids=(2, 5, 7), model_path: str = "m",
                           architecture: str = "LlamaForCausalLM", num_layers: int = 10, dtype: str = "bfloat16",
                           export_dtype=None, final_rows: str = "all") -> dict:
    """export.json as the server writes it (the same builder), for a directory a test fills."""
    served = Served(model_path=model_path, architecture=architecture, hidden_size=hidden_size, num_layers=num_layers,
                    dtype=dtype, device="cpu", attention_backend="torch_native", tp_size=1, dp_size=1,
                    sglang_version="test")
    info = export_info(served, aux_layer_ids, Storage(export_dtype, final_rows))
    write_export_json(out_dir, info)
    return info


def record_gpu_result(name: str, value) -> None:
    """Add `name` to the GPU tests' JSON (SGLANG_HS_GPU_RESULTS, which gpu_session.sh sets), if any."""
    path = os.environ.get("SGLANG_HS_GPU_RESULTS")
    if path:
        data = json.load(open(path)) if os.path.exists(path) else {}
        data[name] = value
        json.dump(data, open(path, "w"), indent=2)
