"""Readers and converters from an export directory to what trainers load.

- `ExportDataset`: a torch Dataset over the samples (memory-mapped safetensors), in dataset
  order (the position `capture` put in each sample id), not completion order.
- SpecForge 0.2.0 offline layout (what its eagle3 `OfflineManifestReader` reads):
  `rows_{g}-{g+2000}/data_{idx}.ckpt`, torch.save dicts with `input_ids` [T] int64,
  `loss_mask` [T] int64, `hidden_state` [1, T, H] post-norm final, `aux_hidden_state`
  [1, T, K*H]; plus `specforge.yaml` (the model and data sections of a `specforge train`
  config) and, for a target whose checkpoint has no `*.index.json` (SpecForge's target head
  needs one) or whose lm_head is tied to the embeddings, `target_model/`: links to the
  checkpoint's files plus the index it needs.
- speculators 0.9.0 layout (what `python -m speculators.train --data-path DEST` reads):
  a `datasets.save_to_disk` folder with `input_ids`, `loss_mask`, `seq_len` (torch format),
  `hidden_states/hs_{i}.safetensors` for its row i (`hidden_states` [T, K+1, H], `token_ids`
  [T]), and `token_freq.pt` (token id -> count over loss-masked tokens), from which it builds
  the draft vocabulary. The last plane is the final state's pre-image (`sglang_hs.layouts`,
  which needs the model's final norm weight, `--model`), recorded in each file's metadata
  ("last_layer": "prenorm_preimage").

Loss masks follow each trainer's own convention by default (masks.MASK_RULES); a mask is
rewritten only where the sample's provenance says `capture` made it from the chat template.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sglang_hs.format import (
    CaptureProvenance,
    Storage,
    decode_sample,
    final_at_every_position,
    load_sample,
    row_at_every_token,
    sample_metadata,
)
from sglang_hs.layouts import SPECULATORS_LAST_LAYER, final_norm_weight, speculators_fp8_planes, speculators_planes
from sglang_hs.tools.dirs import ExportDirs
from sglang_hs.tools.masks import MASK_RULES, apply_mask_rule, separator_ids

SPECFORGE_GROUP = 2000
# Each trainer's own rule (see masks.MASK_RULES).
DEFAULT_MASK_RULE = {"specforge": "turns+separator", "speculators": "last-turn+separator"}
# `capture`'s sample ids end with the record's dataset position and a content hash.
_POSITION = re.compile(r"(\d{8})-[0-9a-f]{10}$")


def dataset_order(ids: List[str]) -> List[int]:
    """Indices of `ids` in dataset order: by the position `capture` put in the id, then by
    id; ids without a position (rids of other clients) last, by id."""
    def key(i):
        m = _POSITION.search(ids[i])
        return (0, int(m.group(1)), ids[i]) if m else (1, 0, ids[i])

    return sorted(range(len(ids)), key=key)


class ExportDataset(torch.utils.data.Dataset):
    """Samples of an export directory, in dataset order; tensors are read lazily.

    Each sample's planes come in `dtype` (default: the model's) whatever their storage: fp8
    planes are dequantized. From an export with final rows at loss positions only,
    `final_hidden_states` holds those rows and `final_positions` their positions
    (`format.final_at_every_position` puts them in place)."""

    def __init__(self, out_dir: Union[str, Sequence[str]], dtype: Optional[torch.dtype] = None):
        """out_dir: an export directory, or several read as one (tools.dirs)."""
        self.dirs = ExportDirs.open(out_dir)
        self.info = self.dirs.info
        self.storage = Storage.of_export(self.info)
        self.dtype = dtype or getattr(torch, self.info["dtype"])
        entries = self.dirs.entries
        self.entries = [entries[i] for i in dataset_order([e["id"] for e in entries])]

    def __len__(self) -> int:
        return len(self.entries)

    def path(self, i: int) -> str:
        return self.dirs.path(self.entries[i])

    def provenance(self, i: int) -> Optional[CaptureProvenance]:
        return CaptureProvenance.of_sample(sample_metadata(self.path(i)))

    def raw(self, i: int) -> Dict[str, torch.Tensor]:
        """The sample's tensors as stored (fp8 planes and their scales), a row for every token
        (`format.row_at_every_token`: a sample with decode rows gains a zero last row)."""
        return row_at_every_token(load_sample(self.path(i)))

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return self.decode(self.raw(i))

    def decode(self, raw: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        t = decode_sample(raw, self.dtype)
        t.setdefault("loss_mask", torch.ones_like(t["token_ids"], dtype=torch.uint8))
        return t


@dataclasses.dataclass
class ConvertReport:
    layout: str
    dest: str
    samples: int
    loss_mask_rule: str
    # Samples whose mask was rewritten to the rule, and those kept as captured, by reason.
    remasked: int = 0
    kept: Dict[str, int] = dataclasses.field(default_factory=dict)
    # Loss positions the rule added where the export kept no final row (--export-final-rows
    # loss keeps them at the captured mask): left out of the loss.
    without_final_row: int = 0
    notes: List[str] = dataclasses.field(default_factory=list)

    def line(self) -> str:
        kept = ", ".join(f"{n} {why}" for why, n in sorted(self.kept.items()))
        return (f"wrote {self.samples} samples in the {self.layout} layout to {self.dest}; loss masks: "
                f"{self.loss_mask_rule} ({self.remasked} rewritten" + (f"; kept as captured: {kept}" if kept else "")
                + ")" + (f"; {self.without_final_row} loss positions without a final row left out"
                         if self.without_final_row else "")
                + "".join(f"\n  {n}" for n in self.notes))


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    # The target checkpoint (tokenizer for the mask rules, final norm, lm_head); default: the
    # export's model_path.
    model_path: Optional[str] = None
    # A masks.MASK_RULES name; default: the trainer's own (DEFAULT_MASK_RULE).
    loss_mask: Optional[str] = None
    # Kimi-K2.5 and other checkpoints ship their tokenizer as remote code.
    trust_remote_code: bool = False


class _Masks:
    """Each sample's loss mask under a rule, rewritten only where the mask came from the chat
    template (a given mask is the user's; a raw-text sample has none)."""

    def __init__(self, ds: ExportDataset, rule: str, opts: ConvertOptions, report: ConvertReport):
        if rule not in MASK_RULES:
            raise ValueError(f"unknown loss-mask rule {rule!r}: use one of {', '.join(MASK_RULES)}")
        self.ds, self.rule, self.report, self.opts = ds, rule, report, opts
        self._is_sep = None

    def _why_kept(self, prov: Optional[CaptureProvenance]) -> Optional[str]:
        if prov is None:
            return "no capture provenance"
        if prov.mask_policy != "template":
            return f"mask {prov.mask_policy}"
        if prov.mask_reasoning:
            return "reasoning masked (its runs are not turns)"
        return None

    def __call__(self, i: int, t: Dict[str, torch.Tensor]) -> torch.Tensor:
        mask = self._rule_mask(i, t)
        pos = t.get("final_positions")
        if pos is not None:  # the loss needs the target's final row at each of its positions
            has_row = torch.zeros_like(mask)
            has_row[pos.long()] = 1
            self.report.without_final_row += int((mask * (1 - has_row)).sum())
            mask = mask * has_row
        return mask

    def _rule_mask(self, i: int, t: Dict[str, torch.Tensor]) -> torch.Tensor:
        mask = t["loss_mask"].long()
        if self.rule == "captured":
            return mask
        why = self._why_kept(self.ds.provenance(i))
        if why is not None:
            self.report.kept[why] = self.report.kept.get(why, 0) + 1
            return mask
        if self._is_sep is None:
            from transformers import AutoTokenizer

            path = self.opts.model_path or self.ds.info.get("tokenizer_path") or self.ds.info["model_path"]
            self._is_sep = separator_ids(AutoTokenizer.from_pretrained(
                path, trust_remote_code=self.opts.trust_remote_code))
        self.report.remasked += 1
        return torch.tensor(apply_mask_rule(t["token_ids"].tolist(), mask.tolist(), self.rule, self._is_sep),
                            dtype=torch.long)


def _fresh(dest: str) -> None:
    """A converter writes into an empty (or new) folder: files left from an earlier conversion
    would be read as samples of this one."""
    if os.path.isdir(dest) and os.listdir(dest):
        raise ValueError(f"{dest} is not empty: convert into a new folder (or remove it first)")
    os.makedirs(dest, exist_ok=True)


def to_specforge(out_dir: Union[str, Sequence[str]], dest: str, opts: ConvertOptions = ConvertOptions()) -> ConvertReport:
    ds = ExportDataset(out_dir)
    rule = opts.loss_mask or DEFAULT_MASK_RULE["specforge"]
    rep = ConvertReport("specforge", dest, len(ds), rule, notes=ds.dirs.lines())
    masks = _Masks(ds, rule, opts, rep)
    _fresh(dest)
    model = opts.model_path or ds.info["model_path"]
    longest = 0
    for idx in range(len(ds)):
        t = ds[idx]
        g = idx // SPECFORGE_GROUP * SPECFORGE_GROUP
        folder = os.path.join(dest, f"rows_{g}-{g + SPECFORGE_GROUP}")
        os.makedirs(folder, exist_ok=True)
        n = t["token_ids"].shape[0]
        longest = max(longest, n)
        # SpecForge 0.2.0's target head runs in bf16 and multiplies our final state by it: a
        # float32 export (a CPU server run with --dtype float32) is written as bf16.
        torch.save({
            "input_ids": t["token_ids"].long(),
            "loss_mask": masks(idx, t),
            "hidden_state": final_at_every_position(t)[None].to(torch.bfloat16).clone(),
            "aux_hidden_state": t["aux_hidden_states"].reshape(1, n, -1).to(torch.bfloat16).clone(),
        }, os.path.join(folder, f"data_{idx}.ckpt"))
    if ds.info.get("dtype") not in (None, "bfloat16") or ds.storage.scaled:
        stored = "fp8 (dequantized)" if ds.storage.scaled else ds.info["dtype"]
        rep.notes.append(f"states exported as {stored} are written as bfloat16 (SpecForge reads bf16; its target "
                         "head is bf16)")
    target, lm_head_key = specforge_target(model, dest)
    if target != model:
        rep.notes.append(f"target_model/ links {model} and adds the checkpoint index SpecForge's target head reads")
    with open(os.path.join(dest, DRAFT_CONFIG), "w") as f:
        json.dump(eagle3_draft_config(model, ds.info.get("aux_layer_ids") or []), f, indent=1)
    _write_specforge_yaml(dest, ds.info, target, lm_head_key, longest)
    rep.notes.append(f"train: specforge train --config {os.path.join(dest, 'specforge.yaml')} [training.KEY=VALUE ...]")
    rep.notes.append(f"serve: python -m specforge.export.to_sglang --checkpoint RUN_DIR --draft-config "
                     f"{os.path.join(dest, DRAFT_CONFIG)} --output-dir DRAFT")
    _write_index(dest, ds, "specforge", rule)
    return rep


def specforge_target(model_path: str, dest: str):
    """(target_model_path, lm_head_key) for SpecForge 0.2.0. Its target head reads the lm_head
    through a `*.index.json` weight map and needs the tied embedding named when the model
    ties them; for a checkpoint without an index (or with a tied head), `dest/target_model`
    links to its files and adds the index."""
    cfg = json.load(open(os.path.join(model_path, "config.json")))
    tied = bool(cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings", False)))
    weight_map = {}
    for f in sorted(glob.glob(os.path.join(model_path, "*.safetensors"))):
        with safe_open(f, framework="pt") as st:
            weight_map.update({k: os.path.basename(f) for k in st.keys()})
    # Wrappers nest the text model (Kimi-K2.5: language_model.lm_head.weight).
    heads = sorted((k for k in weight_map if k.endswith("lm_head.weight")), key=len)
    embeds = sorted((k for k in weight_map if k.endswith("embed_tokens.weight")), key=len)
    lm_head_key = heads[0] if heads and not tied else embeds[0] if embeds else "lm_head.weight"
    if glob.glob(os.path.join(model_path, "*.index.json")):
        return model_path, lm_head_key
    target = os.path.join(dest, "target_model")
    os.makedirs(target, exist_ok=True)
    for name in os.listdir(model_path):
        link = os.path.join(target, name)
        if not os.path.lexists(link):
            os.symlink(os.path.abspath(os.path.join(model_path, name)), link)
    with open(os.path.join(target, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"written_by": "sglang-hs convert"}, "weight_map": weight_map}, f, indent=1)
    return target, lm_head_key


DRAFT_CONFIG = "draft_config.json"
# Target config keys a one-layer Llama EAGLE-3 draft copies (its attention and MLP geometry).
_DRAFT_KEYS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
               "max_position_embeddings", "rms_norm_eps", "hidden_act", "head_dim", "rope_theta", "rope_parameters",
               "rope_scaling", "bos_token_id", "eos_token_id", "attention_bias")


def eagle3_draft_config(model_path: str, aux_layer_ids: Sequence[int], draft_vocab_size: int = 32000) -> dict:
    """A one-layer `LlamaForCausalLMEagle3` config of the target's geometry, written for both
    ends: SpecForge trains from it and its `to_sglang` saves it for SGLang. It names the aux
    layers in SGLang's numbering (the export's HF ids minus one; the wrong numbering shifts every
    layer without an error) and unties the lm_head (a tied draft loses its trained head in
    SGLang without an error)."""
    t = json.load(open(os.path.join(model_path, "config.json")))
    t = t.get("text_config") or t  # wrappers (Kimi-K2.5) nest the text model's config
    cfg = {k: t[k] for k in _DRAFT_KEYS if t.get(k) is not None}
    return {**cfg, "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            "tie_word_embeddings": False, "pad_token_id": t.get("pad_token_id") or 0, "use_cache": True,
            "draft_vocab_size": min(draft_vocab_size, t["vocab_size"]), "torch_dtype": "bfloat16",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux_layer_ids],
                             "use_aux_hidden_state": True}}


def _write_specforge_yaml(dest: str, info: dict, target: str, lm_head_key: str, longest: int) -> None:
    ids = info.get("aux_layer_ids") or []
    lines = [
        "# The model and data sections of a SpecForge 0.2.0 `specforge train` config for this",
        "# export, written by `sglang-hs convert`. SpecForge's defaults fill in the rest (a draft",
        "# config generated from the target); override with dotted arguments to `specforge train`.",
        f"# Aux states are HF output_hidden_states {ids}; SGLang's EAGLE-3 draft config numbers",
        f"# them one lower (eagle_aux_hidden_state_layer_ids: {[i - 1 for i in ids]}).",
        "model:",
        f"  target_model_path: {json.dumps(os.path.abspath(target))}",
        f"  lm_head_key: {lm_head_key}",
        f"  draft_model_config: {json.dumps(os.path.abspath(os.path.join(dest, DRAFT_CONFIG)))}",
        "data:",
        f"  hidden_states_path: {json.dumps(os.path.abspath(dest))}",
        f"  max_length: {max(longest, 1)}",
        "training:",
        "  attention_backend: sdpa",
    ]
    with open(os.path.join(dest, "specforge.yaml"), "w") as f:
        f.write("\n".join(lines) + "\n")


def write_speculators_index(dest: str, rows: Sequence[Tuple[List[int], List[int]]]) -> None:
    """speculators' dataset index in `dest`: a `datasets.save_to_disk` table (`input_ids`,
    `loss_mask`, `seq_len`, torch format; row i is `hidden_states/hs_{i}` or, online, the
    sample asked for) and `token_freq.pt`, the loss-masked token counts (an int -> int dict,
    as its own prepare-data writes) its draft vocabulary is built from."""
    from datasets import Dataset

    freq: collections.Counter = collections.Counter()
    for ids, mask in rows:
        freq.update(t for t, m in zip(ids, mask) if m)
    table = Dataset.from_dict({"input_ids": [r[0] for r in rows], "loss_mask": [r[1] for r in rows],
                               "seq_len": [len(r[0]) for r in rows]})
    table.set_format(type="torch")
    table.save_to_disk(dest)
    torch.save(dict(freq), os.path.join(dest, "token_freq.pt"))


def to_speculators(out_dir: Union[str, Sequence[str]], dest: str, opts: ConvertOptions = ConvertOptions()) -> ConvertReport:
    ds = ExportDataset(out_dir)
    model = opts.model_path or ds.info["model_path"]
    w = final_norm_weight(model)
    rule = opts.loss_mask or DEFAULT_MASK_RULE["speculators"]
    rep = ConvertReport("speculators", dest, len(ds), rule, notes=ds.dirs.lines())
    masks = _Masks(ds, rule, opts, rep)
    _fresh(dest)
    hs_dir = os.path.join(dest, "hidden_states")
    os.makedirs(hs_dir)
    rows = []
    for idx in range(len(ds)):
        raw = ds.raw(idx)
        t = ds.decode(raw)
        ids, mask = t["token_ids"].long(), masks(idx, t)
        write_speculators_sample(hs_dir, idx, ds.entries[idx]["id"], ds.info, raw, t, w)
        rows.append((ids.tolist(), mask.tolist()))
    write_speculators_index(dest, rows)
    backend = " --hidden-states-backend fp8" if ds.storage.scaled else ""
    rep.notes.append(f"train: python -m speculators.train --data-path {dest}{backend} "
                     f"--verifier-name-or-path {model} --draft-vocab-size N")
    _write_index(dest, ds, "speculators", rule)
    return rep


def write_speculators_sample(hs_dir: str, row: int, sample_id: str, info: dict, raw: Dict[str, torch.Tensor],
                             t: Dict[str, torch.Tensor], w: torch.Tensor) -> str:
    """`hs_dir/hs_{row}.safetensors` from one export sample (`raw` as stored, `t` decoded),
    published atomically: speculators reads a row's file as soon as its name exists and does
    not check it, so a trainer running beside `--follow` must never see a partial file."""
    storage = Storage.of_export(info)
    final = final_at_every_position(t)
    if storage.scaled:  # an fp8 export stays fp8: aux planes as stored, the pre-image quantized alike
        planes = speculators_fp8_planes(raw["aux_hidden_states"], raw["aux_hidden_states_scale"], final, w)
    else:
        planes = speculators_planes(t["aux_hidden_states"], final, w)
    path = os.path.join(hs_dir, f"hs_{row}.safetensors")
    tmp = os.path.join(hs_dir, f".hs_{row}.safetensors.tmp")
    save_file({**planes, "token_ids": t["token_ids"].long()}, tmp,
              metadata={"id": sample_id, "last_layer": SPECULATORS_LAST_LAYER,
                        "aux_layer_ids": json.dumps(info["aux_layer_ids"])})
    os.replace(tmp, path)
    return path


def _write_index(dest: str, ds: ExportDataset, layout: str, rule: str) -> None:
    with open(os.path.join(dest, "sglang_hs_index.json"), "w") as f:
        json.dump({"layout": layout, "sources": [os.path.abspath(d) for d in ds.dirs.dirs], "export": ds.info,
                   "loss_mask_rule": rule,
                   "ids": [e["id"] for e in ds.entries]}, f, indent=1)


def inspect_export(out_dir: Union[str, Sequence[str]]) -> dict:
    """Samples, tokens, bytes, layers, dtype, length histogram, and ids that failed in capture,
    of one export directory or several read as one (each sample id counted once)."""
    dirs = ExportDirs.open(out_dir)
    info, entries = dirs.info, dirs.entries
    lengths = [e["num_tokens"] for e in entries]
    size = sum(os.path.getsize(dirs.path(e)) for e in entries if os.path.exists(dirs.path(e)))
    edges = [1, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 1 << 30]
    hist = {f"{a}-{b - 1}" if b < 1 << 30 else f">={a}": sum(a <= n < b for n in lengths)
            for a, b in zip(edges, edges[1:])}
    failed: set = set()
    for d in dirs.dirs:
        fpath = os.path.join(d, "capture_failed.jsonl")
        if os.path.exists(fpath):
            with open(fpath) as f:
                failed |= {json.loads(l)["id"] for l in f if l.strip()}
    storage = Storage.of_export(info)
    return {"dir": ", ".join(dirs.dirs), "dirs": dirs.dirs, "samples": len(entries), "tokens": sum(lengths),
            "bytes": size, "bytes_per_token": round(size / max(sum(lengths), 1), 1),
            "export_dtype": storage.dtype or info.get("dtype"), "final_rows": storage.final_rows,
            "aux_layer_ids": info.get("aux_layer_ids"), "dtype": info.get("dtype"),
            "hidden_size": info.get("hidden_size"), "model_path": info.get("model_path"),
            "length_histogram": {k: v for k, v in hist.items() if v},
            "failed_ids": sorted(failed - {e["id"] for e in entries}),
            "in_several_dirs": dirs.duplicates,
            "server": {k: info.get(k) for k in SERVER_PROVENANCE},
            "capture": capture_provenance([dirs.path(e) for e in entries], info)}


# What export.json says the numbers and tokens depend on (`inspect` shows it).
SERVER_PROVENANCE = ("architecture", "attention_backend", "quantization", "kv_cache_dtype", "device", "tp_size",
                     "dp_size", "tokenizer_path", "chat_template_sha256", "sglang_version", "sglang_hs_version")


def capture_provenance(paths: Sequence[str], info: dict) -> dict:
    """The samples' capture provenance, grouped: how many samples were made each way, how many
    were truncated or regenerated, and how many were tokenised with a chat template other than
    the one of the tokenizer the server runs (a drafter would then be trained on other text)."""
    groups: collections.Counter = collections.Counter()
    truncated = regenerated = without = other_template = 0
    for path in paths:
        prov = CaptureProvenance.of_sample(sample_metadata(path)) if os.path.exists(path) else None
        if prov is None:
            without += 1
            continue
        truncated += prov.truncated
        regenerated += prov.regenerated
        server_template = info.get("chat_template_sha256")
        if prov.mask_policy == "template" and server_template and prov.chat_template_sha256 != server_template:
            other_template += 1
        groups[json.dumps({k: v for k, v in dataclasses.asdict(prov).items()
                           if k not in ("truncated", "regenerated")}, sort_keys=True)] += 1
    return {"ways": [dict(json.loads(k), samples=n) for k, n in groups.most_common()],
            "truncated": truncated, "regenerated": regenerated, "without_provenance": without,
            "other_chat_template_than_server": other_template}


# export.json key -> /get_server_info key, for what the exported numbers depend on.
SERVED_NUMERICS = {"attention_backend": "attention_backend", "quantization": "quantization",
                   "kv_cache_dtype": "kv_cache_dtype", "tp_size": "tp_size", "dp_size": "dp_size",
                   "numerics.disable_custom_all_reduce": "disable_custom_all_reduce",
                   "numerics.disable_cuda_graph": "disable_cuda_graph",
                   "numerics.enable_torch_compile": "enable_torch_compile"}


def compare_with_server(info: dict, server_info: dict) -> List[str]:
    """Where a drafter trained on this export would be served under other numerics than it
    was captured with: one line per difference (`inspect DIR --against URL`)."""
    lines = []
    if os.path.basename(str(info.get("model_path", "")).rstrip("/")) != \
            os.path.basename(str(server_info.get("model_path", "")).rstrip("/")):
        lines.append(f"model: captured from {info.get('model_path')}, served {server_info.get('model_path')}")
    for ours, theirs in SERVED_NUMERICS.items():
        got = info
        for part in ours.split("."):
            got = (got or {}).get(part)
        if theirs in server_info and got != server_info[theirs]:
            lines.append(f"{theirs}: captured with {got!r}, served with {server_info[theirs]!r}")
    return lines
