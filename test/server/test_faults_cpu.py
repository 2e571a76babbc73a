"""Fault matrix on real servers: the server killed -9 mid-capture and restarted under a
waiting client, stopped with SIGTERM mid-run, and what a crash between a file's commit and
its manifest line leaves behind. Each ends with
the directory valid and every sample present exactly once after a restart and a resend."""

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import requests

from harness.fixtures import prompts
from sglang_hs.format import read_manifest, validate_export
from sglang_hs.tools.capture import load_done
from sglang_hs.tools.records import sample_id
from sglang_hs.tools.serve import LocalServer

pytestmark = pytest.mark.server

N = 40
IDS = {f"f-{i:03d}": p for i, p in enumerate(prompts(11, [200 + 37 * (i % 13) for i in range(N)]))}


def args(model, out):
    return ["--model-path", model, "--export-hidden-states-dir", out, "--chunked-prefill-size", "64",
            "--skip-server-warmup", "--log-level", "info"]


def send(url, rid):
    try:
        return requests.post(url + "/generate", json={"rid": rid, "input_ids": IDS[rid],
                                                       "sampling_params": {"max_new_tokens": 1}}, timeout=300).status_code
    except requests.RequestException:
        return None  # the server went away mid-request


def run_and_stop(model, out, log, sig, after_listed, group=True):
    """Send every sample 4 at a time; once `after_listed` are in the manifest, send `sig` to
    the server's whole process group (or, `group=False`, to the launcher process alone).
    Returns the status each rid got, and the processes of the server still alive 10 s after
    the launcher exited."""
    srv = LocalServer(args(model, out), log).__enter__()
    codes = {}
    with cf.ThreadPoolExecutor(4) as ex:
        futs = {ex.submit(send, srv.url, rid): rid for rid in IDS}
        t0 = time.time()
        while len(read_manifest(out)) < after_listed and time.time() - t0 < 300:
            time.sleep(0.05)
        (os.killpg if group else os.kill)(srv.proc.pid, sig)
        for f in cf.as_completed(futs):
            codes[futs[f]] = f.result()
    try:
        srv.proc.wait(60)
        left = survivors(srv.proc.pid, within=10)
    finally:
        srv.__exit__(None, None, None)
    return codes, left


def survivors(pgid, within):
    """Processes of the group `pgid` that are still alive after `within` seconds."""
    deadline = time.time() + within
    while True:
        left = []
        for p in psutil.process_iter(["pid", "name"]):
            try:
                if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p.info["name"])
            except (ProcessLookupError, psutil.Error):
                pass
        if not left or time.time() > deadline:
            return left
        time.sleep(0.5)


def send_all(url, rids):
    """Send `rids` 4 at a time, as capture does: {rid: status}."""
    with cf.ThreadPoolExecutor(4) as ex:
        return dict(zip(rids, ex.map(lambda rid: send(url, rid), rids)))


def resume(model, out, log):
    """Restart on the same directory and resend every rid that is not listed."""
    with LocalServer(args(model, out), log) as srv:
        listed = {e["id"] for e in read_manifest(out)}
        return send_all(srv.url, [rid for rid in IDS if rid not in listed])


def assert_complete(out):
    rep = validate_export(out, expected_tokens=IDS)
    ids = [e["id"] for e in read_manifest(out)]
    assert rep.ok, rep.errors
    assert sorted(ids) == sorted(IDS) and len(ids) == len(set(ids)), "missing or duplicated samples"


def stop_waiting_client(client, log, url, sig):
    """Once the client says it is waiting for `url`, send it `sig`: (exit status, seconds to exit)."""
    t0 = time.time()
    while f"waiting for {url} (Connection refused) for " not in log.read_text() and time.time() - t0 < 60:
        time.sleep(0.1)
    assert client.poll() is None, log.read_text()
    t0 = time.time()
    client.send_signal(sig)
    try:
        rc = client.wait(60)
    finally:
        if client.poll() is None:
            client.kill()
    text = log.read_text()
    assert rc == 128 + sig and time.time() - t0 < 5, (rc, time.time() - t0, text[-3000:])
    assert f"stopped by {signal.Signals(sig).name}" in text, text[-3000:]


def test_a_killed_server_is_waited_for_a_stop_ends_the_wait_in_seconds_and_restarts_complete_the_capture(
        tiny_path, tmp_path):
    """The server killed -9 under a running capture (--server-wait 600). A client waiting for
    it mid-run stops on Ctrl-C within 5 s (130), and one waiting for it at start on SIGTERM
    (143), journal intact (they used to sit out the whole wait, silently). Then a resumed
    capture, the server killed under it again, is left running: it waits for the restart,
    resends what was lost and ends with every sample listed once (it used to fail every
    remaining sample within seconds)."""
    out, journal_dir = str(tmp_path / "export"), tmp_path / "capture"
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in IDS.values()))
    expected = {sample_id("", i, {"input_ids": ids}): ids for i, ids in enumerate(IDS.values())}
    cmd = [sys.executable, "-m", "sglang_hs.tools.cli", "capture", "--data", str(data), "--out", str(journal_dir),
           "--tokenizer", tiny_path, "--concurrency", "4", "--server-wait", "600"]

    def start_client(url, name):
        log = tmp_path / f"{name}.log"
        with open(log, "w") as f:
            return subprocess.Popen(cmd + ["--server", url], stdout=f, stderr=subprocess.STDOUT), log

    def kill_after(srv, listed):
        t0 = time.time()
        while len(read_manifest(out)) < listed and time.time() - t0 < 300:
            time.sleep(0.05)
        os.killpg(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(60)
        srv.__exit__(None, None, None)
        # A sample the client counts as exported was answered 200, which leaves after its manifest line.
        lines = (journal_dir / "capture.jsonl").read_text().splitlines()
        assert len(load_done(str(journal_dir))) == len(lines), "a journal line was torn"
        assert set(load_done(str(journal_dir))) <= {e["id"] for e in read_manifest(out)}, \
            "a 200 was answered for a sample not listed"
        assert listed <= len(read_manifest(out)) < N, "the kill came too late to test anything"

    srv = LocalServer(args(tiny_path, out), str(tmp_path / "server0.log")).__enter__()
    port = srv.port
    client, log = start_client(srv.url, "client0")
    kill_after(srv, 8)
    stop_waiting_client(client, log, srv.url, signal.SIGINT)
    client, log = start_client(srv.url, "client1")  # the server is still down
    stop_waiting_client(client, log, srv.url, signal.SIGTERM)

    srv = LocalServer(args(tiny_path, out), str(tmp_path / "server1.log"), port=port).__enter__()
    client, log = start_client(srv.url, "client2")
    try:
        kill_after(srv, 16)
        assert client.poll() is None, "the client gave up while the server was down"
        with LocalServer(args(tiny_path, out), str(tmp_path / "server2.log"), port=port):
            rc = client.wait(600)
    finally:
        if client.poll() is None:
            client.kill()
    text = log.read_text()
    assert rc == 0 and f"0 failed of {N}" in text, text[-3000:]
    rep = validate_export(out, expected_tokens=expected)
    ids = [e["id"] for e in read_manifest(out)]
    assert rep.ok, rep.errors
    assert sorted(ids) == sorted(expected) and len(ids) == len(set(ids)), "missing or duplicated samples"


@pytest.mark.core
def test_sigterm_mid_run_writes_queued_samples_and_exits(tiny_path, tmp_path):
    out = str(tmp_path / "export")
    log = str(tmp_path / "a.log")
    codes, left = run_and_stop(tiny_path, out, log, signal.SIGTERM, after_listed=8)
    assert not left, left
    text = open(log).read()
    assert "drained:" in text, text[-3000:]
    assert not [line for line in text.splitlines() if "NOT written" in line]
    assert {rid for rid, c in codes.items() if c == 200} <= {e["id"] for e in read_manifest(out)}
    assert validate_export(out).ok
    resume(tiny_path, out, str(tmp_path / "b.log"))
    assert_complete(out)


def test_sigterm_to_the_launcher_alone_leaves_every_answered_sample_listed_and_start_up_repairs_a_torn_commit(
        tiny_path, tmp_path):
    """What a service manager does: SIGTERM to the launcher process only. Its children are
    stopped by SGLang itself; every sample answered 200 must be listed, nothing half-written
    may stay, and no process of the server may outlive it.

    Then what a crash between a file's commit and its manifest line leaves (the last line torn
    in half), with an interrupted temporary file beside it. That used to leave the file outside
    the manifest for good: the resend was answered 409 "already exported", the client counted
    it as done, and the sample was never listed. Start-up lists it (after validating it), cuts
    the torn line and removes the temporary file; the resend of the rest completes the set."""
    out = str(tmp_path / "export")
    codes, left = run_and_stop(tiny_path, out, str(tmp_path / "a.log"), signal.SIGTERM, after_listed=8, group=False)
    assert not left, f"outlived the launcher: {left}"
    assert {rid for rid, c in codes.items() if c == 200} <= {e["id"] for e in read_manifest(out)}
    assert validate_export(out).ok
    assert not [f for _, _, fs in os.walk(out) for f in fs if f.endswith(".tmp")]

    listed = [e["id"] for e in read_manifest(out)]
    manifest = os.path.join(out, "manifest.jsonl")
    lines = open(manifest).read().splitlines(keepends=True)
    with open(manifest, "w") as f:  # the crash: the last line never made it, but half of it did
        f.writelines(lines[:-1])
        f.write(lines[-1][:17])
    torn = listed[-1]
    shard = os.path.dirname(os.path.join(out, read_manifest(out)[0]["path"]))
    open(os.path.join(shard, ".f-999.safetensors.0badc0de.tmp"), "wb").write(b"interrupted")
    log = str(tmp_path / "b.log")
    with LocalServer(args(tiny_path, out), log) as srv:
        assert sorted(e["id"] for e in read_manifest(out)) == sorted(listed)
        assert send(srv.url, torn) == 409
        assert all(c == 200 for c in send_all(srv.url, [rid for rid in IDS if rid not in listed]).values())
    text = open(log).read()
    assert f"1 unlisted valid samples listed: {torn}" in text and "1 torn manifest lines cut" in text, text[-3000:]
    assert "1 temporary files removed" in text
    assert_complete(out)
