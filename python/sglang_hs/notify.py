"""Writers (scheduler processes) tell the HTTP process when a sample is durable.

/generate answers only after its sample is on disk and in the manifest, so the HTTP side
waits for one message per exported request on a ZeroMQ PUSH/PULL pipe.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
from typing import Dict, Iterable, Optional, Set, Tuple

import zmq
import zmq.asyncio

from sglang_hs.format import read_manifest

logger = logging.getLogger("sglang_hs.notify")
Key = Tuple[str, Optional[str]]


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


class SampleInFlightError(ValueError):
    """The rid is being exported by a request still in flight; retry once it has finished."""

    status_code = 423


class ExportWaiter:
    """HTTP side: one PULL socket, outcomes by (rid, token), the rids in flight and the ids
    already exported.

    Each /generate call carries its own token to the schedulers, so the outcome of an
    earlier request with the same rid (say, aborted when its client died, reported after
    its handler left) is never taken for a later one's.
    """

    MAX_UNCLAIMED = 100_000

    def __init__(self, addr: str, out_dir: str, timeout_s: float):
        self.timeout_s = timeout_s
        self.exported: Set[str] = {e["id"] for e in read_manifest(out_dir)}
        self.in_flight: Set[str] = set()
        self._results: "collections.OrderedDict[Key, dict]" = collections.OrderedDict()
        self._abandoned: "collections.OrderedDict[Key, None]" = collections.OrderedDict()
        self._events: Dict[Key, asyncio.Event] = {}
        self._sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._sock.bind(addr)
        self._task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def _recv_loop(self) -> None:
        while True:
            raw = await self._sock.recv()
            try:
                self.deliver(json.loads(raw))
            except Exception:  # one bad message must not leave every later /generate waiting
                logger.exception("sglang-hs: dropped an undeliverable export notification %.200r", raw)

    def deliver(self, msg: dict) -> None:
        key = (msg["rid"], msg.get("token"))
        if msg.get("ok"):
            self.exported.add(key[0])
        if key in self._abandoned:  # its request has gone; nobody will claim it
            del self._abandoned[key]
            return
        self._results[key] = msg
        _cap(self._results, self.MAX_UNCLAIMED)  # results nobody waits for must not pile up
        ev = self._events.get(key)
        if ev is not None:
            ev.set()

    def admit(self, rids: Iterable[str]) -> None:
        rids = list(rids)
        busy = [r for r in rids if r in self.in_flight]
        if busy:
            raise SampleInFlightError(f"sample id {busy[0]!r} is being exported by a request in flight; "
                                      "retry after it finishes")
        self.in_flight.update(rids)

    def release(self, rids: Iterable[str], token: str, unclaimed: Iterable[str]) -> None:
        """A /generate call is over: free its rids; outcomes it did not wait for are dropped."""
        self.in_flight.difference_update(rids)
        for rid in unclaimed:
            if self._results.pop((rid, token), None) is None:
                self._abandoned[(rid, token)] = None
                _cap(self._abandoned, self.MAX_UNCLAIMED)

    async def wait(self, rid: str, token: str) -> dict:
        key = (rid, token)
        if key not in self._results:
            ev = self._events.setdefault(key, asyncio.Event())
            try:
                await asyncio.wait_for(ev.wait(), self.timeout_s)
            except asyncio.TimeoutError:
                raise ExportFailed(
                    f"sample {rid} was not written within {self.timeout_s:.0f} s; see the server log"
                ) from None
            finally:
                self._events.pop(key, None)
        return self._results.pop(key)

    @staticmethod
    def meta_info(result: dict, out_dir: str) -> Optional[dict]:
        if result.get("ok"):
            return {"dir": out_dir, "path": result["path"], "num_tokens": result["num_tokens"],
                    "bytes": result["bytes"]}
        if result.get("aborted"):
            return None
        raise ExportFailed(f"hidden-state export failed: {result.get('error')}", result.get("status", 500))


def _cap(d: "collections.OrderedDict", n: int) -> None:
    while len(d) > n:
        d.popitem(last=False)
