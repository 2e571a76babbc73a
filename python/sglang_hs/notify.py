"""Writers (scheduler processes) tell the HTTP process when a sample is durable.

/generate answers only after its sample is on disk and in the manifest, so the HTTP side
waits for one message per exported request on a ZeroMQ PUSH/PULL pipe.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from typing import Dict, Optional, Set

import zmq
import zmq.asyncio

from sglang_hs.format import read_manifest

logger = logging.getLogger("sglang_hs.notify")


class Notifier:
    """Scheduler side; shared by the writer threads."""

    def __init__(self, addr: str):
        self._sock = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, 1_000_000)
        self._sock.setsockopt(zmq.LINGER, 5000)
        self._sock.connect(addr)
        self._lock = threading.Lock()

    def __call__(self, msg: dict) -> None:
        with self._lock:
            try:
                self._sock.send_json(msg, flags=zmq.NOBLOCK)
            except zmq.Again:
                logger.error("sglang-hs: could not report sample %s to the HTTP process", msg.get("rid"))


class ExportFailed(ValueError):
    """Raised into /generate: the HTTP layer turns a ValueError into an error response."""

    def __init__(self, message: str, status_code: int = 500):
        super().__init__(message)
        self.status_code = status_code


class ExportWaiter:
    """HTTP side: one PULL socket, results by rid, and the ids already exported."""

    MAX_UNCLAIMED = 100_000

    def __init__(self, addr: str, out_dir: str, timeout_s: float):
        self.timeout_s = timeout_s
        self.exported: Set[str] = {e["id"] for e in read_manifest(out_dir)}
        self._results: "collections.OrderedDict[str, dict]" = collections.OrderedDict()
        self._events: Dict[str, asyncio.Event] = {}
        self._sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._sock.bind(addr)
        self._task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def _recv_loop(self) -> None:
        while True:
            msg = await self._sock.recv_json()
            rid = msg["rid"]
            if msg.get("ok"):
                self.exported.add(rid)
            self._results[rid] = msg
            # Results nobody waits for (client gone) must not pile up.
            while len(self._results) > self.MAX_UNCLAIMED:
                self._results.popitem(last=False)
            ev = self._events.get(rid)
            if ev is not None:
                ev.set()

    async def wait(self, rid: str) -> dict:
        if rid not in self._results:
            ev = self._events.setdefault(rid, asyncio.Event())
            try:
                await asyncio.wait_for(ev.wait(), self.timeout_s)
            except asyncio.TimeoutError:
                raise ExportFailed(
                    f"sample {rid} was not written within {self.timeout_s:.0f} s; see the server log"
                ) from None
            finally:
                self._events.pop(rid, None)
        return self._results.pop(rid)

    def forget(self, rid: str) -> None:
        self._results.pop(rid, None)

    @staticmethod
    def meta_info(result: dict, out_dir: str) -> Optional[dict]:
        if result.get("ok"):
            return {"dir": out_dir, "path": result["path"], "num_tokens": result["num_tokens"],
                    "bytes": result["bytes"]}
        if result.get("aborted"):
            return None
        raise ExportFailed(f"hidden-state export failed: {result.get('error')}", result.get("status", 500))
