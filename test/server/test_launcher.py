"""The stock launcher lists our flags and rejects bad settings before any model loads."""

import json
import os
import subprocess
import sys

import pytest

from sglang_hs.tools.serve import cpu_env

pytestmark = pytest.mark.server
HERE = os.path.dirname(os.path.abspath(__file__))


def test_help_lists_the_export_flags():
    r = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"], env=cpu_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for flag in ("--export-hidden-states-dir", "--export-aux-layer-ids", "--export-host-buffer-gib",
                 "--export-writer-threads", "--export-write-timeout", "--export-allow-untested-model"):
        assert flag in r.stdout


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
        (base + ["--export-hidden-states-dir", ok_dir, "--export-aux-layer-ids", "1", "4", "7"], None),
        (base, None),
    ]
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
