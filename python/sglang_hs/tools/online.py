"""What a trainer reads besides the states, written from the records before any state
exists, and what fills speculators' index while a trainer reads it.

- `speculators_index`: the rows from the same records, tokenization and masks `capture`
  uses, with no hidden states. Online (`--export-sink speculators-*`) each row's sample is
  asked of the server when the trainer reads the row.
- `specforge_index`: the same rows as SpecForge's pre-tokenized prompts, with the config,
  draft config and vocabulary mapping its disaggregated online roles need
  (`--export-sink specforge`).
- `follow_speculators` (`convert --to speculators --follow`): train while capturing. It tails
  a directory export's manifest and writes each new sample as its row's
  `hidden_states/hs_{row}.safetensors`, so `speculators train --on-missing skip` can start
  before the capture ends (a row not yet captured is skipped that epoch).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import os
import re
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from sglang_hs.format import MANIFEST, decode_sample, load_sample, read_export_json
from sglang_hs.layouts import default_aux_layer_ids, final_norm_weight
from sglang_hs.tools.convert import (DEFAULT_MASK_RULE, DRAFT_CONFIG, _fresh, eagle3_draft_config, specforge_target,
                                     write_speculators_index, write_speculators_sample)
from sglang_hs.tools.masks import apply_mask_rule, separator_ids, truncate
from sglang_hs.tools.records import RecordError, iter_records, sample_id, to_sample


@dataclasses.dataclass
class IndexReport:
    dest: str
    rows: int
    tokens: int
    rule: str
    skipped: List[str] = dataclasses.field(default_factory=list)  # records that are not samples, and why
    train: str = ""  # the trainer's command on this index

    def lines(self) -> List[str]:
        out = [f"{self.rows} rows, {self.tokens} tokens, loss mask {self.rule} -> {self.dest}"]
        out += [f"skipped: {s}" for s in self.skipped[:10]]
        return out + [f"train: {self.train}"]


def index_rows(data: str, model_path: str, rule: str, max_length: Optional[int], trust_remote_code: bool,
               rep: IndexReport) -> Tuple[List[Tuple[List[int], List[int]]], List[Optional[str]]]:
    """(input_ids, loss_mask) per record in the records' order, as `capture` tokenizes it, and
    each row's record key; a record that cannot be a sample is skipped and named in `rep`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    is_sep = separator_ids(tok)
    rows, keys = [], []
    for i, rec in enumerate(iter_records(data)):
        if isinstance(rec, RecordError):
            rep.skipped.append(f"record {i}: {rec}")
            continue
        try:
            s = to_sample(tok, rec, sample_id("", i, rec))
        except (RecordError, ValueError) as e:
            rep.skipped.append(f"record {i}: {e}")
            continue
        ids, mask = truncate(s.input_ids, s.loss_mask, max_length)
        if mask is None:
            mask = [1] * len(ids)
        elif s.messages is not None:  # a mask made from the chat template: the trainer's convention
            mask = apply_mask_rule(ids, mask, rule, is_sep)
        rows.append((ids, mask))
        keys.append(record_key(s.id))
        rep.tokens += len(ids)
    rep.rows = len(rows)
    return rows, keys


def speculators_index(data: str, model_path: str, dest: str, rule: Optional[str] = None,
                      max_length: Optional[int] = None, trust_remote_code: bool = False,
                      aux_layer_ids: Optional[Sequence[int]] = None) -> IndexReport:
    """speculators' `--data-path` folder: its Arrow table and `token_freq.pt`, no states.
    `aux_layer_ids`: the server's `--export-aux-layer-ids` when it was given one (speculators'
    payload carries none, so the trainer must be told)."""
    rule = rule or DEFAULT_MASK_RULE["speculators"]
    rep = IndexReport(dest, 0, 0, rule)
    rows, keys = index_rows(data, model_path, rule, max_length, trust_remote_code, rep)
    _fresh(dest)
    write_speculators_index(dest, rows)
    with open(os.path.join(dest, "sglang_hs_index.json"), "w") as f:
        json.dump({"layout": "speculators-online", "data": os.path.abspath(data), "model_path": model_path,
                   "loss_mask_rule": rule, "max_length": max_length, "rows": rep.rows,
                   "record_keys": keys}, f, indent=1)
    ids = f" --target-layer-ids {' '.join(map(str, aux_layer_ids))}" if aux_layer_ids else ""
    rep.train = (f"python -m speculators.train --data-path {dest} --verifier-name-or-path {model_path} "
                 f"--vllm-endpoint http://SERVER:PORT/v1 --hidden-states-backend BACKEND{ids} --draft-vocab-size N")
    return rep


@dataclasses.dataclass(frozen=True)
class SpecForgeOnline:
    """Where SpecForge's two roles find the capture server and the store (the non-secret
    part of its `deployment.disaggregated` section)."""
    server_urls: Sequence[str]
    mooncake_master: str
    local_hostname: str = "127.0.0.1"  # this trainer host's address in the store


def specforge_vocab_mapping(rows: Sequence[Tuple[List[int], List[int]]], draft_vocab_size: int,
                            target_vocab_size: int) -> Dict[str, torch.Tensor]:
    """SpecForge's `model.vocab_mapping_path` file (what its draft's `load_vocab_mapping`
    reads): the draft vocabulary is the `draft_vocab_size` most frequent loss-masked target
    tokens (ties and unseen ids by id), `d2t[i]` the offset from draft id i to its target id,
    `t2d` which target ids are in it. Its disaggregated roles need one shared file."""
    freq: collections.Counter = collections.Counter(t for ids, mask in rows for t, m in zip(ids, mask) if m)
    seen = sorted(freq, key=lambda t: (-freq[t], t))[:draft_vocab_size]
    unseen = (t for t in range(target_vocab_size) if t not in freq)
    used = sorted(seen + list(itertools.islice(unseen, draft_vocab_size - len(seen))))
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[used] = True
    return {"d2t": torch.tensor(used) - torch.arange(len(used)), "t2d": t2d}


def specforge_index(data: str, model_path: str, dest: str, online: SpecForgeOnline, rule: Optional[str] = None,
                    max_length: Optional[int] = None, trust_remote_code: bool = False,
                    aux_layer_ids: Optional[Sequence[int]] = None, draft_vocab_size: int = 32000) -> IndexReport:
    """Everything `specforge train -c DEST/specforge.yaml` needs for its disaggregated online
    mode on a server with `--export-sink specforge`: the prompts pre-tokenized as `capture`
    does (`prompts.jsonl`, SpecForge's mask rule by default), the draft config naming the
    server's aux layers (`aux_layer_ids`, HF numbering; default SpecForge's and speculators'
    own [2, L//2, L-3]), the shared vocabulary mapping its roles require, the target as its
    head loads it, and the config itself."""
    rule = rule or DEFAULT_MASK_RULE["specforge"]
    rep = IndexReport(dest, 0, 0, rule)
    rows, _ = index_rows(data, model_path, rule, max_length, trust_remote_code, rep)
    _fresh(dest)
    with open(os.path.join(dest, "prompts.jsonl"), "w") as f:
        for ids, mask in rows:
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
    n_layers = _num_layers(model_path)
    aux = list(aux_layer_ids or default_aux_layer_ids(n_layers))
    draft = eagle3_draft_config(model_path, aux, draft_vocab_size)
    with open(os.path.join(dest, DRAFT_CONFIG), "w") as f:
        json.dump(draft, f, indent=1)
    torch.save(specforge_vocab_mapping(rows, draft["draft_vocab_size"], draft["vocab_size"]),
               os.path.join(dest, "vocab_mapping.pt"))
    target, lm_head_key = specforge_target(model_path, dest)
    longest = max((len(ids) for ids, _ in rows), default=1)
    q = json.dumps
    lines = [
        "# A SpecForge 0.2.0 disaggregated online run (`specforge train -c THIS`), written by",
        "# `sglang-hs index --to specforge`: its producer sends these prompts to the server(s), which",
        f"# write each sample into Mooncake; aux layers HF {aux} = SpecForge's {[i - 1 for i in aux]}.",
        "model:",
        f"  target_model_path: {q(os.path.abspath(target))}",
        f"  lm_head_key: {lm_head_key}",
        f"  draft_model_config: {q(os.path.abspath(os.path.join(dest, DRAFT_CONFIG)))}",
        f"  vocab_mapping_path: {q(os.path.abspath(os.path.join(dest, 'vocab_mapping.pt')))}",
        "data:",
        f"  prompts_path: {q(os.path.abspath(os.path.join(dest, 'prompts.jsonl')))}",
        f"  max_length: {longest}",
        "training:",
        "  attention_backend: sdpa",
        f"output_dir: {q(os.path.abspath(os.path.join(dest, 'run')))}",
        "deployment:",
        "  mode: disaggregated",
        "  disaggregated:",
        f"    control_dir: {q(os.path.abspath(os.path.join(dest, 'control')))}",
        "    backend: mooncake",
        f"    server_urls: {q(list(online.server_urls))}",
        "    mooncake_metadata_server: P2PHANDSHAKE",
        f"    mooncake_master_server_addr: {q(online.mooncake_master)}",
        f"    mooncake_local_hostname: {q(online.local_hostname)}",
        "    mooncake_protocol: tcp",
    ]
    with open(os.path.join(dest, "specforge.yaml"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(dest, "sglang_hs_index.json"), "w") as f:
        json.dump({"layout": "specforge-online", "data": os.path.abspath(data), "model_path": model_path,
                   "loss_mask_rule": rule, "max_length": max_length, "rows": rep.rows, "aux_layer_ids": aux},
                  f, indent=1)
    rep.train = f"specforge train -c {os.path.join(dest, 'specforge.yaml')}"
    return rep


def _num_layers(model_path: str) -> int:
    cfg = json.load(open(os.path.join(model_path, "config.json")))
    return (cfg.get("text_config") or cfg)["num_hidden_layers"]


# A `capture` sample id ends with its record's position and content hash (records.sample_id),
# whatever --id-prefix was given: that tail names the index row.
_RECORD_KEY = re.compile(r"\d{8}-[0-9a-f]{10}$")


def record_key(sample_id: str) -> Optional[str]:
    m = _RECORD_KEY.search(sample_id)
    return m.group(0) if m else None


class ManifestTail:
    """The manifest entries appended since the last `read`. A line still being appended (no
    newline yet) waits for the next read; a line that is not JSON is skipped, as
    `format.read_manifest` does."""

    def __init__(self, out_dir: str):
        self.path = os.path.join(out_dir, MANIFEST)
        self.offset = 0

    def read(self) -> List[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if isinstance(e, dict):
                out.append(e)
        return out


@dataclasses.dataclass
class FollowReport:
    dest: str
    rows: int
    written: int = 0  # rows with their file, this run or an earlier one
    unknown: List[str] = dataclasses.field(default_factory=list)  # exported ids that are no row of the index
    mismatched: List[str] = dataclasses.field(default_factory=list)  # token ids other than the row's: not written

    @property
    def complete(self) -> bool:
        return self.written == self.rows

    def line(self) -> str:
        out = f"{self.written}/{self.rows} rows have their hidden states in {self.dest}"
        if self.unknown:
            out += (f"; {len(self.unknown)} exported samples are no row of this index (other records?), "
                    f"e.g. {self.unknown[0]}")
        if self.mismatched:
            out += (f"; {len(self.mismatched)} samples have other token ids than their row (capture and index "
                    f"run with other --max-length or records?), not written: e.g. {self.mismatched[0]}")
        return out


def follow_speculators(out_dir: str, dest: str, model_path: Optional[str] = None, poll_s: float = 1.0,
                       idle_exit_s: Optional[float] = None, stop: Optional[threading.Event] = None,
                       progress: Optional[Callable[[FollowReport], None]] = None) -> FollowReport:
    """Write each sample of the export `out_dir` as it becomes durable (it is in the manifest)
    into `dest`, an index from `speculators_index`, until every row has its file, `stop` is
    set, or nothing new came for `idle_exit_s`. Rows written by an earlier run are kept, so a
    follow that was stopped resumes where it was."""
    from datasets import load_from_disk

    meta_path = os.path.join(dest, "sglang_hs_index.json")
    meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
    if "record_keys" not in meta:
        raise ValueError(f"{dest} has no index from `sglang-hs index --to speculators` (write it first: the "
                         "trainer can start on it at once)")
    rows: Dict[str, int] = {k: i for i, k in enumerate(meta["record_keys"])}
    input_ids = load_from_disk(dest).with_format(None)["input_ids"]
    hs_dir = os.path.join(dest, "hidden_states")
    os.makedirs(hs_dir, exist_ok=True)
    done = {i for i in range(len(rows)) if os.path.exists(os.path.join(hs_dir, f"hs_{i}.safetensors"))}
    rep = FollowReport(dest, len(rows), len(done))
    stop = stop or threading.Event()
    info, w, tail = None, None, ManifestTail(out_dir)
    last_new = time.monotonic()
    while not rep.complete and not stop.is_set():
        if info is None and (info := read_export_json(out_dir)) is not None:
            if info.get("model_path") != meta["model_path"] and model_path is None:
                raise ValueError(f"the export's model {info.get('model_path')} is not the index's "
                                 f"{meta['model_path']}: pass --model if they are the same checkpoint")
            w = final_norm_weight(model_path or meta["model_path"])
        entries = tail.read() if info is not None else []
        for e in entries:
            row = rows.get(record_key(e["id"]) or "")
            if row is None:
                rep.unknown.append(e["id"])
                continue
            if row in done:
                continue
            raw = load_sample(os.path.join(out_dir, e["path"]))
            t = decode_sample(raw, getattr(torch, info["dtype"]))
            if t["token_ids"].tolist() != list(input_ids[row]):
                rep.mismatched.append(e["id"])
                continue
            write_speculators_sample(hs_dir, row, e["id"], info, raw, t, w)
            done.add(row)
            rep.written += 1
        if entries:
            last_new = time.monotonic()
            if progress:
                progress(rep)
        elif idle_exit_s is not None and time.monotonic() - last_new > idle_exit_s:
            break
        if not rep.complete:
            stop.wait(poll_s)
    return rep
