"""What a trainer's online mode needs besides a server with `--export-sink`: speculators'
dataset index for `--data-path`, from the same records and the same tokenization and masks
`capture` uses, with no hidden states in it (each row's sample is asked of the server when
the trainer reads the row). SpecForge tokenizes its prompts itself and needs nothing here.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import List, Optional

from sglang_hs.tools.convert import DEFAULT_MASK_RULE, _fresh, write_speculators_index
from sglang_hs.tools.masks import apply_mask_rule, separator_ids, truncate
from sglang_hs.tools.records import RecordError, iter_records, sample_id, to_sample


@dataclasses.dataclass
class IndexReport:
    dest: str
    rows: int
    tokens: int
    rule: str
    skipped: List[str] = dataclasses.field(default_factory=list)  # records that are not samples, and why

    def lines(self, model_path: str, aux_layer_ids: Optional[List[int]] = None) -> List[str]:
        out = [f"{self.rows} rows, {self.tokens} tokens, loss mask {self.rule} -> {self.dest}"]
        out += [f"skipped: {s}" for s in self.skipped[:10]]
        ids = f" --target-layer-ids {' '.join(map(str, aux_layer_ids))}" if aux_layer_ids else ""
        out.append(f"train: python -m speculators.train --data-path {self.dest} --verifier-name-or-path {model_path} "
                   f"--vllm-endpoint http://SERVER:PORT/v1 --hidden-states-backend BACKEND{ids} --draft-vocab-size N")
        return out


def speculators_index(data: str, model_path: str, dest: str, rule: Optional[str] = None,
                      max_length: Optional[int] = None, trust_remote_code: bool = False) -> IndexReport:
    """Rows in the records' order; a record that cannot be a sample is skipped and named."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    rule = rule or DEFAULT_MASK_RULE["speculators"]
    is_sep = separator_ids(tok)
    rep = IndexReport(dest, 0, 0, rule)
    rows = []
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
        rep.tokens += len(ids)
    _fresh(dest)
    write_speculators_index(dest, rows)
    rep.rows = len(rows)
    with open(os.path.join(dest, "sglang_hs_index.json"), "w") as f:
        json.dump({"layout": "speculators-online", "data": os.path.abspath(data), "model_path": model_path,
                   "loss_mask_rule": rule, "max_length": max_length, "rows": rep.rows}, f, indent=1)
    return rep
