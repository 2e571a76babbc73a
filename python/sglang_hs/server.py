"""Start and stop a real SGLang server from Python (demo, benchmarks, tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import List, Optional, Sequence

import requests

from sglang_hs.cpu import cpu_env, cpu_server_argv, tp_size_of


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`with Server(args, log_path) as srv: requests.post(srv.url + "/generate", ...)`.

    cpu=True runs it the way `sglang-hs serve-cpu` does; otherwise the stock launcher as is.
    """

    def __init__(self, args: Sequence[str], log_path: str, cpu: bool = True, timeout_s: float = 600,
                 port: Optional[int] = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [*args, "--port", str(self.port), "--host", "127.0.0.1"]
        self.argv: List[str] = cpu_server_argv(args) if cpu else [sys.executable, "-m", "sglang.launch_server", *args]
        self.env = cpu_env(tp_size=tp_size_of(args)) if cpu else dict(os.environ, PYTHONUNBUFFERED="1")
        self.log_path = log_path
        self.timeout_s = timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self.startup_s = 0.0

    def __enter__(self) -> "Server":
        t0 = time.time()
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        while time.time() - t0 < self.timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    self.startup_s = time.time() - t0
                    return self
            except requests.RequestException:
                pass
            time.sleep(1)
        self.__exit__(None, None, None)
        raise TimeoutError(f"server not healthy after {self.timeout_s} s; log:\n{self.log_tail()}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    def log_tail(self, n: int = 60) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def generate(self, payload: dict, timeout: float = 600) -> requests.Response:
        return requests.post(self.url + "/generate", json=payload, timeout=timeout)
