"""Recompute exported samples with Hugging Face transformers, independently of SGLang.

For each plane (every aux layer and the final state) we report the error of the exported
rows against an fp32 HF forward, and HF's own bf16 forward against the same fp32 reference:
an export is as exact as the runtime can be when its error is of the order of HF bf16's.
An export stored in fewer bits (`--export-dtype`) adds its storage error: what storing the
fp32 reference itself that way costs, reported apart and added to what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, List, Optional, Sequence, Set, Union

import torch

from safetensors import safe_open

from sglang_hs.format import (
    Storage,
    decode_sample,
    dequantize_rows,
    load_sample,
    quantize_rows,
    sample_metadata,
    validate_export,
)
from sglang_hs.tools.dirs import ExportDirs

# Pass when the export's error vs fp32 is at most this multiple of HF bf16's own error...
MAX_ERROR_RATIO = 2.0
# ...and the mean per-token cosine similarity vs fp32 is at least this, or falls short of it
# no further than HF's own bf16 forward does (1 - cos grows as the error squared, hence the
# ratio squared): a random MoE in bf16 flips routing choices, and HF bf16 drops below 0.999 too.
MIN_MEAN_COSINE = 0.999
# Decode rows (the generated positions of samples with decode rows) come from the runtime's
# decode forward, whose kernels differ from its prefill's (MLA's absorbed decode attention,
# split-KV reductions), so they are reported and judged on their own ("decode" planes), by the
# same rule. Measured on an H100 (SGLang 0.5.17, DeepSeek V3 MLA geometry, decode graphs):
# decode rows are as close to HF fp32 as prompt rows (benchmark/results/gpu_mla_decode_h100.json).
# When the export holds a prefill twin of a decode sample (a prompt-only sample of the same
# final tokens, from the same server), the runtime's own decode-vs-prefill difference is
# measured there and allowed on top.


@dataclasses.dataclass
class PlaneStats:
    name: str
    rel_err: float  # ||export - fp32|| / ||fp32|| over all rows
    rel_err_hf_bf16: float  # the same for HF's own bf16 forward
    mean_cos: float
    min_cos: float
    max_abs: float
    rel_err_storage: float = 0.0  # the fp32 reference stored the export's way, vs itself
    mean_cos_hf_bf16: float = 1.0  # HF's own bf16 forward vs fp32
    decode: bool = False  # the generated positions of samples with decode rows
    # decode: ||decode row - prefill twin's row|| / ||fp32|| over the rows that have a twin
    # (the runtime's own decode-vs-prefill difference); None: no twin in the export
    rel_gap_prefill: Optional[float] = None

    @property
    def ok(self) -> bool:
        ratio, extra = MAX_ERROR_RATIO, self.rel_gap_prefill or 0.0
        allowed = ratio * (self.rel_err_hf_bf16 + self.rel_err_storage) + extra + 1e-6
        if extra:  # the allowance as a multiple of HF bf16's error
            ratio = allowed / max(self.rel_err_hf_bf16, 1e-12)
        floor = min(MIN_MEAN_COSINE, 1 - ratio ** 2 * (1 - self.mean_cos_hf_bf16))
        return self.rel_err <= allowed and self.mean_cos >= floor

    @property
    def judged_by(self) -> str:
        if self.rel_gap_prefill is not None:
            return f"{MAX_ERROR_RATIO:g}x HF bf16 + decode-vs-prefill"
        return f"{MAX_ERROR_RATIO:g}x HF bf16"


@dataclasses.dataclass
class VerifyReport:
    samples: int
    tokens: int
    planes: List[PlaneStats]
    format_errors: List[str]
    notes: List[str] = dataclasses.field(default_factory=list)  # several directories: what was read how

    @property
    def ok(self) -> bool:
        return not self.format_errors and all(p.ok for p in self.planes)

    @property
    def worst_ratio(self) -> float:
        """Export error over what the runtime (HF bf16) and the storage alone would cost."""
        return max((p.rel_err / max(p.rel_err_hf_bf16 + p.rel_err_storage, 1e-12) for p in self.planes), default=0.0)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["ok"], d["worst_ratio"] = self.ok, self.worst_ratio
        return d

    def table(self) -> str:
        lines = [f"{'plane':>16} {'err vs fp32':>12} {'HF bf16 err':>12} {'storage err':>12} {'ratio':>6} "
                 f"{'mean cos':>9} {'HF bf16 cos':>11} {'min cos':>8} {'max |d|':>8}  ok   judged by"]
        for p in self.planes:
            lines.append(f"{p.name:>16} {p.rel_err:12.3e} {p.rel_err_hf_bf16:12.3e} {p.rel_err_storage:12.3e} "
                         f"{p.rel_err / max(p.rel_err_hf_bf16 + p.rel_err_storage, 1e-12):6.2f} {p.mean_cos:9.6f} "
                         f"{p.mean_cos_hf_bf16:11.6f} {p.min_cos:8.5f} {p.max_abs:8.4f}  {'yes' if p.ok else 'NO ':<4} "
                         f"{p.judged_by}" + (f" ({p.rel_gap_prefill:.3e})" if p.rel_gap_prefill is not None else ""))
        return "\n".join(lines)


def hf_planes(model, token_ids: torch.Tensor, layer_ids: List[int]) -> torch.Tensor:
    """[T, K+1, H] float32: HF output_hidden_states[k] for each aux k, then the post-norm final."""
    with torch.no_grad():
        out = model.model(input_ids=token_ids[None].to(model.device), output_hidden_states=True)
    planes = [out.hidden_states[k][0] for k in layer_ids] + [out.last_hidden_state[0]]
    return torch.stack(planes, dim=1).float().cpu()


def load_hf(model_path: str, dtype: torch.dtype, device: str = "cpu"):
    """The HF text model of a checkpoint. A wrapper checkpoint whose class transformers does
    not have (Kimi-K2.5: `KimiK25ForConditionalGeneration`, text config under `text_config`,
    weights under `language_model.`) is loaded as its text model from those weights."""
    import transformers
    from transformers import AutoModelForCausalLM

    cfg = _read_config(model_path)
    archs = cfg.get("architectures") or []
    if "text_config" not in cfg or any(hasattr(transformers, a) for a in archs):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    else:
        model = _load_text_model(model_path, cfg["text_config"], dtype)
    return model.to(device).eval()


WRAPPER_PREFIX = "language_model."


def _read_config(model_path: str) -> dict:
    with open(os.path.join(model_path, "config.json")) as f:
        return json.load(f)


def _load_text_model(model_path: str, text_config: dict, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    text_config = dict(text_config)
    cfg = AutoConfig.for_model(text_config.pop("model_type"), **text_config)
    # key_mapping renames the checkpoint's keys before transformers applies its own
    # conversions (e.g. per-expert MoE weights into fused expert tensors); other keys
    # (the vision tower) are left unused.
    model = AutoModelForCausalLM.from_pretrained(model_path, config=cfg, dtype=dtype,
                                                 key_mapping={f"^{WRAPPER_PREFIX}": ""})
    return model


def stored(x: torch.Tensor, storage: Storage) -> torch.Tensor:
    """float32 rows `x` as an export with `storage` would hold them (the runtime's own dtype
    is part of the runtime's error, not the storage's)."""
    if storage.scaled:
        return dequantize_rows(*quantize_rows(x.clone()))
    return x.to(storage.row_dtype(x.dtype)).float()


def _accumulate(acc: Dict[str, list], name: str, got: torch.Tensor, ref: torch.Tensor, hf16: torch.Tensor,
                storage: Storage):
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    a = acc.setdefault(name, [0.0, 0.0, 0.0, [], 0.0, 0.0, []])
    a[0] += float((got - ref).pow(2).sum())
    a[1] += float((hf16 - ref).pow(2).sum())
    a[2] += float(ref.pow(2).sum())
    a[3].append(cos)
    a[4] = max(a[4], float((got - ref).abs().max()))
    a[5] += float((stored(ref, storage) - ref).pow(2).sum())
    a[6].append(torch.nn.functional.cosine_similarity(hf16, ref, dim=-1))


def _plane(name: str, a: list, gap: Optional[list] = None) -> PlaneStats:
    se, se16, ss, cos, mx, sst, cos16 = a
    cos = torch.cat(cos)
    return PlaneStats(name, (se / ss) ** 0.5, (se16 / ss) ** 0.5, float(cos.mean()), float(cos.min()), mx,
                      (sst / ss) ** 0.5, float(torch.cat(cos16).mean()), decode=name.endswith(DECODE),
                      rel_gap_prefill=(gap[0] / gap[1]) ** 0.5 if gap else None)


DECODE = " decode"  # the name suffix of a plane's decode rows


def verify_export(out_dir: Union[str, Sequence[str]], model_path: Optional[str] = None, samples: Optional[int] = 8,
                  device: str = "cpu") -> VerifyReport:
    """Check the format of one export directory or several read as one (tools.dirs), and
    compare the first `samples` samples listed (None: all) with HF."""
    try:
        dirs = ExportDirs.open(out_dir)
    except ValueError as e:
        return VerifyReport(0, 0, [], [str(e)])
    errors = []
    for d in dirs.dirs:
        errors += [f"{d}: {e}" if len(dirs.dirs) > 1 else e for e in validate_export(d).errors]
    info = dirs.info
    model_path = model_path or info["model_path"]
    ids = list(info["aux_layer_ids"])
    storage = Storage.of_export(info)
    names = [f"aux[{k}]" for k in ids] + ["final"]
    ref_model = load_hf(model_path, torch.float32, device)
    bf16_model = load_hf(model_path, torch.bfloat16, device)
    acc: Dict[str, list] = {}
    gaps: Dict[str, list] = {}
    chosen = [(e, sample_metadata(dirs.path(e)).get("prompt_tokens"))
              for e in (dirs.entries if samples is None else dirs.entries[:samples])]
    twins = _prefill_twins(dirs, {e.get("num_tokens") for e, prompt in chosen if prompt is not None})
    n = tokens = 0
    for entry, prompt in chosen:
        path = dirs.path(entry)
        t = decode_sample(load_sample(path), torch.float32)
        tok = t["token_ids"]
        rows = t["aux_hidden_states"].shape[0]  # decode rows: none for the last generated token
        ref = hf_planes(ref_model, tok, ids)[:rows]
        hf16 = hf_planes(bf16_model, tok, ids)[:rows]
        twin = twins.get(tuple(tok.tolist())) if prompt is not None else None
        if twin is not None:
            twin = decode_sample(load_sample(dirs.path(twin)), torch.float32)
        pos = t.get("final_positions")
        for j, name in enumerate(names):
            if name == "final":  # only the rows the export kept (--export-final-rows loss)
                at = slice(None) if pos is None else pos.long()
                got, r, h = t["final_hidden_states"], ref[at, j], hf16[at, j]
            else:
                got, r, h = t["aux_hidden_states"][:, j], ref[:, j], hf16[:, j]
            cut = got.shape[0] if prompt is None or pos is not None else int(prompt)
            if cut:
                _accumulate(acc, name, got[:cut], r[:cut], h[:cut], storage)
            if cut < got.shape[0]:
                _accumulate(acc, name + DECODE, got[cut:], r[cut:], h[cut:], storage)
                if twin is not None:
                    tw = (twin["final_hidden_states"] if name == "final" else twin["aux_hidden_states"][:, j])[cut:rows]
                    g = gaps.setdefault(name + DECODE, [0.0, 0.0])
                    g[0] += float((got[cut:] - tw).pow(2).sum())
                    g[1] += float(r[cut:].pow(2).sum())
        n += 1
        tokens += tok.numel()
    order = names + [name + DECODE for name in names]
    planes = [_plane(name, acc[name], gaps.get(name)) for name in order if name in acc]
    return VerifyReport(n, tokens, planes, errors, dirs.lines())


def _prefill_twins(dirs: ExportDirs, lengths: Set[int]) -> Dict[tuple, dict]:
    """Prompt-only samples of one of these token counts (those of the decode samples being
    verified), by their tokens: a decode sample's twin has its whole sequence (same server,
    same positions). Only samples of those lengths are opened."""
    twins: Dict[tuple, dict] = {}
    for entry in dirs.entries:
        if entry.get("num_tokens") not in lengths:
            continue
        path = dirs.path(entry)
        if sample_metadata(path).get("prompt_tokens") is None:
            with safe_open(path, framework="pt") as f:
                twins.setdefault(tuple(f.get_tensor("token_ids").tolist()), entry)
    return twins
