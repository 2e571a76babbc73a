"""Token ids and loss masks from the model's own chat template.

The mask is 1 on what the assistant produces (its content and the template's end-of-turn
marker, which the model must learn to emit) and 0 on system/user turns and on the assistant
header. Spans are found in the rendered text, then mapped to tokens by their offsets:

- where the template renders each turn as a prefix of the whole conversation (ChatML as in
  SmolLM2 and Qwen 2.5, Llama 3, DeepSeek V3 / Kimi K2), an assistant turn spans from the end
  of "conversation so far + generation prompt" to the end of "conversation so far + the turn";
- where it rewrites earlier turns (Qwen 3 drops the reasoning of past turns), the turn's
  content is located in the rendered text, plus the special token that closes it.
"""

from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple

THINK = re.compile(r"<think>.*?</think>", re.S)


class TemplateError(ValueError):
    pass


def prompt_ids(tok, messages) -> List[int]:
    """The token ids a server is sent to write the next assistant turn: `messages` in the chat
    template, then its generation prompt. transformers 5 returns a BatchEncoding, a Mapping
    but not a dict (list() of it gives its keys), so the ids are read from it by name."""
    return list(tok.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True,
                                        return_dict=True)["input_ids"])


def _text(tok, messages, add_generation_prompt: bool, **kw) -> str:
    return tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **kw)


def _assistant_spans(tok, messages, text: str, turns: List[int], **kw) -> List[Tuple[int, int]]:
    spans = []
    cursor = 0
    specials = sorted(set(tok.all_special_tokens) | set(getattr(tok, "added_tokens_encoder", {})), key=len,
                      reverse=True)
    for i in turns:
        upto = _text(tok, messages[: i + 1], False, **kw)
        if text.startswith(upto):
            start = len(_text(tok, messages[:i], True, **kw))
            end = len(upto.rstrip("\n"))  # the turn's closing marker, not the newline after it
            spans.append((start, end))
            cursor = end
            continue
        content = str(messages[i].get("content") or "")
        for candidate in (content.strip(), THINK.sub("", content).strip()):
            at = text.find(candidate, cursor) if candidate else -1
            if at >= 0:
                end = at + len(candidate)
                rest = text[end:].lstrip(" ")
                closing = next((s for s in specials if rest.startswith(s)), "")
                end = len(text) - len(rest) + len(closing) if closing else end
                spans.append((at, end))
                cursor = end
                break
        else:
            raise TemplateError(f"cannot find assistant turn {i} in the rendered conversation; "
                                "pass pre-tokenized input_ids with your own loss_mask")
    return spans


def chat_ids_and_mask(tok, messages: Sequence[dict], last_turn_only: bool = False,
                      mask_reasoning: bool = False, **template_kwargs) -> Tuple[List[int], List[int]]:
    """(token ids of the whole conversation, loss mask of the same length).

    last_turn_only: only the final assistant turn is trained on.
    mask_reasoning: `<think>...</think>` spans inside assistant turns get mask 0 (they stay
    in the tokens unless the template itself drops them).
    """
    messages = [dict(m) for m in messages]
    text = _text(tok, messages, False, **template_kwargs)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if last_turn_only:
        turns = turns[-1:]
    spans = _assistant_spans(tok, messages, text, turns, **template_kwargs)
    holes = [m.span() for a, b in spans for m in THINK.finditer(text, a, b)] if mask_reasoning else []

    def inside(pos, ranges):
        return any(a <= pos < b for a, b in ranges)

    mask = [int(inside(s, spans) and not inside(s, holes)) for s, _ in offsets]
    return ids, mask


def answer_prompt_and_mask(tok, messages: Sequence[dict], last_turn_only: bool = False,
                           mask_reasoning: bool = False) -> Tuple[List[int], List[int]]:
    """(the prompt a server is sent to write the next assistant turn, its loss mask): the
    earlier assistant turns as chat_ids_and_mask marks them (none with last_turn_only, since
    the turn to come is the last), 0 on the generation prompt."""
    ids = prompt_ids(tok, messages)
    if last_turn_only or not any(m["role"] == "assistant" for m in messages):
        return ids, [0] * len(ids)
    history, mask = chat_ids_and_mask(tok, messages, False, mask_reasoning)
    if ids[: len(history)] != history:
        raise TemplateError("the chat template renders the conversation differently when it adds the generation "
                            "prompt, so its loss mask cannot be read off; use --regenerate-passes 2")
    return ids, mask + [0] * (len(ids) - len(history))


def truncate(ids: List[int], mask: Optional[List[int]], max_length: Optional[int]):
    """The truncation policy of `sglang-hs capture --max-length`: keep the first max_length
    tokens (system prompt and earliest turns), cut the rest."""
    if max_length is None or len(ids) <= max_length:
        return ids, mask
    return ids[:max_length], (mask[:max_length] if mask is not None else None)


# Loss-mask conventions a converter can write. `capture` marks each assistant turn's content
# and its end-of-turn marker. SpecForge 0.2.0's chat parser (GeneralParser) also marks the
# separator the template puts after the marker (ChatML's "\n" after <|im_end|>); speculators
# 0.9.0's prepare-data marks, per row, the last assistant turn from its start to the end of
# the rendered conversation (which includes that separator), and nothing before it.
MASK_RULES = ("captured", "turns+separator", "last-turn+separator")


def separator_ids(tok) -> Callable[[int], bool]:
    """Whether a token is a template separator: it decodes to whitespace holding a newline."""
    cache: Dict[int, bool] = {}

    def is_sep(t: int) -> bool:
        if t not in cache:
            s = tok.decode([t])
            cache[t] = bool(s) and not s.strip() and "\n" in s
        return cache[t]

    return is_sep


def apply_mask_rule(ids: Sequence[int], mask: Sequence[int], rule: str,
                    is_separator: Callable[[int], bool]) -> List[int]:
    """A `capture` mask rewritten to a trainer's convention (MASK_RULES)."""
    if rule not in MASK_RULES:
        raise ValueError(f"unknown loss-mask rule {rule!r}: use one of {', '.join(MASK_RULES)}")
    out = [int(m) for m in mask]
    if rule == "captured":
        return out
    runs = []  # [start, end) of each run of ones
    for i, m in enumerate(out):
        if m and (i == 0 or not out[i - 1]):
            runs.append([i, i + 1])
        elif m:
            runs[-1][1] = i + 1
    if rule == "last-turn+separator" and runs:
        out = [0] * len(out)
        runs = runs[-1:]
        out[runs[0][0]:runs[0][1]] = [1] * (runs[0][1] - runs[0][0])
    for _, end in runs:
        if end < len(out) and is_separator(ids[end]):
            out[end] = 1
    return out
