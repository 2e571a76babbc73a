"""Capture through SGLang's own load balancer: two CPU servers, each with its own export
directory (two "nodes"; the first runs two data-parallel replicas), behind a real sglang-router
(--policy manual, nothing that takes a worker out), the second killed and restarted mid-run:
every sample exported exactly once; the two directories read back as one dataset."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from importlib import resources

import pytest
import requests
import torch

from harness.router import ROUTER_FOR_CAPTURE, LocalRouter
from sglang_hs.format import load_sample, read_manifest, validate_export
from sglang_hs.tools.capture import JOURNAL, ROUTING_KEY
from sglang_hs.tools.dirs import ExportDirs
from sglang_hs.tools.records import iter_records, sample_id, to_sample
from sglang_hs.tools.serve import LocalServer

pytestmark = pytest.mark.server
DATA = str(resources.files("sglang_hs").joinpath("data/chats_200.jsonl"))


def server_args(model, out, *extra):
    return ["--model-path", model, "--export-hidden-states-dir", out, "--skip-server-warmup", *extra]


def start_all(servers):
    """Start servers side by side (each start is mostly one process importing SGLang)."""
    errors = []

    def start(s):
        try:
            s.__enter__()
        except Exception as e:  # noqa: BLE001 (raised below, in the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in servers:
            s.__exit__()
        raise errors[0]
    return servers


@pytest.fixture(scope="module")
def nodes(tiny_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("nodes")
    dp = [["--dp-size", "2"], []]  # node0: two replicas, one writer each, one directory
    servers = start_all([LocalServer(server_args(tiny_path, str(root / f"node{k}"), *dp[k]),
                                     str(root / f"server{k}.log")) for k in range(2)])
    try:
        with LocalRouter([s.url for s in servers], str(root / "router.log"), *ROUTER_FOR_CAPTURE) as router:
            yield router, servers, root
    finally:
        for s in servers:
            s.__exit__()


def journal_lines(out):
    p = os.path.join(out, JOURNAL)
    return sum(1 for _ in open(p)) if os.path.exists(p) else 0


def test_a_capture_through_the_router_survives_a_worker_restart_and_reads_every_sample_once(nodes, tiny_path,
                                                                                           tmp_path):
    router, servers, root = nodes
    journal = str(tmp_path / "journal")
    cmd = [sys.executable, "-m", "sglang_hs.tools.cli", "capture", "--via-router", "--server", router.url,
           "--data", DATA, "--out", journal, "--concurrency", "8", "--no-progress", "--server-wait", "300"]
    cap = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        t0 = time.time()
        while journal_lines(journal) < 50 and cap.poll() is None and time.time() - t0 < 300:
            time.sleep(0.2)
        victim = servers[1]
        os.killpg(victim.proc.pid, signal.SIGKILL)  # mid-run, requests in flight on it
        victim.proc.wait()
        killed_at = journal_lines(journal)
        time.sleep(3)  # down a while: its samples fail and wait for it
        servers[1] = LocalServer(server_args(tiny_path, victim.export_dir), victim.log_path + ".restart",
                                 port=victim.port).__enter__()
        said, _ = cap.communicate(timeout=600)
    finally:
        cap.kill()
    assert cap.returncode == 0 and "0 failed of 200" in said, said[-3000:]
    assert killed_at < 200, "the capture ended before the kill: nothing was tested"
    assert "does not answer /health" in said, said[-3000:]  # it waited for the worker to be back

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_path)
    expected = {}
    for i, rec in enumerate(iter_records(DATA)):
        s = to_sample(tok, rec, sample_id("", i, rec))
        expected[s.id] = s
    dirs = [s.export_dir for s in servers]
    one = ExportDirs.open(dirs)
    ids = [e["id"] for e in one.entries]
    assert sorted(ids) == sorted(expected)  # every sample, read once
    assert not one.duplicates, one.lines()  # and exported once: no key left its worker
    per_dir = {d: sum(e["dir"] == d for e in one.entries) for d in dirs}
    assert all(n > 0 for n in per_dir.values()), per_dir
    shards = {e["path"].split("-")[0] for e in one.entries if e["dir"] == dirs[0]}
    assert shards == {"dp0", "dp1"}, shards  # each replica wrote its own shard
    for d in dirs:
        mine = {e["id"] for e in read_manifest(d)}
        rep = validate_export(d, expected_tokens={k: v.input_ids for k, v in expected.items() if k in mine})
        assert rep.ok, rep.errors[:5]
    # The journal says where each sample went; the router's workers agree with it.
    where = {}
    for line in open(os.path.join(journal, JOURNAL)):
        e = json.loads(line)
        if "dir" in e:
            where[e["id"]] = e["dir"]
    assert all(where[e["id"]] == e["dir"] for e in one.entries if e["id"] in where)

    # The same records sent straight to one worker give the same rows.
    direct = [sys.executable, "-m", "sglang_hs.tools.cli", "capture", "--server", servers[0].url, "--data", DATA,
              "--out", str(tmp_path / "direct"), "--limit", "16", "--id-prefix", "direct-", "--no-progress"]
    r = subprocess.run(direct, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    by_id = {e["id"]: e for e in ExportDirs.open(dirs).entries}
    for i, rec in enumerate(list(iter_records(DATA))[:16]):
        a = load_sample(one.path(by_id[sample_id("", i, rec)]))
        b = load_sample(one.path(by_id[sample_id("direct-", i, rec)]))
        assert torch.equal(a["token_ids"], b["token_ids"])
        for k in ("aux_hidden_states", "final_hidden_states"):
            x, y = a[k].float(), b[k].float()
            assert (x - y).norm() <= 2e-2 * y.norm(), (i, k)  # bf16 noise: other batches, other kernels' order
    assert requests.get(router.url + "/health", timeout=10).status_code == 200


def test_the_router_set_up_for_capture_keeps_a_dead_workers_keys_on_it(nodes):
    """What exactly-once rests on, asked of the router itself: a key whose worker is dead is
    answered with an error (never served by another worker) for as long as it is down (the
    test above restarts it). With the router's health checks or circuit breaker on, the resends
    after the kill would be answered 200 by the live worker: a second copy."""
    router, servers, root = nodes

    def send(rid):
        r = requests.post(router.url + "/generate", headers={ROUTING_KEY: rid}, timeout=60, json={
            "rid": rid, "input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 1}})
        return r.status_code

    t0 = time.time()  # the router registers its workers a moment after it answers /health
    while time.time() - t0 < 120:
        listed = requests.get(router.url + "/workers", timeout=10).json()["workers"]
        if len(listed) == 2 and all(w["is_healthy"] for w in listed):
            break
        time.sleep(0.5)
    keys = [f"pin-{i}" for i in range(12)]
    assert [send(k) for k in keys] == [200] * 12
    on_victim = {e["id"] for e in read_manifest(servers[1].export_dir)} & set(keys)
    assert 0 < len(on_victim) < 12, on_victim  # random placement put keys on both workers
    victim = servers[1]
    os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait()
    for _ in range(2):  # at once, and after the 1-s health checks a router might still be doing
        answers = {k: send(k) for k in keys}
        assert all(answers[k] >= 500 for k in on_victim), answers
        assert all(answers[k] == 409 for k in set(keys) - on_victim), answers
        time.sleep(3)
    listed = requests.get(router.url + "/workers", timeout=10).json()["workers"]
    assert all(w["is_healthy"] for w in listed)  # hence capture asks each worker's own /health
    ids = [e["id"] for s in servers for e in read_manifest(s.export_dir)]
    assert sorted(i for i in ids if i.startswith("pin-")) == sorted(keys)  # one copy each
