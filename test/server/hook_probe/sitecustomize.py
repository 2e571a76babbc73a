"""Put first on PYTHONPATH of a server under test (test_hooks_off_cpu.py): each of its Python
processes reports which sglang-hs seams SGLang's HookRegistry has applied there, in
$SGLANG_HS_HOOK_PROBE_DIR/<pid>.json, rewritten whenever that changes. Reads only; registers
and patches nothing."""

import json
import os
import sys
import threading
import time

_DIR = os.environ.get("SGLANG_HS_HOOK_PROBE_DIR")


def _applied_seams():
    hr = sys.modules.get("sglang.srt.plugins.hook_registry")
    if hr is None:
        return None
    reg = hr.HookRegistry
    return sorted(target for target, hooks in list(reg._hooks.items())
                  if target in reg._patched
                  and any(src is not None and src.plugin_name == "sglang_hs" for _, _, src in hooks))


def _watch():
    last = None
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        time.sleep(0.2)
        try:
            seams = _applied_seams()
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            seams = [f"probe error: {e!r}"]
        if seams is None or seams == last:
            continue
        last = seams
        with open(f"/proc/{os.getpid()}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        tmp = os.path.join(_DIR, f".{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), "ppid": os.getppid(), "cmdline": cmdline, "seams": seams}, f)
        os.replace(tmp, os.path.join(_DIR, f"{os.getpid()}.json"))


if _DIR:
    threading.Thread(target=_watch, name="sglang-hs-hook-probe", daemon=True).start()
