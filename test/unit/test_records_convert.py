import json
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from sglang_hs.convert import ExportDataset, inspect_export, to_specforge, to_speculators
from sglang_hs.format import check_sample_id, write_export_json
from sglang_hs.records import RecordError, iter_records, sample_id, to_messages, to_sample
from sglang_hs.writer import SampleWriter, SlabPool
from test_writer import complete_state

H, K = 8, 3


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


def export_dir(tmp_path, n=3, norm_w=None):
    d = str(tmp_path / "export")
    os.makedirs(d)
    write_export_json(d, {"format": "sglang-hs/1", "model_path": str(tmp_path / "model"), "architecture": "X",
                          "hidden_size": H, "num_layers": 10, "dtype": "bfloat16", "aux_layer_ids": [2, 5, 7],
                          "final_is_post_norm": True})
    w = SampleWriter(d, "dp0", [2, 5, 7], SlabPool(1 << 20, slab_bytes=1 << 12), lambda m: None)
    for i in range(n):
        st = complete_state(f"s{i}", 4 + i, loss_mask=[0] + [1] * (3 + i))
        if norm_w is not None:  # a final plane that really is RMSNorm(h) * w, as the model makes it
            h = torch.randn(4 + i, H) * 3
            normed = (norm_w * h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
            a = 0
            for c in st.chunks:
                c.final.copy_(normed[a:a + c.rows])
                a += c.rows
        w.submit(st, lambda: False)
    w.close()
    return d


def test_dataset_and_specforge_round_trip(tmp_path):
    d = export_dir(tmp_path)
    ds = ExportDataset(d)
    assert len(ds) == 3
    n = to_specforge(d, str(tmp_path / "sf"))
    assert n == 3
    for i in range(3):
        t = ds[i]
        rec = torch.load(tmp_path / "sf" / "rows_0-2000" / f"data_{i}.ckpt", weights_only=True)
        T = t["token_ids"].shape[0]
        assert set(rec) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        assert rec["input_ids"].dtype == torch.int64 and rec["input_ids"].tolist() == t["token_ids"].tolist()
        assert rec["loss_mask"].tolist() == t["loss_mask"].tolist()
        assert rec["hidden_state"].shape == (1, T, H) and rec["aux_hidden_state"].shape == (1, T, K * H)
        assert torch.equal(rec["hidden_state"][0], t["final_hidden_states"])
        assert torch.equal(rec["aux_hidden_state"].view(T, K, H), t["aux_hidden_states"])


def test_speculators_last_layer_renormalizes_to_the_exported_final(tmp_path):
    w = torch.rand(H) + 0.5
    d = export_dir(tmp_path, norm_w=w)
    os.makedirs(tmp_path / "model")
    save_file({"model.norm.weight": w}, str(tmp_path / "model" / "model.safetensors"))
    assert to_speculators(d, str(tmp_path / "spec")) == 3
    ds = ExportDataset(d)
    for i in range(3):
        t, s = ds[i], load_file(str(tmp_path / "spec" / f"hs_{i}.safetensors"))
        assert s["hidden_states"].shape == (t["token_ids"].shape[0], K + 1, H)
        assert torch.equal(s["hidden_states"][:, :K], t["aux_hidden_states"])
        assert s["token_ids"].tolist() == t["token_ids"].tolist()
        x = s["hidden_states"][:, K].float()  # what speculators normalizes itself
        renormed = w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        torch.testing.assert_close(renormed, t["final_hidden_states"].float(), rtol=2e-2, atol=2e-2)


def test_inspect(tmp_path):
    d = export_dir(tmp_path)
    with open(os.path.join(d, "capture_failed.jsonl"), "w") as f:
        f.write(json.dumps({"id": "bad-1", "error": "x"}) + "\n")
    r = inspect_export(d)
    assert r["samples"] == 3 and r["tokens"] == 4 + 5 + 6 and r["bytes"] > 0
    assert r["aux_layer_ids"] == [2, 5, 7] and r["failed_ids"] == ["bad-1"]
    assert r["length_histogram"] == {"1-127": 3}
