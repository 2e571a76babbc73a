import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_hs.format import check_sample_id
from sglang_hs.tools.records import RecordError, iter_records, sample_id, to_messages, to_sample


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def test_every_input_format(tok):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    a = to_sample(tok, {"messages": msgs}, "a")
    b = to_sample(tok, {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}, "b")
    c = to_sample(tok, {"prompt": "Hi", "completion": "Hello."}, "c")
    assert a.input_ids == b.input_ids == c.input_ids and a.loss_mask == b.loss_mask == c.loss_mask
    assert sum(a.loss_mask) > 0 and a.loss_mask[0] == 0
    t = to_sample(tok, {"text": "plain words"}, "t")
    assert t.input_ids == tok("plain words")["input_ids"] and t.loss_mask is None
    p = to_sample(tok, {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, "p")
    assert p.input_ids == [5, 6, 7] and p.loss_mask == [0, 1, 1]
    with pytest.raises(RecordError):
        to_sample(tok, {"input_ids": [5, 6], "loss_mask": [1]}, "x")
    with pytest.raises(RecordError):
        to_sample(tok, {"nothing": 1}, "x")
    with pytest.raises(RecordError):
        to_messages({"conversations": [{"from": "robot", "value": "?"}]})


def test_sample_ids_are_stable_safe_and_content_addressed():
    rec = {"id": "weird/../id", "messages": [{"role": "user", "content": "x"}]}
    a, b = sample_id("p-", 7, rec), sample_id("p-", 7, dict(rec))
    assert a == b and check_sample_id(a) == a
    assert sample_id("p-", 7, {**rec, "messages": []}) != a and sample_id("p-", 8, rec) != a


@given(own=st.one_of(st.none(), st.text(max_size=300), st.integers()), index=st.integers(0, 10**9))
def test_every_record_id_gives_a_sample_id_the_server_accepts(own, index):
    sid = sample_id("", index, {"id": own, "text": "x"})
    assert check_sample_id(sid) == sid


def test_hf_dataset_on_disk(tmp_path):
    from datasets import Dataset

    Dataset.from_list([{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "d"}]).save_to_disk(
        str(tmp_path / "ds"))
    assert [r["prompt"] for r in iter_records(str(tmp_path / "ds"))] == ["a", "c"]


def test_bundled_200_conversations_all_convert(tok):
    from importlib import resources

    path = str(resources.files("sglang_hs").joinpath("data/chats_200.jsonl"))
    samples = [to_sample(tok, r, sample_id("", i, r)) for i, r in enumerate(iter_records(path))]
    assert len(samples) == 200 and len({s.id for s in samples}) == 200
    assert all(s.loss_mask is None or any(s.loss_mask) for s in samples)
