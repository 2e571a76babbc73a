"""The Kimi-K2.5 recipe a user copies (scripts/capture/kimi_k25_tp8_sm120.sh), run as it is
in miniature: a tiny checkpoint of the same class and layout, TP2 in CPU mode, a slice of the
bundled chats. It must start, capture, inspect and convert, and the export must match HF."""

import json
import os
import subprocess
import sys
from importlib import resources

import pytest

from sglang_hs.format import read_manifest, validate_export
from sglang_hs.tools.serve import free_port
from sglang_hs.tools.verify import verify_export

pytestmark = pytest.mark.server
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(REPO, "scripts", "capture", "kimi_k25_tp8_sm120.sh")
CHATS = 12


def test_kimi_recipe_starts_captures_and_converts_in_miniature(tiny_kimi_path, tmp_path):
    data = tmp_path / "chats.jsonl"
    with open(resources.files("sglang_hs").joinpath("data/chats_200.jsonl")) as f:
        data.write_text("".join(f.readlines()[:CHATS]))
    out = str(tmp_path / "hs")
    bin_dir = os.path.dirname(sys.executable)  # the venv's sglang-hs and python
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"], MODEL=tiny_kimi_path, OUT=out,
               DATA=str(data), TP="2", AUX="1 4 7", PORT=str(free_port()), LAUNCH="sglang-hs serve-cpu",
               ATTENTION="torch_native", LOG=str(tmp_path / "server.log"))
    r = subprocess.run(["bash", RECIPE], env=env, capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + open(env["LOG"]).read()[-3000:]
    meta = json.load(open(os.path.join(out, "export.json")))
    assert meta["architecture"] == "KimiK25ForConditionalGeneration" and meta["tp_size"] == 2
    assert meta["aux_layer_ids"] == [1, 4, 7]
    assert len(read_manifest(out)) == CHATS
    rep = validate_export(out)
    assert rep.ok and rep.samples == CHATS, rep.errors
    assert len([f for _, _, fs in os.walk(out + "-specforge") for f in fs if f.endswith(".ckpt")]) == CHATS
    v = verify_export(out, samples=4)
    print(v.table())
    assert v.ok, v.table()
