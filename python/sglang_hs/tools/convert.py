"""Readers and converters from an export directory to what trainers load.

- `ExportDataset`: a torch Dataset over the samples (memory-mapped safetensors).
- SpecForge offline layout (written against SpecForge's offline EAGLE-3 loader as of
  2026-11: `rows_{g}-{g+2000}/data_{idx}.ckpt`, torch.save dicts with `input_ids` [T] int64,
  `loss_mask` [T] int64, `hidden_state` [1, T, H] post-norm final, `aux_hidden_state`
  [1, T, K*H]).
- speculators layout (`hs_{idx}.safetensors` with `hidden_states` [T, K+1, H] and
  `token_ids` [T]; written against speculators' offline data format as of 2026-11).
  speculators applies the model's final norm to the last layer itself; our final state is
  already normed. We write instead the pre-image `final / norm.weight`, whose RMS is 1, so the
  norm speculators applies gives back exactly the exported post-norm state (up to the norm's
  epsilon). That needs the model's final norm weight (`--model`), and is recorded in each
  file's metadata ("last_layer": "prenorm_preimage"). It is not the runtime's own pre-norm
  residual, which SGLang does not expose.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Dict, List, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sglang_hs.format import iter_samples, load_sample, read_export_json

SPECFORGE_GROUP = 2000


class ExportDataset(torch.utils.data.Dataset):
    """Samples of an export directory, in manifest order; tensors are read lazily."""

    def __init__(self, out_dir: str):
        self.dir = out_dir
        self.info = read_export_json(out_dir)
        self.entries = [e for e, _ in iter_samples(out_dir)]

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        t = load_sample(os.path.join(self.dir, self.entries[i]["path"]))
        t.setdefault("loss_mask", torch.ones_like(t["token_ids"], dtype=torch.uint8))
        return t


def to_specforge(out_dir: str, dest: str) -> int:
    ds = ExportDataset(out_dir)
    for idx in range(len(ds)):
        t = ds[idx]
        g = idx // SPECFORGE_GROUP * SPECFORGE_GROUP
        folder = os.path.join(dest, f"rows_{g}-{g + SPECFORGE_GROUP}")
        os.makedirs(folder, exist_ok=True)
        n = t["token_ids"].shape[0]
        torch.save({
            "input_ids": t["token_ids"].long(),
            "loss_mask": t["loss_mask"].long(),
            "hidden_state": t["final_hidden_states"][None].clone(),
            "aux_hidden_state": t["aux_hidden_states"].reshape(1, n, -1).clone(),
        }, os.path.join(folder, f"data_{idx}.ckpt"))
    _write_index(dest, ds, "specforge")
    return len(ds)


def final_norm_weight(model_path: str) -> torch.Tensor:
    """The final RMSNorm weight (`model.norm.weight`) from a HF safetensors checkpoint."""
    for f in sorted(glob.glob(os.path.join(model_path, "*.safetensors"))):
        with safe_open(f, framework="pt") as st:
            for key in st.keys():
                if key in ("model.norm.weight", "model.language_model.norm.weight"):
                    return st.get_tensor(key)
    raise ValueError(f"no model.norm.weight in {model_path}/*.safetensors")


def to_speculators(out_dir: str, dest: str, model_path: Optional[str] = None) -> int:
    info = read_export_json(out_dir)
    w = final_norm_weight(model_path or info["model_path"]).float()
    if bool((w == 0).any()):
        raise ValueError("the final norm has zero weights: the post-norm state cannot be mapped to a pre-image")
    ds = ExportDataset(out_dir)
    os.makedirs(dest, exist_ok=True)
    for idx in range(len(ds)):
        t = ds[idx]
        final = t["final_hidden_states"]
        pre = (final.float() / w).to(final.dtype)
        hs = torch.cat([t["aux_hidden_states"], pre[:, None]], dim=1).contiguous()
        save_file({"hidden_states": hs, "token_ids": t["token_ids"].long(), "loss_mask": t["loss_mask"].long()},
                  os.path.join(dest, f"hs_{idx}.safetensors"),
                  metadata={"id": ds.entries[idx]["id"], "last_layer": "prenorm_preimage",
                            "aux_layer_ids": json.dumps(info["aux_layer_ids"])})
    _write_index(dest, ds, "speculators")
    return len(ds)


def _write_index(dest: str, ds: ExportDataset, layout: str) -> None:
    with open(os.path.join(dest, "sglang_hs_index.json"), "w") as f:
        json.dump({"layout": layout, "source": os.path.abspath(ds.dir), "export": ds.info,
                   "ids": [e["id"] for e in ds.entries]}, f, indent=1)


def inspect_export(out_dir: str) -> dict:
    """Samples, tokens, bytes, layers, dtype, length histogram, and ids that failed in capture."""
    info = read_export_json(out_dir) or {}
    entries = [e for e, _ in iter_samples(out_dir)]
    lengths = [e["num_tokens"] for e in entries]
    size = sum(os.path.getsize(p) for _, p in iter_samples(out_dir) if os.path.exists(p))
    edges = [1, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 1 << 30]
    hist = {f"{a}-{b - 1}" if b < 1 << 30 else f">={a}": sum(a <= n < b for n in lengths)
            for a, b in zip(edges, edges[1:])}
    failed: List[str] = []
    fpath = os.path.join(out_dir, "capture_failed.jsonl")
    if os.path.exists(fpath):
        done = {e["id"] for e in entries}
        with open(fpath) as f:
            failed = sorted({json.loads(l)["id"] for l in f if l.strip()} - done)
    return {"dir": out_dir, "samples": len(entries), "tokens": sum(lengths), "bytes": size,
            "aux_layer_ids": info.get("aux_layer_ids"), "dtype": info.get("dtype"),
            "hidden_size": info.get("hidden_size"), "model_path": info.get("model_path"),
            "length_histogram": {k: v for k, v in hist.items() if v}, "failed_ids": failed}
