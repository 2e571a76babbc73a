"""Release canary: `make canary SGLANG=0.5.24` (or `python -m harness.canary 0.5.24`).

Installs one SGLang release from PyPI into a scratch venv (sglang-hs on top, no deps), runs
the seam conformance tests and the release table's tests there, and prints, per seam and per
upstream fact, what holds and what changed, plus the classes with an EAGLE-3 setter that the
README's family table does not date yet. The first step when a new release appears
(FORK_NOTES.md, "Bumping the window"); nothing in the repository is changed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The canary runs under the machine's Python, not a venv with sglang-hs installed.
sys.path.insert(0, os.path.join(REPO, "python"))
from sglang_hs.overlay.releases import version_tuple  # noqa: E402  (stdlib-only module)
TESTS = ["test/unit/test_seams.py", "test/unit/test_releases.py"]


def run(cmd, **kw):
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def scratch_venv(version: str, root: str) -> str:
    venv = os.path.join(root, f"sglang-hs-canary-{version}")
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(os.path.join(venv, ".installed")):
        run([sys.executable, "-m", "venv", venv])
        run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"])
        run([py, "-m", "pip", "install", "-q", f"sglang=={version}", "pytest", "hypothesis"])
        # --no-deps: the canary checks this release as it is, even outside the declared range.
        run([py, "-m", "pip", "install", "-q", "--no-deps", "-e", REPO])
        open(os.path.join(venv, ".installed"), "w").close()
    return py


def outcomes(pytest_output: str):
    """(test id, PASSED/FAILED/ERROR) from `pytest -rA` short summary lines."""
    return re.findall(r"^(PASSED|FAILED|ERROR) (\S+)", pytest_output, re.M)


def new_classes(py: str, version: str):
    """Classes with an EAGLE-3 setter in this release that the README table has not dated."""
    code = ("import json, sys; sys.path.insert(0, 'test/unit'); import runpy; "
            "ns = runpy.run_path('test/unit/test_seams.py'); rows, since = ns['readme_family_table'](); "
            "print('TABLE ' + json.dumps(since))")
    out = subprocess.run([py, "-c", code], cwd=REPO, capture_output=True, text=True)
    line = [x for x in out.stdout.splitlines() if x.startswith("TABLE ")]
    probe = subprocess.run([py, os.path.join(REPO, "test", "unit", "conformance_probe.py")], cwd=REPO,
                           capture_output=True, text=True, env=cpu_env(py))
    pl = [x for x in probe.stdout.splitlines() if x.startswith("PROBE_JSON ")]
    if not line or not pl:
        return None, (probe.stderr or out.stderr)[-3000:]
    dated = json.loads(line[0][len("TABLE "):])
    here = {c for c, v in dated.items() if version_tuple(v) <= version_tuple(version)}
    found = set(json.loads(pl[0][len("PROBE_JSON "):])["eagle3_classes"])
    return {"added": sorted(found - set(dated)), "lost": sorted(here - found)}, None


def cpu_env(py: str):
    code = "import json; from sglang_hs.tools.serve import cpu_env; print(json.dumps(cpu_env()))"
    return json.loads(subprocess.run([py, "-c", code], capture_output=True, text=True, check=True).stdout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("version", help="an SGLang release on PyPI, e.g. 0.5.24")
    ap.add_argument("--root", default=os.environ.get("TMPDIR", tempfile.gettempdir()),
                    help="where the scratch venv goes (about 10 GB; reused by a second run)")
    a = ap.parse_args(argv)
    py = scratch_venv(a.version, a.root)
    r = subprocess.run([py, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *TESTS], cwd=REPO,
                       capture_output=True, text=True)
    results = outcomes(r.stdout)
    changed = [(o, t) for o, t in results if o != "PASSED"]
    print(f"\nSGLang {a.version}: {len(results) - len(changed)} of {len(results)} conformance checks hold")
    for o, t in results:
        print(f"  {'ok     ' if o == 'PASSED' else 'CHANGED'} {t.split('::', 1)[1]}")
    classes, err = new_classes(py, a.version)
    if classes is None:
        print("the conformance probe did not run (an import failed: a missing sgl_kernel name is the usual "
              "cause; add it to the CPU shim):\n" + err)
        return 1
    print(f"classes with an EAGLE-3 setter not in the README table: {classes['added'] or 'none'}; "
          f"dated there but gone: {classes['lost'] or 'none'}")
    if changed:
        print("\nFailures in full (each names the seam or fact to revisit):\n" + r.stdout[-8000:])
    return 1 if changed or classes["added"] or classes["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
