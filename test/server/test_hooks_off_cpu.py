"""A server started without --export-hidden-states-dir runs stock SGLang: in its real
processes no export seam of ours is applied, only the two that add and check our flags (in the
launcher) and, in CPU mode, the three CPU crash fixes (in the scheduler). A probe on the
server's PYTHONPATH (hook_probe/sitecustomize.py) reports what SGLang's HookRegistry applied
in each process. The same server's start is also the port-race fault: the torch.distributed
port LocalServer chose is taken before the server binds it, and the start is retried."""

import json
import os
import socket

import pytest

from sglang_hs.overlay import seams
from sglang_hs.tools.serve import LocalServer

pytestmark = [pytest.mark.server, pytest.mark.core]  # every release of the window: the seams' groups
PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hook_probe")


def by_when(when):
    return sorted(s.target for s in seams.SEAMS if s.when == when)


@pytest.fixture(scope="module")
def flag_off(tiny_path, tmp_path_factory):
    probe_dir = str(tmp_path_factory.mktemp("probe"))
    srv = LocalServer(["--model-path", tiny_path, "--skip-server-warmup"], str(probe_dir) + "/server.log")
    srv.env = dict(srv.env, SGLANG_HS_HOOK_PROBE_DIR=probe_dir,
                   PYTHONPATH=os.pathsep.join([PROBE, srv.env["PYTHONPATH"]]))
    # Another process binds the rendezvous port between LocalServer's choice and SGLang's bind.
    taken = socket.socket()
    taken.bind(("127.0.0.1", srv.nccl_port))
    taken.listen()
    try:
        with srv:
            r = srv.generate({"rid": "off-1", "input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 3}})
            assert r.status_code == 200, r.text
            reports = [json.load(open(os.path.join(probe_dir, f))) for f in os.listdir(probe_dir)
                       if f.endswith(".json")]
            yield srv, reports, taken.getsockname()[1]
    finally:
        taken.close()


def test_a_start_that_lost_its_port_is_retried_on_fresh_ones(flag_off):
    srv, _, taken = flag_off
    log = open(srv.log_path, errors="replace").read()
    assert srv.attempts == 2, log[-3000:]
    assert "EADDRINUSE" in log or "ddress already in use" in log
    assert srv.nccl_port != taken


def test_no_export_seam_is_applied_in_any_process_without_the_flag(flag_off):
    srv, reports, _ = flag_off
    # This start's processes (the failed start's reported too, before they died).
    launcher = [r for r in reports if r["pid"] == srv.proc.pid]
    children = [r for r in reports if r["ppid"] == srv.proc.pid]
    assert launcher and children, reports
    # The launcher serves HTTP: only the flag parsing and checking are on it. Every process
    # registers those two (SGLang's plugin loading, before any flag is parsed); off the launcher
    # nothing calls them.
    assert launcher[0]["seams"] == by_when(seams.LAUNCH), launcher
    scheduler = [r for r in children if "scheduler" in r["cmdline"]]
    assert scheduler and all(r["seams"] == sorted(by_when(seams.LAUNCH) + by_when(seams.CPU)) for r in scheduler), \
        children
    export = set(by_when(seams.EXPORT))
    assert export and not any(export & set(r["seams"]) for r in launcher + children), reports
