import json
import os

import torch
from safetensors.torch import load_file, save_file

from harness.fixtures import write_test_export_json
from sglang_hs.overlay.staging import SlabPool
from sglang_hs.overlay.writer import SampleWriter
from sglang_hs.tools.convert import ExportDataset, inspect_export, to_specforge, to_speculators
from test_writer import complete_state

H, K = 8, 3


def export_dir(tmp_path, n=3, norm_w=None):
    d = str(tmp_path / "export")
    os.makedirs(d)
    write_test_export_json(d, H, model_path=str(tmp_path / "model"))
    w = SampleWriter(d, "dp0", [2, 5, 7], SlabPool(1 << 20, slab_bytes=1 << 12), lambda m: None)
    for i in range(n):
        st = complete_state(f"s{i}", 4 + i, loss_mask=[0] + [1] * (3 + i))
        if norm_w is not None:  # a final plane that really is RMSNorm(h) * w, as the model makes it
            h = torch.randn(4 + i, H) * 3
            normed = (norm_w * h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
            a = 0
            for c in st.pieces:
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
