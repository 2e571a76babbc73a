"""The DeepSeek V3 architecture (MLA attention + MoE, as in Kimi K2) on a real SGLang server
on CPU. Its aux layers are exported in our HF convention, including a first id of 1, which
upstream's own DeepseekV2 id mapping treats unlike the others; rows are checked against
Hugging Face transformers under chunked prefill, concurrency and a shared prefix."""

import concurrent.futures as cf
import json
import os

import pytest

from harness.fixtures import prompts
from sglang_hs.format import validate_export
from sglang_hs.tools.serve import LocalServer
from sglang_hs.tools.verify import verify_export

pytestmark = [pytest.mark.server, pytest.mark.core]
AUX = [1, 4, 7]  # of 8 layers: the lowest and highest ids upstream can capture


@pytest.fixture(scope="module")
def ds_server(tiny_deepseek_path, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("export-ds"))
    log = str(tmp_path_factory.mktemp("logs") / "server.log")
    args = ["--model-path", tiny_deepseek_path, "--export-hidden-states-dir", out,
            "--export-aux-layer-ids", *map(str, AUX), "--chunked-prefill-size", "64", "--skip-server-warmup"]
    with LocalServer(args, log) as srv:
        yield srv


def test_deepseek_v3_rows_match_hf_at_hf_layer_ids(ds_server, tiny_deepseek_path):
    srv = ds_server
    lengths = [1, 17, 64, 65, 300, 500, 700]
    ids = {f"ds-{i}": p for i, p in enumerate(prompts(7, lengths))}
    ids["ds-shared"] = ids["ds-5"][:200] + [11, 12, 13]  # a cached prefix it must recompute

    def send(rid):
        return rid, srv.generate({"rid": rid, "input_ids": ids[rid], "sampling_params": {"max_new_tokens": 2}})

    with cf.ThreadPoolExecutor(8) as ex:
        for rid, r in ex.map(send, list(ids)):
            assert r.status_code == 200, r.text
            assert r.json()["meta_info"]["hidden_states_export"]["num_tokens"] == len(ids[rid])

    meta = json.load(open(os.path.join(srv.export_dir, "export.json")))
    assert meta["architecture"] == "DeepseekV3ForCausalLM" and meta["aux_layer_ids"] == AUX
    rep = validate_export(srv.export_dir, expected_tokens=ids)
    assert rep.ok and rep.samples == len(ids), rep.errors
    v = verify_export(srv.export_dir, samples=None)
    print(v.table())
    assert v.ok, v.table() + "\n" + "\n".join(v.format_errors)
