"""Issue 5: the same prompts exported with --tp-size 1 and --tp-size 2 (prefix cache on, CUDA
graphs on) agree within bf16 tolerance; only TP rank 0 copies and writes. Needs two GPUs
(device kind nvidia-h200-x2); skipped elsewhere. Not run yet: that kind was not lent."""

import os
import random
import re

import pytest
import torch

from sglang_hs.format import load_sample, read_manifest, validate_export
from sglang_hs.tools.serve import LocalServer

pytestmark = [pytest.mark.multigpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs")]

FLAGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--skip-tokenizer-init",
         "--skip-server-warmup", "--mem-fraction-static", "0.4", "--chunked-prefill-size", "1024",
         "--export-aux-layer-ids", "1", "4", "7"]


def test_tp1_and_tp2_export_the_same_rows(tmp_path):
    from test_export_gpu import mini_llama_dir

    model = mini_llama_dir(str(tmp_path / "model"))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randrange(16, 3000))] for _ in range(64)]
    outs = {}
    for tp in (1, 2):
        out = str(tmp_path / f"tp{tp}")
        with LocalServer(["--model-path", model, "--tp-size", str(tp), *FLAGS, "--export-hidden-states-dir", out],
                    str(tmp_path / f"tp{tp}.log"), cpu=False) as srv:
            for i, ids in enumerate(prompts):
                r = srv.generate({"rid": f"p{i}", "input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
                assert r.status_code == 200, r.text
        outs[tp] = out
        assert validate_export(out, expected_tokens={f"p{i}": p for i, p in enumerate(prompts)}).ok
        log = open(str(tmp_path / f"tp{tp}.log")).read()
        # Exactly one rank reports itself as the writer.
        assert len(re.findall(r"writer rank: True", log)) == 1
        assert len(re.findall(r"writer rank: False", log)) == tp - 1
    a = {e["id"]: e for e in read_manifest(outs[1])}
    b = {e["id"]: e for e in read_manifest(outs[2])}
    assert set(a) == set(b) == {f"p{i}" for i in range(64)}
    for rid in a:
        x = load_sample(os.path.join(outs[1], a[rid]["path"]))
        y = load_sample(os.path.join(outs[2], b[rid]["path"]))
        assert torch.equal(x["token_ids"], y["token_ids"])
        for k in ("aux_hidden_states", "final_hidden_states"):
            rel = float((x[k].float() - y[k].float()).norm() / y[k].float().norm())
            assert rel < 2e-2, (rid, k, rel)
