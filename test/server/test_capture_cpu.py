"""`sglang-hs capture` against a real SmolLM2 server on CPU: a bundled set of 200
conversations, killed and resumed, ends with every sample exported once, with the client's
tokens and loss masks."""

import json
import os
import signal
import subprocess
import sys
import time
from importlib import resources

import pytest

from sglang_hs.tools.capture import JOURNAL
from sglang_hs.format import CaptureProvenance, load_sample, read_manifest, sample_metadata, validate_export
from sglang_hs.tools.convert import inspect_export
from sglang_hs.tools.records import iter_records, sample_id, to_sample
from sglang_hs.tools.serve import LocalServer

pytestmark = pytest.mark.server
DATA = str(resources.files("sglang_hs").joinpath("data/chats_200.jsonl"))


@pytest.fixture(scope="module")
def smol_server(smollm2_path, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("capture"))
    log = str(tmp_path_factory.mktemp("logs") / "server.log")
    # float32: this CPU has no bf16 matrix units (bf16 matmuls are ~14x slower here); the
    # capture tests are about tokens, masks and resumption, not about dtype.
    args = ["--model-path", smollm2_path, "--export-hidden-states-dir", out, "--dtype", "float32",
            "--skip-server-warmup"]
    with LocalServer(args, log) as srv:
        yield srv


def capture_cmd(srv, *extra):
    return [sys.executable, "-m", "sglang_hs.tools.cli", "capture", "--server", srv.url, "--data", DATA,
            "--out", srv.export_dir, "--concurrency", "8", "--no-progress", *extra]


def journal_lines(out):
    p = os.path.join(out, JOURNAL)
    return sum(1 for _ in open(p)) if os.path.exists(p) else 0


def run_until(cmd, out, lines, sig):
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.time()
    while journal_lines(out) < lines and p.poll() is None and time.time() - t0 < 600:
        time.sleep(0.2)
    p.send_signal(sig)
    out_text = p.communicate(timeout=300)[0]
    return p.returncode, out_text


def test_capture_200_conversations_kill_and_resume(smol_server, smollm2_path):
    srv = smol_server
    # An abrupt kill, then a clean Ctrl-C, then a run to the end.
    rc1, _ = run_until(capture_cmd(srv), srv.export_dir, 40, signal.SIGKILL)
    assert rc1 == -signal.SIGKILL
    rc2, text2 = run_until(capture_cmd(srv), srv.export_dir, 90, signal.SIGINT)
    assert rc2 == 130 and "interrupted" in text2, text2
    r = subprocess.run(capture_cmd(srv), capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 failed of 200" in r.stdout

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    expected = {}
    for i, rec in enumerate(iter_records(DATA)):
        s = to_sample(tok, rec, sample_id("", i, rec))
        expected[s.id] = s
    manifest = read_manifest(srv.export_dir)
    ids = [e["id"] for e in manifest]
    assert len(ids) == len(set(ids)), "a sample was exported twice"
    assert set(ids) == set(expected), f"missing {len(set(expected) - set(ids))}"
    rep = validate_export(srv.export_dir, expected_tokens={k: v.input_ids for k, v in expected.items()})
    assert rep.ok, rep.errors[:5]
    for e in manifest:
        t = load_sample(os.path.join(srv.export_dir, e["path"]))
        want = expected[e["id"]].loss_mask
        if want is None:
            assert "loss_mask" not in t
        else:
            assert t["loss_mask"].tolist() == want, e["id"]
    # Provenance: the client's fingerprint of the chat template it tokenised with equals the one
    # the server computed from its own tokenizer, for every sample.
    prov = inspect_export(srv.export_dir)
    assert prov["server"]["chat_template_sha256"], prov["server"]
    assert prov["capture"]["without_provenance"] == 0 and prov["capture"]["other_chat_template_than_server"] == 0
    assert {w["chat_template_sha256"] for w in prov["capture"]["ways"]} == {prov["server"]["chat_template_sha256"]}
    assert sum(w["samples"] for w in prov["capture"]["ways"]) == 200


def test_regenerate_exports_the_models_own_answers_in_one_pass_as_in_two(smol_server, tmp_path):
    """--regenerate: one pass (the answer's rows kept as it is decoded) and two passes
    (generate, then prefill the conversation) give the same tokens up to the template's own
    separator after the answer, the same loss mask there, and rows within the runtime's
    prefill-vs-decode difference."""
    srv = smol_server
    data = tmp_path / "three.jsonl"
    with open(data, "w") as f:
        for q in ("Name a color.", "Say hello.", "Count to three."):
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": "(to be replaced)"}]}) + "\n")
    for passes in ("1", "2"):
        cmd = [sys.executable, "-m", "sglang_hs.tools.cli", "capture", "--server", srv.url, "--data", str(data),
               "--out", srv.export_dir, "--regenerate", "--regenerate-passes", passes, "--max-new-tokens", "48",
               "--id-prefix", f"regen{passes}-", "--no-progress"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(srv.argv[srv.argv.index("--model-path") + 1])
    listed = {e["id"]: e for e in read_manifest(srv.export_dir)}

    def read(rid):
        path = os.path.join(srv.export_dir, listed[rid]["path"])
        return {"t": load_sample(path), "meta": sample_metadata(path)}

    suffixes = sorted(rid[len("regen1-"):] for rid in listed if rid.startswith("regen1-"))
    assert len(suffixes) == 3 and all(f"regen2-{x}" in listed for x in suffixes), sorted(listed)
    compared = 0
    for x in suffixes:
        one, two = read(f"regen1-{x}"), read(f"regen2-{x}")
        for y, passes in ((one, 1), (two, 2)):
            text = tok.decode(y["t"]["token_ids"])
            assert "(to be replaced)" not in text
            answer = tok.decode(y["t"]["token_ids"][y["t"]["loss_mask"].bool()])
            prov = CaptureProvenance.of_sample(y["meta"])
            assert prov.regenerated and prov.mask_policy == "template" and prov.source == "three.jsonl"
            assert len(answer) > len("<|im_end|>") and (passes == 1 or answer.endswith("<|im_end|>"))
        # One pass: the prompt, then the answer as generated; its rows but the last.
        p = int(one["meta"]["prompt_tokens"])
        assert one["t"]["loss_mask"].tolist() == [0] * p + [1] * (len(one["t"]["token_ids"]) - p)
        a, b = one["t"]["token_ids"].tolist(), two["t"]["token_ids"].tolist()
        if a[-1] != tok.convert_tokens_to_ids("<|im_end|>"):
            continue  # cut at --max-new-tokens: two passes end the turn, one pass cannot
        assert b[: len(a)] == a and tok.decode(b[len(a):]).strip() == "", (a, b)
        assert two["t"]["loss_mask"].tolist()[: len(a)] == one["t"]["loss_mask"].tolist()
        n = len(a) - 1
        for key in ("aux_hidden_states", "final_hidden_states"):
            d, q = one["t"][key].float(), two["t"][key][:n].float()
            assert float((d - q).norm() / q.norm()) < 1e-3, key  # float32 server: decode vs prefill rounding
        compared += 1
    assert compared, "no answer ended its turn within 48 tokens: nothing compared"