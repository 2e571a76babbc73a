"""Writers (scheduler processes) tell the HTTP process when a sample is durable.

/generate answers only after its sample is on disk and in the manifest, so the HTTP side
waits for one `protocol.Outcome` per exported request on a ZeroMQ PUSH/PULL pipe.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import logging
import os
import threading
from typing import Dict, Iterable, Optional, Set, Tuple

import zmq
import zmq.asyncio

from sglang_hs.overlay.ids import IdIndex
from sglang_hs.protocol import ExportError, Outcome

logger = logging.getLogger("sglang_hs.overlay.notify")
Key = Tuple[str, Optional[str]]  # (rid, call id)


class Notifier:
    """Scheduler side; shared by the writer threads."""

    def __init__(self, addr: str):
        self._sock = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, 1_000_000)
        self._sock.setsockopt(zmq.LINGER, 5000)
        self._sock.connect(addr)
        self._lock = threading.Lock()

    def __call__(self, outcome: Outcome) -> None:
        with self._lock:
            try:
                self._sock.send(outcome.to_bytes(), flags=zmq.NOBLOCK)
            except zmq.Again:
                logger.error("sglang-hs: could not report sample %s to the HTTP process", outcome.rid)


class ExportWaiter:
    """HTTP side: one PULL socket, outcomes by (rid, call id), the rids in flight and (on disk)
    the ids already exported.

    Each /generate call carries its own call id to the schedulers, so the outcome of an
    earlier request with the same rid (say, aborted when its client died, reported after
    its handler left) is never taken for a later one's.
    """

    MAX_UNCLAIMED = 100_000

    def __init__(self, addr: str, out_dir: str, timeout_s: float):
        self.timeout_s = timeout_s
        self.exported = IdIndex(out_dir)  # the done ids, on disk: memory stays flat (overlay/ids.py)
        self.in_flight: Set[str] = set()
        self._results: "collections.OrderedDict[Key, Outcome]" = collections.OrderedDict()
        self._abandoned: "collections.OrderedDict[Key, None]" = collections.OrderedDict()
        # Live capture: calls answered before their sample; each rid stays in flight until
        # its outcome arrives, so a resend meanwhile is not exported a second time.
        self._live: Set[Key] = set()
        self._events: Dict[Key, asyncio.Event] = {}
        self._sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._sock.bind(addr)
        if addr.startswith("ipc://"):  # the socket is a file; leave none behind
            atexit.register(_remove, addr[len("ipc://"):])
        self._task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def _recv_loop(self) -> None:
        while True:
            raw = await self._sock.recv()
            try:
                self.deliver(Outcome.from_bytes(raw))
            except Exception:  # one bad message must not leave every later /generate waiting
                logger.exception("sglang-hs: dropped an undeliverable export notification %.200r", raw)

    def deliver(self, outcome: Outcome) -> None:
        key = (outcome.rid, outcome.call_id)
        if outcome.ok:  # the directory's writer claimed it already; a trainer's sink did not
            try:
                self.exported.add(outcome.rid)
            except Exception:  # noqa: BLE001 - a full disk must not keep the outcome from its request
                logger.exception("sglang-hs: could not record exported id %s in the id index", outcome.rid)
        if key in self._live:
            self._live.discard(key)
            self.in_flight.discard(outcome.rid)
        if key in self._abandoned:  # its request has gone; nobody will claim it
            del self._abandoned[key]
            return
        self._results[key] = outcome
        _cap(self._results, self.MAX_UNCLAIMED)  # results nobody waits for must not pile up
        ev = self._events.get(key)
        if ev is not None:
            ev.set()

    def admit(self, rids: Iterable[str]) -> None:
        """A call's exported rids (admission.admit refused those in flight) are now in flight."""
        self.in_flight.update(rids)

    def release(self, rids: Iterable[str], call_id: str, unclaimed: Iterable[str], live: bool = False) -> None:
        """A /generate call is over: free its rids; outcomes it did not wait for are dropped.
        live: its rids without an outcome yet stay in flight until the outcome arrives."""
        waiting = set()
        for rid in unclaimed:
            if self._results.pop((rid, call_id), None) is None:
                self._abandoned[(rid, call_id)] = None
                _cap(self._abandoned, self.MAX_UNCLAIMED)
                if live:
                    waiting.add(rid)
                    self._live.add((rid, call_id))
        self.in_flight.difference_update(r for r in rids if r not in waiting)

    async def wait(self, rid: str, call_id: str) -> Outcome:
        key = (rid, call_id)
        if key not in self._results:
            ev = self._events.setdefault(key, asyncio.Event())
            try:
                await asyncio.wait_for(ev.wait(), self.timeout_s)
            except asyncio.TimeoutError:
                raise ExportError(
                    f"sample {rid} was not written within {self.timeout_s:.0f} s; see the server log"
                ) from None
            finally:
                self._events.pop(key, None)
        return self._results.pop(key)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _cap(d: "collections.OrderedDict", n: int) -> None:
    while len(d) > n:
        d.popitem(last=False)
