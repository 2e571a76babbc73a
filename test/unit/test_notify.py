"""The writer -> HTTP notification pipe: real ZeroMQ sockets, no server.

/generate answers with the outcome of its own request only: an outcome reported late for an
earlier request with the same rid (one aborted when its client died) must never be taken
for a later one's, and a rid still in flight is refused with a retryable status.
"""

import asyncio
import tracemalloc

import pytest

from sglang_hs.overlay.notify import ExportWaiter, Notifier
from sglang_hs.protocol import Outcome


def ok(rid, call_id):
    return Outcome(rid, call_id, ok=True, path=f"dp0-00000/{rid}.safetensors", num_tokens=3, bytes=100)


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


@pytest.fixture
def addr(tmp_path):
    return f"ipc://{tmp_path}/notify"


def test_late_outcome_of_an_aborted_request_is_not_taken_by_the_next_with_that_rid(addr, tmp_path):
    async def main():
        w = ExportWaiter(addr, str(tmp_path), timeout_s=10)
        push = Notifier(addr)
        # First call: its client died, the handler left before the scheduler reported.
        w.admit(["s1"])
        w.release(["s1"], "t1", unclaimed=["s1"])
        # Second call with the same rid is admitted and starts waiting ...
        w.admit(["s1"])
        waiting = asyncio.ensure_future(w.wait("s1", "t2"))
        # ... then the first call's abort arrives, and only then the second's success.
        push(Outcome("s1", "t1", aborted=True))
        await asyncio.sleep(0.2)
        assert not waiting.done(), "took the earlier request's outcome"
        push(ok("s1", "t2"))
        got = await asyncio.wait_for(waiting, 5)
        w.release(["s1"], "t2", unclaimed=[])
        return w, got

    w, got = run(main())
    assert got.ok and got.call_id == "t2"
    assert "s1" in w.exported and not w.in_flight
    assert not w._results and not w._abandoned, "dropped outcomes must not be kept"


def test_an_outcome_that_arrives_before_its_waiter_is_kept(addr, tmp_path):
    async def main():
        w = ExportWaiter(addr, str(tmp_path), timeout_s=10)
        Notifier(addr)(ok("s2", "t"))
        await asyncio.sleep(0.2)
        return await asyncio.wait_for(w.wait("s2", "t"), 5)

    assert run(main()).ok


def test_a_live_call_keeps_its_rids_in_flight_until_their_outcomes_arrive(addr, tmp_path):
    """Live capture answers before the sample is written: a resend of the rid meanwhile
    must be seen as in flight (admission then serves it unexported), not exported twice."""
    async def main():
        w = ExportWaiter(addr, str(tmp_path), timeout_s=10)
        push = Notifier(addr)
        w.admit(["a", "b", "c"])
        push(ok("c", "t"))  # c's sample was durable before its answer went out
        await asyncio.sleep(0.2)
        w.release(["a", "b", "c"], "t", unclaimed=["a", "b", "c"], live=True)
        assert w.in_flight == {"a", "b"}
        push(ok("a", "t"))
        push(Outcome("b", "t", error="dropped: the host buffer was full (live capture)", status=503))
        await asyncio.sleep(0.2)
        return w

    w = run(main())
    assert not w.in_flight and not w._results and not w._abandoned
    assert "a" in w.exported and "c" in w.exported and "b" not in w.exported


def test_a_success_reported_after_its_client_left_still_counts_as_exported(addr, tmp_path):
    async def main():
        w = ExportWaiter(addr, str(tmp_path), timeout_s=10)
        w.admit(["s3"])
        w.release(["s3"], "t", unclaimed=["s3"])
        Notifier(addr)(ok("s3", "t"))
        await asyncio.sleep(0.2)
        return w

    w = run(main())
    assert "s3" in w.exported and not w._results


def test_a_message_that_cannot_be_delivered_does_not_stop_the_receiver(addr, tmp_path):
    """The receiver used to die on the first bad message, after which every /generate waited
    its full timeout."""
    async def main():
        w = ExportWaiter(addr, str(tmp_path), timeout_s=5)
        push = Notifier(addr)
        for raw in (b'{"no": "rid"}', b'["not", "a", "dict"]', b"\xff not json", b'{"rid": "x", "call_id": null, "ok": 1, "extra": 2}'):
            push._sock.send(raw)
        w.admit(["s2"])
        push(ok("s2", "t"))
        return await w.wait("s2", "t")

    assert run(main()).ok


def test_the_socket_file_is_removed_when_the_http_process_exits(tmp_path):
    """The ipc:// socket file used to stay in the temp folder after every server run."""
    import subprocess
    import sys

    sock = tmp_path / "notify"
    code = ("import asyncio\nfrom sglang_hs.overlay.notify import ExportWaiter\n"
            f"async def main():\n    ExportWaiter('ipc://{sock}', '{tmp_path}', 5)\n"
            "asyncio.run(main())\nimport os\nprint('BOUND', os.path.exists(" + repr(str(sock)) + "))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "BOUND True" in r.stdout, r.stdout + r.stderr
    assert not sock.exists()


def test_a_long_run_holds_no_id_per_exported_sample_in_memory(addr, tmp_path):
    """Weeks of live capture: the HTTP process's memory must not grow with the samples done
    (a set of every exported id did, about 80 bytes an id); done ids are on disk (ids.py)."""
    async def main():
        w = ExportWaiter(addr, str(tmp_path), timeout_s=10)

        def calls(start, n):  # each: admitted, its sample reported durable, the call over
            for i in range(start, start + n):
                rid = f"live-{i:012d}"
                w.admit([rid])
                w.deliver(ok(rid, "t"))
                w.release([rid], "t", unclaimed=[rid])

        calls(0, 5000)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        calls(5000, 60000)
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        return w, grown

    w, grown = run(main())
    assert "live-000000000000" in w.exported and "live-000000064999" in w.exported
    assert "live-000000065000" not in w.exported and not w.in_flight
    assert grown < 256 << 10, f"{grown} bytes more after 60,000 samples"
