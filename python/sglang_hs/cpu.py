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


def tp_size_of(args: Sequence[str]) -> int:
    for i, a in enumerate(args):
        for flag in ("--tp-size", "--tensor-parallel-size"):
            if a == flag and i + 1 < len(args):
                return int(args[i + 1])
            if a.startswith(flag + "="):
                return int(a.split("=", 1)[1])
    return 1


def threads_bind(tp_size: int, cpus: Sequence[int]) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for `tp_size` ranks: the usable cores split into
    contiguous groups, one per rank ("0|1" on two cores); ranks share cores when there are
    fewer cores than ranks. Upstream otherwise wants one NUMA node per rank."""
    cpus = sorted(cpus)
    groups = [cpus[r * len(cpus) // tp_size:(r + 1) * len(cpus) // tp_size] or [cpus[r % len(cpus)]]
              for r in range(tp_size)]
    return "|".join(",".join(map(str, g)) for g in groups)


def cpu_env(base: Dict[str, str] = None, tp_size: int = 1) -> Dict[str, str]:
    env = dict(os.environ if base is None else base)
    if tp_size > 1:
        cpus = sorted(os.sched_getaffinity(0))
        env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", threads_bind(tp_size, cpus))
        # Without AMX upstream binds no threads, so each rank would start one per core.
        env.setdefault("OMP_NUM_THREADS", str(max(1, len(cpus) // tp_size)))
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
    os.execve(argv[0], argv, cpu_env(tp_size=tp_size_of(args)))
