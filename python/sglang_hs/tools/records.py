"""Dataset records in the formats people have, turned into (id, token ids, loss mask).

Accepted per record (JSONL line or a row of a Hugging Face dataset saved with save_to_disk):
- OpenAI chat: {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}
- ShareGPT: {"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}
- plain: {"prompt": ..., "completion"|"response": ...} (a user turn and an assistant turn),
  or {"text": ...} (raw text, no template, no mask)
- pre-tokenized: {"input_ids": [...], "loss_mask": [...]?}
An "id" field, if present, becomes part of the sample id.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from typing import Iterator, List, Optional, Union

from sglang_hs.tools.masks import chat_ids_and_mask

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}


class RecordError(ValueError):
    pass


@dataclasses.dataclass
class Sample:
    id: str
    input_ids: List[int]
    loss_mask: Optional[List[int]]
    messages: Optional[List[dict]] = None  # kept for --regenerate


def iter_records(path: str) -> Iterator[Union[dict, RecordError]]:
    """JSONL file, or a folder written by `datasets.Dataset.save_to_disk`. A line that is not
    JSON comes as a RecordError in its place, so one bad line fails one record, not the run."""
    if os.path.isdir(path):
        from datasets import load_from_disk

        ds = load_from_disk(path)
        if hasattr(ds, "keys") and not hasattr(ds, "column_names"):  # a DatasetDict
            ds = ds[sorted(ds.keys())[0]]
        yield from ds
        return
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    yield RecordError(f"{path}:{n}: not JSON ({e})")


def to_messages(rec: dict) -> Optional[List[dict]]:
    if rec.get("messages"):
        return [{"role": m["role"], "content": m.get("content") or ""} for m in rec["messages"]]
    if rec.get("conversations"):
        out = []
        for m in rec["conversations"]:
            role = SHAREGPT_ROLES.get(str(m.get("from", "")).lower())
            if role is None:
                raise RecordError(f"unknown ShareGPT speaker {m.get('from')!r}")
            out.append({"role": role, "content": m.get("value") or ""})
        return out
    if rec.get("prompt") is not None:
        msgs = [{"role": "user", "content": rec["prompt"]}]
        answer = rec.get("completion", rec.get("response"))
        if answer is not None:
            msgs.append({"role": "assistant", "content": answer})
        return msgs
    return None


_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def sample_id(prefix: str, index: int, rec: dict) -> str:
    """Stable across reruns: position in the dataset plus a hash of the record's content."""
    h = hashlib.sha1(json.dumps(rec, sort_keys=True, default=str).encode()).hexdigest()[:10]
    # A sample id must start with a letter or digit (format.check_sample_id).
    own = _SAFE.sub("_", str(rec["id"]))[:60].lstrip("._-") if rec.get("id") is not None else ""
    return f"{prefix}{own + '-' if own else ''}{index:08d}-{h}"


def to_sample(tok, rec: dict, sid: str, last_turn_only: bool = False, mask_reasoning: bool = False) -> Sample:
    if rec.get("input_ids") is not None:
        ids = [int(x) for x in rec["input_ids"]]
        mask = rec.get("loss_mask")
        if mask is not None and len(mask) != len(ids):
            raise RecordError(f"loss_mask has {len(mask)} entries for {len(ids)} input_ids")
        return Sample(sid, ids, [int(x) for x in mask] if mask is not None else None)
    msgs = to_messages(rec)
    if msgs is not None:
        ids, mask = chat_ids_and_mask(tok, msgs, last_turn_only=last_turn_only, mask_reasoning=mask_reasoning)
        return Sample(sid, ids, mask, msgs)
    if rec.get("text") is not None:
        return Sample(sid, list(tok(rec["text"], add_special_tokens=True)["input_ids"]), None)
    raise RecordError(f"record has none of messages, conversations, prompt, text, input_ids: keys {sorted(rec)}")
