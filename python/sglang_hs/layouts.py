"""The trainers' own sample layouts, built from a sample's rows: what `convert` writes to disk
and what the streaming sinks hand to a trainer online, from one definition each.

- speculators 0.9.0 (hs-connectors 0.9.0's `file`, `fp8` and `mooncake` backends, and its
  offline `hs_{i}.safetensors`): `hidden_states` [T, K+1, H], the K aux planes then the
  final state's pre-image (below), and `token_ids` [T] int64. speculators applies the model's
  final norm to the last plane itself; our final state is already normed, so we hand it the
  pre-image `final / norm.weight`, whose RMS is 1: the norm speculators applies gives back the
  exported post-norm state (up to the norm's epsilon). It is not the runtime's own pre-norm
  residual, which SGLang does not expose.
- SpecForge 0.2.0 online (its `spec_capture` contract): `hidden_state` [1, T, K*H], the aux
  planes side by side, and `target` [1, T, H], the post-norm final state, in bf16.
"""

from __future__ import annotations

import glob
import os
from typing import Dict, Tuple

import torch
from safetensors import safe_open

from sglang_hs.format import quantize_rows

# Each file's metadata says what its last plane is.
SPECULATORS_LAST_LAYER = "prenorm_preimage"


def default_aux_layer_ids(num_layers: int) -> Tuple[int, ...]:
    """The aux layers both trainers assume unless told (HF numbering): a speculators 0.9.0
    draft without `--target-layer-ids` (`speculators.models.utils.resolve_target_layer_ids`)
    and SpecForge 0.2.0's default, [1, L//2-1, L-4] in its own numbering."""
    return (2, num_layers // 2, num_layers - 3)


def final_norm_weight(model_path: str) -> torch.Tensor:
    """The final RMSNorm weight (`model.norm.weight`) from a HF safetensors checkpoint, as
    float32; refuses a weight with zeros (no pre-image exists there)."""
    for f in sorted(glob.glob(os.path.join(model_path, "*.safetensors"))):
        with safe_open(f, framework="pt") as st:
            for key in st.keys():
                if key in ("model.norm.weight", "model.language_model.norm.weight"):
                    w = st.get_tensor(key).float()
                    if bool((w == 0).any()):
                        raise ValueError("the final norm has zero weights: the post-norm state cannot be mapped "
                                         "to a pre-image")
                    return w
    raise ValueError(f"no model.norm.weight in {model_path}/*.safetensors")


def speculators_planes(aux: torch.Tensor, final: torch.Tensor, norm_weight: torch.Tensor) -> Dict[str, torch.Tensor]:
    """{"hidden_states": [T, K+1, H]} in `final`'s dtype, from aux [T, K, H] and the post-norm
    final [T, H]."""
    pre = (final.float() / norm_weight).to(final.dtype)
    return {"hidden_states": torch.cat([aux.to(final.dtype), pre[:, None]], dim=1).contiguous()}


def speculators_fp8_planes(aux_q: torch.Tensor, aux_scale: torch.Tensor, final: torch.Tensor,
                           norm_weight: torch.Tensor) -> Dict[str, torch.Tensor]:
    """speculators' fp8 layout (its `fp8` backend multiplies `hidden_states` by
    `hidden_states_scales`), with one scale per row and plane [T, K+1, 1]: fp8 aux planes
    [T, K, H] with their scales [T, K] pass through, the pre-image is quantized the same way."""
    q_pre, s_pre = quantize_rows(final.float() / norm_weight)
    return {"hidden_states": torch.cat([aux_q, q_pre[:, None]], dim=1).contiguous(),
            "hidden_states_scales": torch.cat([aux_scale, s_pre[:, None]], dim=1)[..., None].contiguous()}


def specforge_online(aux: torch.Tensor, final: torch.Tensor) -> Dict[str, torch.Tensor]:
    """{"hidden_state": [1, T, K*H], "target": [1, T, H]} in bf16 (SpecForge reads bf16)."""
    n = aux.shape[0]
    return {"hidden_state": aux.reshape(1, n, -1).to(torch.bfloat16).contiguous(),
            "target": final[None].to(torch.bfloat16).contiguous()}
