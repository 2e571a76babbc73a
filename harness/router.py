"""A real `sglang-router` (SGLang's load balancer, the Rust router from PyPI) on loopback in
front of CPU servers, for the scale-out tests and benchmark."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import List, Optional, Sequence

import requests

from sglang_hs.tools.serve import free_port


# The router as docs/scale-out.md sets it up for capture: the manual policy (a key stays on its
# worker) and nothing that takes a worker out, which is what would move a key: no retries (they
# resend a dead worker's requests to a live one), no circuit breaker, no health checks. A dead
# worker's requests then fail, and the capture resends them once it answers again.
ROUTER_FOR_CAPTURE = ("--policy", "manual", "--disable-retries", "--disable-circuit-breaker", "--disable-health-check")


class LocalRouter:
    """`with LocalRouter(worker_urls, log, "--policy", "manual") as r:` r.url takes requests
    the way the workers do; extra args go to `python -m sglang_router.launch_router`."""

    def __init__(self, workers: Sequence[str], log_path: str, *args: str, timeout_s: float = 120):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers = list(workers)
        self.argv: List[str] = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                "--port", str(self.port), "--worker-urls", *self.workers,
                                "--prometheus-port", str(free_port()), *args]
        self.log_path = log_path
        self.timeout_s = timeout_s
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "LocalRouter":
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        log.close()
        t0 = time.time()
        while time.time() - t0 < self.timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}; log:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise TimeoutError(f"router not healthy after {self.timeout_s} s; log:\n{self.log_tail()}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def log_tail(self, n: int = 60) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
