"""Loss masks from chat templates, checked against hand-built expectations: each expected
conversation is written out as (text, mask) segments in the family's markup, tokenized piece by
piece, and must equal what chat_ids_and_mask derives from the template alone."""

import copy

import pytest

from sglang_hs.tools.masks import chat_ids_and_mask, prompt_ids, truncate

NL = "\\n"
# Our own renditions of each family's chat markup (the real templates have more options).
LLAMA3 = ("{{ '<|begin_of_text|>' }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
          "'<|end_header_id|>" + NL + NL + "' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>" + NL + NL + "' }}{% endif %}")
QWEN25 = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system" + NL + "You are Qwen.<|im_end|>" + NL + "' }}"
          "{% endif %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '" + NL + "' + m['content'] + '<|im_end|>"
          + NL + "' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant" + NL + "' }}{% endif %}")
# Qwen 3 drops the reasoning of assistant turns before the last user turn.
QWEN3 = ("{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
         "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
         "{% for m in messages %}{% set c = m['content'] %}{% if m['role'] == 'assistant' and loop.index0 < ns.last "
         "and '</think>' in c %}{% set c = c.split('</think>')[-1].lstrip() %}{% endif %}"
         "{{ '<|im_start|>' + m['role'] + '" + NL + "' + c + '<|im_end|>" + NL + "' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant" + NL + "' }}{% endif %}")
DEEPSEEK_V3 = ("{{ '<｜begin▁of▁sentence｜>' }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
               "{% elif m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}{% else %}"
               "{{ '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}")
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>",
            "<|im_end|>", "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"]

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6, of course."},
]


@pytest.fixture(scope="module")
def base_tok(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    return tok


def with_template(tok, template):
    t = copy.deepcopy(tok)
    t.chat_template = template
    return t


def expected(tok, segments):
    """Tokens of the hand-written conversation; each token's bit is that of the segment it
    starts in (tokenizing piece by piece would split "\n\n4" differently than in context)."""
    text = "".join(t for t, _ in segments)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    bounds, pos = [], 0
    for t, bit in segments:
        bounds.append((pos, pos + len(t), bit))
        pos += len(t)
    mask = [next(bit for a, b, bit in bounds if a <= s < b) for s, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def test_chatml_smollm2_real_template(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)  # SmolLM2's own template (ChatML)
    ids, mask = chat_ids_and_mask(tok, CONV)
    assert (ids, mask) == expected(tok, [
        ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("4.<|im_end|>", 1), ("\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("6, of course.<|im_end|>", 1), ("\n", 0)])


def test_llama3(base_tok):
    tok = with_template(base_tok, LLAMA3)
    h = "<|start_header_id|>{}<|end_header_id|>\n\n"
    assert chat_ids_and_mask(tok, CONV) == expected(tok, [
        ("<|begin_of_text|>" + h.format("system") + "Be brief.<|eot_id|>" + h.format("user") + "What is 2+2?<|eot_id|>"
         + h.format("assistant"), 0), ("4.<|eot_id|>", 1),
        (h.format("user") + "And 3+3?<|eot_id|>" + h.format("assistant"), 0), ("6, of course.<|eot_id|>", 1)])


def test_qwen25_default_system_prompt_and_last_turn_only(base_tok):
    tok = with_template(base_tok, QWEN25)
    conv = CONV[1:]  # no system turn: the template adds its own
    segs = [("<|im_start|>system\nYou are Qwen.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
             "<|im_start|>assistant\n", 0), ("4.<|im_end|>", 1),
            ("\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n", 0), ("6, of course.<|im_end|>", 1),
            ("\n", 0)]
    assert chat_ids_and_mask(tok, conv) == expected(tok, segs)
    segs[1] = ("4.<|im_end|>", 0)
    assert chat_ids_and_mask(tok, conv, last_turn_only=True) == expected(tok, segs)


def test_deepseek_v3_kimi_k2(base_tok):
    tok = with_template(base_tok, DEEPSEEK_V3)
    assert chat_ids_and_mask(tok, CONV) == expected(tok, [
        ("<｜begin▁of▁sentence｜>Be brief.<｜User｜>What is 2+2?<｜Assistant｜>", 0), ("4.<｜end▁of▁sentence｜>", 1),
        ("<｜User｜>And 3+3?<｜Assistant｜>", 0), ("6, of course.<｜end▁of▁sentence｜>", 1)])


def test_qwen3_reasoning_kept_or_masked_and_history_rewritten(base_tok):
    tok = with_template(base_tok, QWEN3)
    conv = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>greet back</think>Hello."},
            {"role": "user", "content": "Sum 1+1"},
            {"role": "assistant", "content": "<think>easy</think>2."}]
    pre = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    mid = "\n<|im_start|>user\nSum 1+1<|im_end|>\n<|im_start|>assistant\n"
    # The template drops the first turn's reasoning; the last turn keeps it.
    assert chat_ids_and_mask(tok, conv) == expected(tok, [
        (pre, 0), ("Hello.<|im_end|>", 1), (mid, 0), ("<think>easy</think>2.<|im_end|>", 1), ("\n", 0)])
    assert chat_ids_and_mask(tok, conv, mask_reasoning=True) == expected(tok, [
        (pre, 0), ("Hello.<|im_end|>", 1), (mid, 0), ("<think>easy</think>", 0), ("2.<|im_end|>", 1), ("\n", 0)])


def test_truncation_keeps_the_first_tokens():
    assert truncate([1, 2, 3, 4], [0, 1, 1, 1], 3) == ([1, 2, 3], [0, 1, 1])
    assert truncate([1, 2], None, 3) == ([1, 2], None)


# --- Trainer conventions (apply_mask_rule), against the trainers' own mask code -----------------

from hypothesis import given, settings, strategies as hs  # noqa: E402

from sglang_hs.tools.masks import MASK_RULES, apply_mask_rule, separator_ids  # noqa: E402


@settings(max_examples=300, deadline=None, derandomize=True)
@given(hs.lists(hs.tuples(hs.integers(0, 5), hs.booleans()), max_size=60))
def test_mask_rules_only_add_separators_after_turns_and_last_turn_keeps_one_run(spec):
    ids = [t for t, _ in spec]
    mask = [int(m) for _, m in spec]
    is_sep = lambda t: t == 0  # noqa: E731 - token 0 plays the newline
    assert apply_mask_rule(ids, mask, "captured", is_sep) == mask
    turns = apply_mask_rule(ids, mask, "turns+separator", is_sep)
    last = apply_mask_rule(ids, mask, "last-turn+separator", is_sep)
    for i, (m, t) in enumerate(zip(turns, mask)):
        if m != t:  # every added position is a separator right after a run of the captured mask
            assert t == 0 and m == 1 and ids[i] == 0 and i > 0 and mask[i - 1] == 1
    assert all(a <= b for a, b in zip(last, turns))  # last turn: a part of the turns mask
    runs = sum(1 for i, m in enumerate(last) if m and (i == 0 or not last[i - 1]))
    assert runs == (1 if any(mask) else 0)
    if any(mask):  # and that part ends where the captured mask's last run (plus separator) ends
        end = max(i for i, m in enumerate(turns) if m)
        assert last[end] == 1 and not any(last[end + 1:])


def test_unknown_rule_is_refused():
    with pytest.raises(ValueError, match="captured, turns"):
        apply_mask_rule([1], [1], "all", lambda t: False)


MULTI = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris. It has been the capital since 987."},
    {"role": "user", "content": "And of Italy?\nAnswer in one word."},
    {"role": "assistant", "content": "Rome.\n\nSince 1871."},
]


def test_turns_plus_separator_is_specforge_0_2_0s_own_mask(smollm2_path, trainers):
    """SpecForge's chat parser (its `qwen` ChatML template, the one for SmolLM2's markup) on the
    same conversation gives the same tokens and exactly the mask our rule derives from ours."""
    from specforge.data.parse import GeneralParser
    from specforge.data.template import TEMPLATE_REGISTRY
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ids, mask = chat_ids_and_mask(tok, MULTI)
    theirs_ids, theirs_mask = GeneralParser(tok, TEMPLATE_REGISTRY.get("qwen")).parse(MULTI, max_length=4096)
    assert theirs_ids.tolist() == ids
    ours = apply_mask_rule(ids, mask, "turns+separator", separator_ids(tok))
    assert ours == theirs_mask.tolist() and ours != mask


def test_last_turn_plus_separator_is_speculators_0_9_0s_own_mask(smollm2_path, trainers, monkeypatch):
    """speculators' prepare-data derives its mask from renders of the conversation (through a
    vLLM render endpoint); with that render done by the tokenizer's own template, its row for
    the last assistant turn is our sample, with exactly the mask our rule derives."""
    from speculators.data_generation import preprocessing
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)

    def render(conv, endpoint, *, add_generation_prompt, max_length, tools=None):
        return list(tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=add_generation_prompt,
                                            return_dict=True)["input_ids"])[:max_length]

    monkeypatch.setattr(preprocessing, "_encode_render", render)
    rows = preprocessing._render_boundary_rows(MULTI, "local", 4096)
    ids, mask = chat_ids_and_mask(tok, MULTI)
    assert rows[-1]["input_ids"] == ids
    ours = apply_mask_rule(ids, mask, "last-turn+separator", separator_ids(tok))
    assert ours == rows[-1]["loss_mask"] and ours != mask


@pytest.mark.parametrize("template", [None, LLAMA3, QWEN25, DEEPSEEK_V3], ids=["smollm2", "llama3", "qwen25", "deepseek_v3"])
def test_prompt_ids_are_the_tokens_of_the_rendered_prompt(base_tok, template):
    """What a server is sent to write the next assistant turn: the rendered template with its
    generation prompt, as token ids (e2e_eagle3 once sent a BatchEncoding's keys instead)."""
    tok = with_template(base_tok, template) if template else base_tok
    msgs = CONV[:4]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = prompt_ids(tok, msgs)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert all(isinstance(i, int) for i in ids)


@pytest.mark.parametrize("template", [None, LLAMA3, QWEN25, QWEN3, DEEPSEEK_V3])
@pytest.mark.parametrize("last_turn_only", [False, True])
def test_the_prompt_of_the_last_answer_is_the_start_of_the_whole_conversation(base_tok, smollm2_path, template,
                                                                               last_turn_only):
    """One-pass --regenerate sends the prompt of the last answer with its mask and appends
    what the model writes: on every family's markup its tokens and mask are those the whole
    conversation has there (as the two-pass export renders it), except that whitespace ending
    the prompt may merge with the answer's first token when the whole text is tokenized."""
    from transformers import AutoTokenizer

    from sglang_hs.tools.masks import answer_prompt_and_mask

    tok = AutoTokenizer.from_pretrained(smollm2_path) if template is None else with_template(base_tok, template)
    ids, mask = answer_prompt_and_mask(tok, CONV[:-1], last_turn_only)
    full, full_mask = chat_ids_and_mask(tok, CONV, last_turn_only)
    assert ids == prompt_ids(tok, CONV[:-1])
    k = next((i for i, (x, y) in enumerate(zip(ids, full)) if x != y), len(ids))
    assert full_mask[:k] == mask[:k] and not any(mask[k:])
    assert tok.decode(ids[k:]).strip() == "", f"tokens differ before the prompt's final whitespace: {ids[k:]}"
    assert any(mask) != last_turn_only


def test_a_template_that_renders_history_otherwise_with_the_generation_prompt_is_refused(base_tok):
    from sglang_hs.tools.masks import TemplateError, answer_prompt_and_mask

    odd = QWEN25.replace("{% endif %}{% for m", "{% endif %}{% if not add_generation_prompt %}x{% endif %}{% for m")
    with pytest.raises(TemplateError, match="--regenerate-passes 2"):
        answer_prompt_and_mask(with_template(base_tok, odd), CONV[:-1])
