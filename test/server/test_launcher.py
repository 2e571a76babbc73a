"""The stock launcher lists our flags and rejects bad settings before any model loads."""

import json
import os
import subprocess
import sys

import pytest
import requests

from sglang_hs.overlay.releases import BY_NAME, ROW_BREAKING_FLAGS, installed
from sglang_hs.tools.convert import compare_with_server
from sglang_hs.tools.serve import LocalServer, cpu_env

pytestmark = pytest.mark.server
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.core
def test_help_lists_the_export_flags():
    r = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"], env=cpu_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for flag in ("--export-hidden-states-dir", "--export-aux-layer-ids", "--export-host-buffer-gib",
                 "--export-writer-threads", "--export-write-timeout", "--export-allow-untested-model",
                 "--platform-preset"):
        assert flag in r.stdout


@pytest.mark.core
def test_bad_settings_fail_fast_with_a_message_that_says_what_to_do(tiny_path, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    other = tmp_path / "other-model-export"
    other.mkdir()
    (other / "export.json").write_text(json.dumps({"model_path": "/models/something-else"}))
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    # root writes through file modes, so an unwritable directory has to be a read-only mount.
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(read_only)]).returncode == 0
    base = ["--model-path", tiny_path, "--device", "cpu", "--attention-backend", "torch_native"]
    ok_dir = str(tmp_path / "ok")
    cases = [
        (base + ["--export-hidden-states-dir", str(blocker / "sub")], "cannot create or write"),
        (base + ["--export-hidden-states-dir", str(read_only / "hs")], "Read-only file system"),
        (base + ["--export-hidden-states-dir", ok_dir, "--export-aux-layer-ids", "0", "4"], "out of range"),
        (base + ["--export-hidden-states-dir", ok_dir, "--export-aux-layer-ids", "2", "8"], "in [1, 7]"),
        (base + ["--export-hidden-states-dir", ok_dir, "--export-aux-layer-ids", "4", "2"], "strictly increasing"),
        (base + ["--export-hidden-states-dir", ok_dir, "--export-aux-layer-ids", "3", "3"], "strictly increasing"),
        (base + ["--export-hidden-states-dir", ok_dir, "--pp-size", "2"], "not supported yet"),
        (base + ["--export-hidden-states-dir", ok_dir, "--nnodes", "2", "--node-rank", "0",
                 "--dist-init-addr", "127.0.0.1:5757"], "--nnodes > 1 is not supported yet"),
        (base + ["--export-hidden-states-dir", str(other)], "another configuration"),
        (base + ["--export-hidden-states-dir", ok_dir, "--speculative-algorithm", "EAGLE3",
                 "--speculative-draft-model-path", tiny_path], "rows of draft tokens that are then rejected"),
        (base + ["--platform-preset", "sm120"], "is unknown; the presets are: sm120-pcie-tp8"),
        (base + ["--export-hidden-states-dir", ok_dir, "--export-aux-layer-ids", "1", "4", "7"], None),
        (base, None),
    ]
    # Upstream flags that break the row plan, refused on the releases that have them.
    for field, (diff, why) in ROW_BREAKING_FLAGS.items():
        if BY_NAME[diff].applies(installed()):
            needs = ["--speculative-algorithm", "EAGLE3"] if field == "enable_return_aux_hidden_states" else []
            cases.append((base + ["--export-hidden-states-dir", ok_dir, "--" + field.replace("_", "-"), *needs], why))
    try:
        r = subprocess.run([sys.executable, os.path.join(HERE, "launcher_probe.py"),
                            json.dumps([c for c, _ in cases])], env=cpu_env(), capture_output=True, text=True,
                           timeout=600)
    finally:
        if mounted:
            subprocess.run(["umount", str(read_only)])
    assert mounted, "could not mount a read-only tmpfs (the unwritable-directory case needs one)"
    line = [x for x in r.stdout.splitlines() if x.startswith("PROBE_JSON ")]
    assert line, r.stdout[-2000:] + r.stderr[-4000:]
    results = json.loads(line[0][len("PROBE_JSON "):])
    for (argv, want), got in zip(cases, results):
        if want is None:
            assert got["ok"], (argv, got)
        else:
            assert not got["ok"] and want in got["message"] and got["message"].startswith("sglang-hs: error:"), \
                (argv, got)


def test_a_platform_preset_reaches_the_schedulers_and_what_the_user_set_wins(tiny_path, tmp_path):
    """The seed's SM120 set on a CPU server: NCCL variables the user did not set reach the
    scheduler (export.json records what it saw), the user's own NCCL_PROTO and the
    --attention-backend that serve-cpu gives win, the preset's other flag is applied, and the
    launcher log says what was set and why."""
    out = str(tmp_path / "hs")
    srv = LocalServer(["--model-path", tiny_path, "--export-hidden-states-dir", out, "--platform-preset",
                       "sm120-pcie-tp8", "--skip-server-warmup"], str(tmp_path / "server.log"))
    srv.env = dict(srv.env, NCCL_PROTO="Simple")
    with srv:
        info = requests.get(srv.url + "/get_server_info", timeout=30).json()
    numerics = json.load(open(os.path.join(out, "export.json")))["numerics"]
    assert numerics["env"]["NCCL_ALGO"] == "Ring" and numerics["env"]["NCCL_NTHREADS"] == "512"
    assert numerics["env"]["NCCL_PROTO"] == "Simple" and numerics["platform_preset"] == "sm120-pcie-tp8"
    assert numerics["attention_backend"] == "torch_native" and info["attention_backend"] == "torch_native"
    assert info["num_continuous_decode_steps"] == 4
    # `inspect --against`: the server the export came from computes with the same numerics; one
    # that would serve with another attention backend and TP size is named.
    export = json.load(open(os.path.join(out, "export.json")))
    assert compare_with_server(export, info) == []
    other = compare_with_server(export, dict(info, attention_backend="triton", tp_size=8))
    assert other == ["attention_backend: captured with 'torch_native', served with 'triton'",
                     "tp_size: captured with 1, served with 8"]
    log = open(tmp_path / "server.log").read()
    assert "platform preset sm120-pcie-tp8: NCCL_ALGO=Ring (Ring:" in log
    assert "NCCL_PROTO=Simple kept (set by you" in log and "--attention-backend torch_native kept" in log
