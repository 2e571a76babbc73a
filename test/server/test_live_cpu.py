"""Live capture on a real SGLang server on CPU (--export-mode live --export-sample-rate 0.5):
answers never wait for their sample, the requests exported are those the rid samples (or
that opt in), each with prompt and answer, and under back-pressure (a host buffer too small
for the traffic, a full disk) samples are dropped or fail with counters while every request
is answered with the tokens an unexported request gets."""

import concurrent.futures as cf
import os
import re
import subprocess
import time

import pytest
import requests

from harness.fixtures import prompts
from sglang_hs.format import read_manifest, validate_export
from sglang_hs.overlay.admission import sampled
from sglang_hs.tools.serve import LocalServer

pytestmark = pytest.mark.server

RATE = 0.5
# ~1000 rows of the tiny model (4 planes of 64 bf16 values a row): far less than the
# concurrent requests of the back-pressure test hold while they decode.
BUFFER_GIB = 0.0005


@pytest.fixture(scope="module")
def live_server(tiny_path, tmp_path_factory):
    """On a small tmpfs when this machine lets us mount one (the full-disk test needs it)."""
    mnt = str(tmp_path_factory.mktemp("tmpfs"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", mnt],
                             capture_output=True).returncode == 0
    log = str(tmp_path_factory.mktemp("logs") / "server.log")
    args = ["--model-path", tiny_path, "--export-hidden-states-dir", os.path.join(mnt, "hs"),
            "--export-mode", "live", "--export-sample-rate", str(RATE), "--export-host-buffer-gib", str(BUFFER_GIB),
            "--chunked-prefill-size", "64", "--enable-metrics", "--skip-server-warmup"]
    os.environ["SGLANG_HS_STATS_INTERVAL_S"] = "0"  # a stats line after every forward, for the test to read
    try:
        with LocalServer(args, log) as srv:
            srv.mounted = mounted
            yield srv
    finally:
        os.environ.pop("SGLANG_HS_STATS_INTERVAL_S", None)
        if mounted:
            subprocess.run(["umount", "-l", mnt])


def generate(srv, rid, ids, new, export=None):
    opts = {} if export is None else {"export": export}
    r = srv.generate({"rid": rid, "input_ids": ids, "sampling_params": {
        "max_new_tokens": new, "temperature": 0, "ignore_eos": True, "custom_params": {"sglang_hs": opts}}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert "hidden_states_export" not in out["meta_info"], "a live answer waited for its sample"
    return out["output_ids"]


def metrics(srv) -> dict:
    text = requests.get(srv.url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^sglang_hs:(\w+)_total\{[^}]*\} (\S+)$", text, re.M)}


def settled(srv, want: float, key="exported_samples", timeout_s=60) -> dict:
    """Live answers come first: wait until the writer has reported `want` samples of `key`."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        m = metrics(srv)
        if m.get(key, 0) >= want:
            return m
        time.sleep(0.2)
    raise AssertionError(f"{key} never reached {want}: {metrics(srv)}")


def baseline(srv, ids, new):
    """The same prompt unexported: what export must not change."""
    return generate(srv, f"plain-{time.monotonic_ns()}", ids, new, export=False)


def test_the_sampled_and_opted_in_requests_are_exported_with_their_answers(live_server):
    srv = live_server
    ps = prompts(60, [12 + 3 * i for i in range(24)])
    rids = [f"live-{i}" for i in range(24)]
    said = {rids[0]: True, rids[1]: False, rids[2]: True, rids[3]: False}  # explicit opt-in and -out win
    with cf.ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda i: generate(srv, rids[i], ps[i], 6, said.get(rids[i])), range(24)))
    want = {r for r in rids if said.get(r, sampled(r, RATE))}
    assert 4 <= len(want) <= 20
    settled(srv, len(want))
    assert {e["id"] for e in read_manifest(srv.export_dir)} == want
    rep = validate_export(srv.export_dir, expected_tokens={r: ps[i] + outs[i] for i, r in enumerate(rids) if r in want})
    assert rep.ok, rep.errors
    for i in range(0, 24, 6):
        assert outs[i] == baseline(srv, ps[i], 6), "live export changed the greedy tokens"


def test_a_host_buffer_too_small_for_the_traffic_drops_samples_and_slows_nothing(live_server):
    srv = live_server
    before = metrics(srv)
    ps = prompts(61, [60] * 24)
    with cf.ThreadPoolExecutor(24) as ex:  # all decoding at once: ~2400 rows held for ~1000 of room
        outs = list(ex.map(lambda i: generate(srv, f"burst-{i}", ps[i], 40, True), range(24)))
    t0 = time.time()
    while True:
        m = metrics(srv)
        done = sum(m.get(k, 0) - before.get(k, 0) for k in ("exported_samples", "dropped_samples", "failed_samples"))
        if done >= 24 or time.time() - t0 > 60:
            break
        time.sleep(0.2)
    exported, dropped = (m.get(k, 0) - before.get(k, 0) for k in ("exported_samples", "dropped_samples"))
    assert exported + dropped == 24 and dropped >= 1 and exported >= 1, m
    burst = {e["id"] for e in read_manifest(srv.export_dir) if e["id"].startswith("burst-")}
    assert len(burst) == exported
    rep = validate_export(srv.export_dir, expected_tokens={f"burst-{i}": ps[i] + outs[i] for i in range(24)
                                                           if f"burst-{i}" in burst})
    assert rep.ok, rep.errors
    for i in (0, 23):
        assert outs[i] == baseline(srv, ps[i], 40)
    stats = [ln for ln in open(srv.log_path) if "sglang-hs stats:" in ln]
    assert any(f'"dropped": {int(dropped + before.get("dropped_samples", 0))}' in ln for ln in stats)
    assert any("live capture dropped sample burst-" in ln for ln in open(srv.log_path))


def test_a_full_disk_fails_samples_while_every_request_is_answered(live_server):
    srv = live_server
    if not srv.mounted:
        pytest.skip("cannot mount a small tmpfs here; the full-disk test needs one")
    before = metrics(srv)
    filler = os.path.join(os.path.dirname(srv.export_dir), "filler")
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    try:
        ps = prompts(62, [30, 40, 50])
        for i, ids in enumerate(ps):
            assert generate(srv, f"full-{i}", ids, 5, True) == baseline(srv, ids, 5)
        m = settled(srv, before.get("failed_samples", 0) + 3, key="failed_samples")
        assert m.get("exported_samples", 0) == before.get("exported_samples", 0)
        assert requests.get(srv.url + "/health", timeout=30).status_code == 200
    finally:
        os.remove(filler)
    generate(srv, "after-full", ps[0], 5, True)
    settled(srv, before.get("exported_samples", 0) + 1)
    assert validate_export(srv.export_dir).ok
