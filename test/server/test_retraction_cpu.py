"""Retraction on a real server: with little KV memory and an optimistic scheduler, SGLang
retracts running requests during decode and later prefills prompt + output again. The
export must still hold each prompt's rows once (with decode rows, each position of prompt
and answer once), exact against HF transformers."""

import concurrent.futures as cf
import random

import pytest

from sglang_hs.format import validate_export
from sglang_hs.overlay.releases import SGLANG_WINDOW, installed
from sglang_hs.tools.serve import LocalServer
from sglang_hs.tools.verify import verify_export

pytestmark = [pytest.mark.server, pytest.mark.core]


@pytest.fixture(scope="module")
def tight_server(tiny_path, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("export-retract"))
    log = str(tmp_path_factory.mktemp("logs") / "server.log")
    args = ["--model-path", tiny_path, "--export-hidden-states-dir", out, "--max-total-tokens", "1200",
            "--chunked-prefill-size", "128", "--schedule-conservativeness", "0.01", "--skip-server-warmup"]
    with LocalServer(args, log) as srv:
        yield srv


def test_retracted_requests_are_exported_once_and_exact(tight_server):
    srv = tight_server
    rng = random.Random(3)
    prompts, retracted, decoding = {}, [], set()
    # Retraction depends on scheduling; on the oldest release a round rarely goes without one.
    # Later releases admit too few requests to retract under this load (see the skip below):
    # one round shows it, two more only cost the suite its last minutes.
    rounds = 3 if installed() == SGLANG_WINDOW[0] else 1
    for rnd in range(rounds):
        batch = {f"rt{rnd}-{i}": [rng.randrange(3, 49152) for _ in range(150 + 10 * i)] for i in range(8)}
        decoding = decoding | {f"rt{rnd}-{i}" for i in range(0, 8, 2)}
        prompts.update(batch)

        def send(rid):  # every other request with decode rows: its answer's rows must survive retraction too
            return rid, srv.generate({"rid": rid, "input_ids": batch[rid], "sampling_params": {
                "max_new_tokens": 300, "temperature": 0, "ignore_eos": True,
                "custom_params": {"sglang_hs": {"decode_rows": rid in decoding}}}})

        with cf.ThreadPoolExecutor(8) as ex:
            for rid, r in ex.map(send, batch):
                assert r.status_code == 200, r.text
                mi = r.json()["meta_info"]
                if rid in decoding:
                    prompts[rid] = batch[rid] + r.json()["output_ids"]
                assert mi["hidden_states_export"]["num_tokens"] == len(prompts[rid])
                if mi.get("num_retractions", 0) > 0:
                    retracted.append(rid)
        if any(r in decoding for r in retracted):  # SGLang chooses which request it retracts
            break
    if not retracted and installed() != SGLANG_WINDOW[0]:
        # Measured on 0.5.23: its scheduler admits 2 of the 8 requests into 1200 tokens (it
        # counts pending decode tokens), so nothing runs out of memory and nothing is retracted,
        # also at max_new_tokens 600. The oldest release of the window (CI's core run) must.
        pytest.skip(f"SGLang {installed()} retracted no request under this load")
    assert retracted, "no request was retracted; the test did not exercise retraction"
    assert any(r in decoding for r in retracted), f"no request with decode rows was retracted: {retracted}"
    rep = validate_export(srv.export_dir, expected_tokens=prompts)
    assert rep.ok and rep.samples == len(prompts), rep.errors
    v = verify_export(srv.export_dir, samples=None)
    print(f"retracted: {retracted}\n{v.table()}")
    assert v.ok, v.table()
