"""Converters, read back by the trainers' own loaders (SpecForge 0.2.0, speculators 0.9.0).

The export under test holds Hugging Face transformers' states of the tiny SmolLM2-vocabulary
Llama for real chats, written by our writer with the provenance `capture` attaches; the
trainers' loaders must give back exactly those tensors and the masks of their own rules."""

import argparse
import dataclasses
import json
import os
import pathlib

import pytest
import torch
from hypothesis import given, settings, strategies as hs

from safetensors.torch import load_file

from harness.fixtures import write_test_export_json
from sglang_hs.format import PROVENANCE_KEY, CaptureProvenance, chat_template_sha256
from sglang_hs.format import Storage, read_export_json
from sglang_hs.overlay.rows import RequestState, plan_forward, split_rows, storage_planes
from sglang_hs.overlay.staging import Piece, SlabPool
from sglang_hs.overlay.sinks import DirectorySink
from sglang_hs.overlay.writer import SampleWriter
from sglang_hs.protocol import RequestOptions
from sglang_hs.tools.convert import (ConvertOptions, ExportDataset, dataset_order, inspect_export, to_specforge,
                                     to_speculators)
from sglang_hs.tools.masks import apply_mask_rule, chat_ids_and_mask, separator_ids
from sglang_hs.tools.records import sample_id
from sglang_hs.tools.verify import hf_planes, load_hf

LAYERS = [2, 4, 6]
CHATS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Count to {n}."},
     {"role": "assistant", "content": " ".join(str(i) for i in range(1, n + 1)) + "."},
     {"role": "user", "content": "Again, backwards?"},
     {"role": "assistant", "content": " ".join(str(i) for i in range(n, 0, -1)) + "!"}]
    for n in (3, 7, 12, 5)
]


def write_sample(w, rid, planes, ids, mask, metadata):
    """One request's rows, arriving in two forwards, as the runtime hands them to the writer
    (stored the writer's way: bf16, or fp8 with scales)."""
    st = RequestState(rid=rid, prompt_ids=ids, options=RequestOptions(loss_mask=mask, metadata=metadata,
                                                                       call_id=f"c-{rid}"))
    n = len(ids)
    for start, end in ((0, n // 2), (n // 2, n)):
        segs, _ = plan_forward([st], [start], [end - start])
        p = planes[start:end].bfloat16()
        stored = storage_planes(p[:, :-1].contiguous(), p[:, -1].contiguous(), w.storage)
        piece = Piece(stored[0], stored[1], None, *stored[2:])
        split_rows([piece], segs)
        piece.release()
    w.submit(st, lambda: False)


def write_export(tiny_path, d, storage=Storage()):
    """The tiny model's HF fp32 states for CHATS (plus one pre-tokenized record with its own
    mask), written in an order other than the dataset's, as completion order would be."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_path)
    model = load_hf(tiny_path, torch.float32)
    os.makedirs(d)
    write_test_export_json(d, 64, aux_layer_ids=LAYERS, model_path=tiny_path, num_layers=8,
                           export_dtype=storage.dtype, final_rows=storage.final_rows)
    w = SampleWriter(DirectorySink(d, "dp0", LAYERS, storage), SlabPool(1 << 24, slab_bytes=1 << 16), lambda m: None)
    records = [{"messages": c} for c in CHATS] + [{"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 0]}]
    samples = {}
    for i, rec in enumerate(records):
        ids, mask = chat_ids_and_mask(tok, rec["messages"]) if "messages" in rec else (rec["input_ids"],
                                                                                    rec["loss_mask"])
        prov = CaptureProvenance(source="chats.jsonl", tokenizer=tiny_path,
                                 chat_template_sha256=chat_template_sha256(tok.chat_template),
                                 mask_policy="template" if "messages" in rec else "given", last_turn_only=False,
                                 mask_reasoning=False, max_length=None, truncated=False, regenerated=False,
                                 sglang_hs_version="test")
        samples[sample_id("", i, rec)] = (ids, mask, rec)
        planes = hf_planes(model, torch.tensor(ids), LAYERS)
        samples[sample_id("", i, rec)] += (planes,)
        meta = {PROVENANCE_KEY: dataclasses.asdict(prov)}
        if i == 0:
            first = (sample_id("", i, rec), planes, ids, mask, meta)
            continue
        write_sample(w, sample_id("", i, rec), planes, ids, mask, meta)
    write_sample(w, *first)  # dataset position 0 completes last
    w.close()
    return d, samples, tok


@pytest.fixture(scope="module")
def export(tiny_path, tmp_path_factory):
    return write_export(tiny_path, str(tmp_path_factory.mktemp("convert") / "export"))


@pytest.fixture(scope="module")
def fp8_loss_export(tiny_path, tmp_path_factory):
    return write_export(tiny_path, str(tmp_path_factory.mktemp("convert") / "fp8"), Storage("fp8_e4m3", "loss"))


def expected_mask(tok, entry, rule):
    ids, mask, rec, _ = entry
    if "messages" not in rec:
        return mask  # a given mask is the user's, never rewritten
    return apply_mask_rule(ids, mask, rule, separator_ids(tok))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(hs.lists(hs.integers(0, 10**6), unique=True, max_size=30), hs.randoms())
def test_dataset_order_is_the_position_in_the_sample_id(positions, rnd):
    ids = [f"run-{p:08d}-{p % 97:010x}" for p in positions] + ["zz-other", "aa-other"]
    rnd.shuffle(ids)
    ordered = [ids[i] for i in dataset_order(ids)]
    assert ordered == [f"run-{p:08d}-{p % 97:010x}" for p in sorted(positions)] + ["aa-other", "zz-other"]


def test_dataset_is_in_dataset_order_not_completion_order(export):
    d, samples, _ = export
    manifest_first = json.loads(open(os.path.join(d, "manifest.jsonl")).readline())["id"]
    ds = ExportDataset(d)
    assert [e["id"] for e in ds.entries] == list(samples) and manifest_first != list(samples)[0]


def test_specforge_0_2_0_reads_our_folder_with_its_own_loader(export, trainers, tmp_path, tiny_path, monkeypatch):
    """Its eagle3 offline reader (file checks on) -> LocalFeatureStore -> FeatureDataLoader,
    with its own per-sample normalizer and collator; its vocabulary count; its config schema;
    its target head, for SmolLM2's tied embeddings."""
    from specforge.algorithms.eagle3.data import (build_offline_collator, build_offline_normalizer,
                                                  build_offline_reader)
    from specforge.config.schema import Config
    from specforge.modeling.target.target_head import TargetHead
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    d, samples, tok = export
    dest = str(tmp_path / "sf")
    rep = to_specforge(d, dest)
    assert rep.samples == len(samples) and rep.remasked == len(CHATS) and rep.kept == {"mask given": 1}
    monkeypatch.setenv("SPECFORGE_VALIDATE_OFFLINE_FEATURES", "1")
    refs = build_offline_reader(dest, run_id="t", ttt_length=7, max_len=4096).read()
    assert len(refs) == len(samples)
    loader = FeatureDataLoader(LocalFeatureStore("t"), refs=refs, batch_size=1,
                               per_sample_transform=build_offline_normalizer(4096),
                               collate_fn=build_offline_collator(), drop_last=False)
    by_ids = {tuple(e[0]): e for e in samples.values()}
    seen = 0
    for tb in loader:
        batch = tb.tensors
        ids = batch["input_ids"][0].tolist()
        entry = by_ids[tuple(ids)]
        planes = entry[3]
        T = len(ids)
        assert batch["hidden_state"].shape == (1, T, 3 * 64) and batch["hidden_state"].dtype == torch.bfloat16
        assert torch.equal(batch["hidden_state"][0].view(T, 3, 64), planes[:, :3].bfloat16())
        assert torch.equal(batch["target"][0], planes[:, 3].bfloat16())
        want = expected_mask(tok, entry, "turns+separator")
        want[-1] = 0  # SpecForge's normalizer never trains the last position
        assert batch["loss_mask"][0].tolist() == want
        seen += 1
    assert seen == len(samples)
    counts = count_effective_feature_tokens(dest, max_length=4096, target_vocab_size=49152)
    want = {}
    for entry in samples.values():
        for t, m in zip(entry[0], expected_mask(tok, entry, "turns+separator")):
            want[t] = want.get(t, 0) + m
    assert dict(counts) == {t: n for t, n in want.items() if n}
    cfg = Config.from_file(os.path.join(dest, "specforge.yaml"))
    assert cfg.data.hidden_states_path == os.path.abspath(dest)
    assert cfg.model.lm_head_key == "model.embed_tokens.weight"  # SmolLM2 ties its lm_head
    head = TargetHead(cfg.model.target_model_path)
    head.load_weights(cfg.model.target_model_path, lm_head_key=cfg.model.lm_head_key)
    emb = load_file(os.path.join(tiny_path, "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(head.fc.weight.data, emb.to(head.fc.weight.dtype))


def test_speculators_0_9_0_trainer_data_path_reads_our_folder_as_is(export, trainers, tmp_path, tiny_path):
    """`--data-path DEST` and nothing else: its ArrowDataset (the trainer's dataset) over our
    datasets folder and hidden_states/, its vocabulary map from our token_freq.pt, and its own
    verifier norm applied to our last plane giving back our post-norm final."""
    from speculators.models.eagle3.model_definitions import model_classes
    from speculators.train.data import ArrowDataset
    from speculators.train.cli import parse_vocab_mappings
    from speculators.train.config import TrainConfig
    from speculators.utils.loading import load_model_layers

    d, samples, tok = export
    dest = str(tmp_path / "spec")
    rep = to_speculators(d, dest)
    assert rep.remasked == len(CHATS) and rep.kept == {"mask given": 1}
    ds = ArrowDataset(max_len=4096, datapath=dest, on_missing="raise")
    assert len(ds) == len(samples)
    norm = model_classes["llama"].norm_class(64, eps=1e-5)
    norm.load_state_dict({"weight": load_model_layers(["model.norm.weight"], tiny_path)["model.norm.weight"]})
    for i, (sid, entry) in enumerate(samples.items()):  # row i is dataset position i
        item = ds[i]
        ids, planes = entry[0], entry[3]
        T = len(ids)
        assert item["input_ids"].tolist() == ids and item["input_ids"].dtype == torch.int64
        assert item["hidden_states"].shape == (T, 3 * 64)
        assert torch.equal(item["hidden_states"], planes[:, :3].bfloat16().reshape(T, -1))
        assert item["loss_mask"].tolist() == expected_mask(tok, entry, "last-turn+separator")
        with torch.no_grad():
            renormed = norm(item["verifier_last_hidden_states"].float())
        torch.testing.assert_close(renormed, planes[:, 3], rtol=2e-2, atol=2e-2)
    freq = torch.load(os.path.join(dest, "token_freq.pt"), weights_only=True)
    want = {}
    for entry in samples.values():
        for t, m in zip(entry[0], expected_mask(tok, entry, "last-turn+separator")):
            if m:
                want[t] = want.get(t, 0) + 1
    assert freq == want
    # The trainer's own command line and vocabulary step: --data-path finds token_freq.pt.
    cfg = TrainConfig.resolve(["--data-path", dest, "--verifier-name-or-path", tiny_path,
                               "--draft-vocab-size", "32"])
    d2t, t2d, size = parse_vocab_mappings(argparse.Namespace(**cfg.flatten()))
    assert size == 32 and d2t.shape == (32,) and int(t2d.sum()) == 32
    # The draft vocabulary is the most frequent loss tokens first: here all of them fit.
    assert len(freq) < 32 and set(freq) <= set(t2d.nonzero().flatten().tolist())


def test_a_rule_can_be_chosen_and_captured_keeps_every_mask(export, tmp_path):
    d, samples, _ = export
    rep = to_specforge(d, str(tmp_path / "sf"), ConvertOptions(loss_mask="captured"))
    assert rep.remasked == 0 and rep.kept == {}
    for i, entry in enumerate(samples.values()):
        rec = torch.load(tmp_path / "sf" / "rows_0-2000" / f"data_{i}.ckpt", weights_only=True)
        assert rec["loss_mask"].tolist() == entry[1]
    with pytest.raises(ValueError, match="unknown loss-mask rule"):
        to_specforge(d, str(tmp_path / "sf2"), ConvertOptions(loss_mask="everything"))
    with pytest.raises(ValueError, match="not empty"):  # stale files would be read as samples
        to_speculators(d, str(tmp_path / "sf"))


def test_inspect(export, tmp_path):
    d, samples, _ = export
    with open(os.path.join(d, "capture_failed.jsonl"), "w") as f:
        f.write(json.dumps({"id": "bad-1", "error": "x"}) + "\n")
    r = inspect_export(d)
    assert r["samples"] == len(samples) and r["tokens"] == sum(len(e[0]) for e in samples.values())
    assert r["aux_layer_ids"] == LAYERS and r["failed_ids"] == ["bad-1"]
    assert r["length_histogram"] == {"1-127": len(samples)}
    ways = {w["mask_policy"]: w for w in r["capture"]["ways"]}
    assert ways["template"]["samples"] == len(CHATS) and ways["given"]["samples"] == 1
    assert ways["template"]["chat_template_sha256"] == chat_template_sha256(export[2].chat_template)
    assert r["capture"]["without_provenance"] == 0 and r["server"]["architecture"] == "LlamaForCausalLM"
    os.remove(os.path.join(d, "capture_failed.jsonl"))


def test_a_float32_export_trains_with_specforges_bf16_target_head(export, trainers, tmp_path, tiny_path):
    """A CPU server run with --dtype float32 exports float32 states; SpecForge 0.2.0's target
    head is bf16 and failed on them (found by benchmark/train_smoke_cpu.py): they are written as
    bf16, and its head takes the loader's target."""
    from specforge.algorithms.eagle3.data import build_offline_normalizer, build_offline_reader
    from specforge.modeling.target.target_head import TargetHead
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    d, samples, _ = export
    d32 = str(tmp_path / "export32")
    os.makedirs(d32)
    write_test_export_json(d32, 64, aux_layer_ids=LAYERS, model_path=tiny_path, num_layers=8)
    info = json.load(open(os.path.join(d32, "export.json")))
    info["dtype"] = "float32"
    json.dump(info, open(os.path.join(d32, "export.json"), "w"))
    sid, (ids, mask, _, planes) = next(iter(samples.items()))
    st = RequestState(rid=sid, prompt_ids=ids, options=RequestOptions(loss_mask=mask, call_id="c"))
    segs, _ = plan_forward([st], [0], [len(ids)])
    piece = Piece(planes[:, :-1].contiguous(), planes[:, -1].contiguous(), None)
    split_rows([piece], segs)
    piece.release()
    w = SampleWriter(DirectorySink(d32, "dp0", LAYERS), SlabPool(1 << 24, slab_bytes=1 << 16), lambda m: None)
    w.submit(st, lambda: False)
    w.close()
    dest = str(tmp_path / "sf32")
    rep = to_specforge(d32, dest)
    assert any("written as bfloat16" in n for n in rep.notes)
    refs = build_offline_reader(dest, run_id="t", ttt_length=7, max_len=4096).read()
    batch = next(iter(FeatureDataLoader(LocalFeatureStore("t"), refs=refs, batch_size=1,
                                        per_sample_transform=build_offline_normalizer(4096)))).tensors
    head = TargetHead(os.path.join(dest, "target_model"))
    head.load_weights(os.path.join(dest, "target_model"), lm_head_key="model.embed_tokens.weight")
    head.to(torch.bfloat16)
    logits = head(batch["target"])
    assert logits.shape[-2:] == (len(ids), 49152) and torch.isfinite(logits).all()


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def test_an_fp8_export_with_loss_rows_reaches_speculators_as_fp8(fp8_loss_export, trainers, tmp_path, tiny_path):
    """speculators reads its own fp8 layout (--hidden-states-backend fp8: its FP8Transfer
    dequantizes `hidden_states` with `hidden_states_scales`): our aux planes pass through as
    stored; its loss is only where the export kept a final row (the captured mask), and there
    its norm gives back our final state."""
    from hs_connectors.transfer import FP8Transfer
    from speculators.models.eagle3.model_definitions import model_classes
    from speculators.train.data import ArrowDataset
    from speculators.utils.loading import load_model_layers

    d, samples, tok = fp8_loss_export
    dest = str(tmp_path / "spec")
    rep = to_speculators(d, dest)
    assert "--hidden-states-backend fp8" in rep.line()
    assert rep.without_final_row > 0  # last-turn+separator adds the separators the capture mask left out
    stored = load_file(os.path.join(dest, "hidden_states", "hs_0.safetensors"))
    assert stored["hidden_states"].dtype == torch.float8_e4m3fn and stored["hidden_states_scales"].dim() == 3
    ds = ArrowDataset(max_len=4096, datapath=dest, on_missing="raise",
                      transfer=FP8Transfer(pathlib.Path(dest) / "hidden_states"))
    norm = model_classes["llama"].norm_class(64, eps=1e-5)
    norm.load_state_dict({"weight": load_model_layers(["model.norm.weight"], tiny_path)["model.norm.weight"]})
    for i, entry in enumerate(samples.values()):
        item, (ids, mask, _, planes) = ds[i], entry
        T = len(ids)
        assert cosine(item["hidden_states"].view(T, 3, 64), planes[:, :3]).min() >= 0.999
        loss = item["loss_mask"].bool()
        assert set(loss.nonzero().flatten().tolist()) <= {j for j, m in enumerate(mask) if m}
        with torch.no_grad():
            renormed = norm(item["verifier_last_hidden_states"].float())
        assert cosine(renormed[loss], planes[loss, 3]).min() >= 0.999


def test_an_fp8_export_with_loss_rows_reaches_specforge_dequantized(fp8_loss_export, trainers, tmp_path):
    from specforge.algorithms.eagle3.data import (build_offline_collator, build_offline_normalizer,
                                                  build_offline_reader)
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    d, samples, tok = fp8_loss_export
    dest = str(tmp_path / "sf")
    rep = to_specforge(d, dest, ConvertOptions(loss_mask="captured"))
    assert rep.without_final_row == 0 and "fp8 (dequantized)" in rep.line()
    refs = build_offline_reader(dest, run_id="t8", ttt_length=7, max_len=4096).read()
    loader = FeatureDataLoader(LocalFeatureStore("t8"), refs=refs, batch_size=1,
                               per_sample_transform=build_offline_normalizer(4096),
                               collate_fn=build_offline_collator(), drop_last=False)
    by_ids = {tuple(e[0]): e for e in samples.values()}
    for tb in loader:
        b = tb.tensors
        ids, mask, _, planes = by_ids[tuple(b["input_ids"][0].tolist())]
        T = len(ids)
        assert cosine(b["hidden_state"][0].view(T, 3, 64), planes[:, :3]).min() >= 0.999
        loss = b["loss_mask"][0].bool()
        assert cosine(b["target"][0][loss], planes[loss, 3]).min() >= 0.999
        assert bool((b["target"][0][~torch.tensor(mask).bool()] == 0).all())  # no final row kept there


def test_the_draft_config_trains_in_specforge_and_names_aux_layers_the_way_sglang_reads_them(export, trainers,
                                                                                             tmp_path):
    """`convert --to specforge` writes the EAGLE-3 draft config both ends read: SpecForge's own
    config loader and model factory build the draft from it (the specforge.yaml names it), and
    SGLang's own Llama setter, given the draft's aux ids, captures exactly the export's HF ids."""
    import types

    from sglang.srt.models.llama import LlamaForCausalLM
    from specforge.config.schema import Config
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    d, _, _ = export
    dest = str(tmp_path / "sf")
    to_specforge(d, dest)
    cfg = Config.from_file(os.path.join(dest, "specforge.yaml"))
    draft_cfg = AutoDraftModelConfig.from_file(cfg.model.draft_model_config)
    draft = AutoDraftModel.from_config(draft_cfg, torch_dtype=torch.bfloat16)
    assert type(draft).__name__ == "LlamaForCausalLMEagle3" and draft_cfg.num_hidden_layers == 1
    assert draft_cfg.hidden_size == 64 and draft_cfg.tie_word_embeddings is False
    exported = read_export_json(d)["aux_layer_ids"]
    target = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=True), model=types.SimpleNamespace())
    LlamaForCausalLM.set_eagle3_layers_to_capture(target, draft_cfg.eagle_config["eagle_aux_hidden_state_layer_ids"])
    assert target.model.layers_to_capture == exported
