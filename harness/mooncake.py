"""A real Mooncake master on loopback for the streaming tests (`mooncake_master` from the
venv's mooncake-transfer-engine-non-cuda; TCP, no RDMA, no metadata server: clients use
P2PHANDSHAKE)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence

from sglang_hs.tools.serve import free_port


class MooncakeMaster:
    """`with MooncakeMaster(log) as m:` m.address is "127.0.0.1:PORT"; `kill()` and
    `start()` stop and restart it on the same port (a fault test); `flags` go to
    mooncake_master as they are."""

    def __init__(self, log_path: str, port: Optional[int] = None, flags: Sequence[str] = ()):
        self.flags = list(flags)
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen] = None
        exe = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
        self.exe = exe if os.path.exists(exe) else shutil.which("mooncake_master")
        if self.exe is None:
            raise RuntimeError("mooncake_master not found: `make venv` installs mooncake-transfer-engine-non-cuda")

    def start(self) -> "MooncakeMaster":
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [self.exe, "--rpc_address=127.0.0.1", f"--rpc_port={self.port}", "--metrics_host=127.0.0.1",
             f"--metrics_port={free_port()}", "--enable_http_metadata_server=false", *self.flags],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        t0 = time.time()
        while time.time() - t0 < 30:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}; log:\n"
                                   + open(self.log_path, errors="replace").read()[-3000:])
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.2)
        raise TimeoutError(f"mooncake_master not listening on {self.address} after 30 s")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(30)

    def __enter__(self) -> "MooncakeMaster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill(signal.SIGTERM)
