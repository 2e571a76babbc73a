"""Run the stock SGLang launcher: `sglang-hs serve-cpu` on a machine with no GPU, and
`LocalServer` to start and stop one from Python (the demo, tests, benchmarks)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

import psutil
import requests

# The sgl_kernel import shim runs inside SGLang's processes, so it lives on the overlay side.
SHIM_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "overlay", "cpu_shim")

# What SGLang's CPU mode needs, unless the caller already chose otherwise. --sleep-on-idle: an
# idle scheduler otherwise busy-polls a whole core, which on a small CPU box slows everything.
CPU_DEFAULTS = (("--device", "cpu"), ("--attention-backend", "torch_native"), ("--max-total-tokens", "16384"),
                ("--sleep-on-idle", None))


def _int_flag(args: Sequence[str], flags: Sequence[str]) -> int:
    for i, a in enumerate(args):
        for flag in flags:
            if a == flag and i + 1 < len(args):
                return int(args[i + 1])
            if a.startswith(flag + "="):
                return int(a.split("=", 1)[1])
    return 1


def ranks_of(args: Sequence[str]) -> int:
    """How many scheduler processes the launcher starts: tensor- times data-parallel ranks."""
    return (_int_flag(args, ("--tp-size", "--tensor-parallel-size"))
            * _int_flag(args, ("--dp-size", "--data-parallel-size")))


def threads_bind(ranks: int, cpus: Sequence[int]) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for `ranks` ranks: the usable cores split into
    contiguous groups, one per rank ("0|1" on two cores); ranks share cores when there are
    fewer cores than ranks. Upstream otherwise wants one NUMA node per rank."""
    cpus = sorted(cpus)
    groups = [cpus[r * len(cpus) // ranks:(r + 1) * len(cpus) // ranks] or [cpus[r % len(cpus)]]
              for r in range(ranks)]
    return "|".join(",".join(map(str, g)) for g in groups)


def cpu_env(base: Dict[str, str] = None, ranks: int = 1) -> Dict[str, str]:
    env = dict(os.environ if base is None else base)
    if ranks > 1:
        cpus = sorted(os.sched_getaffinity(0))
        env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", threads_bind(ranks, cpus))
        # Without AMX upstream binds no threads, so each rank would start one per core.
        env.setdefault("OMP_NUM_THREADS", str(max(1, len(cpus) // ranks)))
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
    os.execve(argv[0], argv, cpu_env(ranks=ranks_of(args)))


_ATTEMPT_MARK = "=== sglang-hs LocalServer: start "


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(p: psutil.Process) -> bool:
    """Running, and not a zombie its parent (the launcher, busy elsewhere) has yet to reap."""
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class LocalServer:
    """`with LocalServer(args, log_path) as srv: requests.post(srv.url + "/generate", ...)`.

    cpu=True runs it the way `sglang-hs serve-cpu` does; otherwise the stock launcher as is.
    """

    # Starts after one that died because a port it was given was taken meanwhile (another
    # server, started at the same moment, bound it first).
    PORT_RETRIES = 2

    def __init__(self, args: Sequence[str], log_path: str, cpu: bool = True, timeout_s: float = 600,
                 port: Optional[int] = None):
        self._fixed_port = port
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._args = [*args]
        # Every TCP port a single-node SGLang binds is chosen here: the HTTP port and the
        # torch.distributed rendezvous (--nccl-port, which SGLang otherwise picks on its own and
        # does not hold until its scheduler binds it), unless the caller gave one.
        # Not with --dp-size > 1: each replica would take the same port (SGLang picks and holds
        # one per replica itself then).
        self.nccl_port = None if _has_flag(args, "--nccl-port") or _int_flag(
            args, ("--dp-size", "--data-parallel-size")) > 1 else free_port()
        self.cpu = cpu
        self.env = cpu_env(ranks=ranks_of(args)) if cpu else dict(os.environ, PYTHONUNBUFFERED="1")
        self.log_path = log_path
        self.timeout_s = timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self.startup_s = 0.0
        self.attempts = 0  # starts made (more than one: a port was taken, see PORT_RETRIES)

    @property
    def argv(self) -> List[str]:
        args = [*self._args, "--port", str(self.port), "--host", "127.0.0.1"]
        if self.nccl_port is not None:
            args += ["--nccl-port", str(self.nccl_port)]
        return cpu_server_argv(args) if self.cpu else [sys.executable, "-m", "sglang.launch_server", *args]

    def __enter__(self) -> "LocalServer":
        t0 = time.time()
        while True:
            self.attempts += 1
            try:
                self._start(t0)
                return self
            except RuntimeError:
                if self.attempts > self.PORT_RETRIES or not self._lost_a_port():
                    raise
            # Fresh ports for the ones chosen here; a port the caller fixed stays.
            self.port = self._fixed_port or free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            if self.nccl_port is not None:
                self.nccl_port = free_port()

    def _start(self, t0: float) -> None:
        self._log = open(self.log_path, "a" if self.attempts > 1 else "w")
        self._log.write(f"{_ATTEMPT_MARK}{self.attempts}: port {self.port}, nccl port {self.nccl_port} ===\n")
        self._log.flush()
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        while time.time() - t0 < self.timeout_s:
            if self.proc.poll() is not None:
                self._log.close()
                raise RuntimeError(f"server exited with {self.proc.returncode}; log:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    self.startup_s = time.time() - t0
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        self.__exit__(None, None, None)
        raise TimeoutError(f"server not healthy after {self.timeout_s} s; log:\n{self.log_tail()}")

    def _lost_a_port(self) -> bool:
        """The start that just ended died because a port it bound was taken."""
        with open(self.log_path, errors="replace") as f:
            text = f.read()
        at = text.rfind(_ATTEMPT_MARK)
        text = text[at:] if at >= 0 else text
        return "EADDRINUSE" in text or "Address already in use" in text or "address already in use" in text

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            workers = self._workers()
            os.killpg(self.proc.pid, signal.SIGTERM)
            # The schedulers drain (write what they queued) and exit; the launcher, seeing a
            # child gone, then sleeps 5 s "for crash diagnostics" before it exits. With its
            # workers gone it has nothing left to stop: half a second is enough.
            deadline = time.time() + 30
            while any(_alive(w) for w in workers) and time.time() < deadline:
                time.sleep(0.1)
            try:
                self.proc.wait(0.5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    def _workers(self) -> List[psutil.Process]:
        """The launcher's child processes, less multiprocessing's resource tracker (which
        lives as long as the launcher)."""
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        workers = []
        for c in children:
            try:
                if not any("resource_tracker" in a for a in c.cmdline()):
                    workers.append(c)
            except psutil.Error:
                pass
        return workers

    @property
    def export_dir(self) -> Optional[str]:
        """The server's --export-hidden-states-dir, as given."""
        argv = self.argv
        for i, x in enumerate(argv):
            if x == "--export-hidden-states-dir" and i + 1 < len(argv):
                return argv[i + 1]
            if x.startswith("--export-hidden-states-dir="):
                return x.split("=", 1)[1]
        return None

    def log_tail(self, n: int = 60) -> str:
        """The log's last n lines, after its first traceback when that came earlier (a crash
        in one process is often followed by other processes' errors as the server stops)."""
        with open(self.log_path, errors="replace") as f:
            lines = f.readlines()
        first = next((i for i, line in enumerate(lines) if line.startswith("Traceback")), None)
        if first is None or first >= len(lines) - n:
            return "".join(lines[-n:])
        head = lines[first:min(first + 40, len(lines) - n)]
        return "".join(head + [f"[... {len(lines) - n - first - len(head)} lines ...]\n"] + lines[-n:])

    def generate(self, payload: dict, timeout: float = 600) -> requests.Response:
        return requests.post(self.url + "/generate", json=payload, timeout=timeout)
