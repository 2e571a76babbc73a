"""Run the stock SGLang launcher on a machine with no GPU (development, CI, the demo)."""

from __future__ import annotations

import os
import sys
from typing import Dict, List, Sequence

SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_shim")

# What SGLang's CPU mode needs, unless the caller already chose otherwise. --sleep-on-idle: an
# idle scheduler otherwise busy-polls a whole core, which on a small CPU box slows everything.
CPU_DEFAULTS = (("--device", "cpu"), ("--attention-backend", "torch_native"), ("--max-total-tokens", "16384"),
                ("--sleep-on-idle", None))


def cpu_env(base: Dict[str, str] = None) -> Dict[str, str]:
    env = dict(os.environ if base is None else base)
    # Without SGLANG_USE_CPU_ENGINE the layers ignore --device cpu.
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SHIM_DIR, env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def cpu_server_argv(args: Sequence[str]) -> List[str]:
    argv = [sys.executable, "-m", "sglang.launch_server", *args]
    for flag, value in CPU_DEFAULTS:
        if not any(a == flag or a.startswith(flag + "=") for a in args):
            argv += [flag] if value is None else [flag, value]
    return argv


def serve_cpu(args: Sequence[str]) -> None:
    """Replace this process with `python -m sglang.launch_server ARGS` in CPU mode."""
    argv = cpu_server_argv(args)
    os.execve(argv[0], argv, cpu_env())
