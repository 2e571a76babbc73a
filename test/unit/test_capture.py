"""The capture client against scripted HTTP servers (aiohttp on localhost): what the client
does with each kind of answer, with a server that goes away, and with a dataset read as it
is sent. The live-server version is test/server/test_capture_cpu.py."""

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
from collections import Counter

import pytest
from aiohttp import web
from hypothesis import given, strategies as st

from sglang_hs.format import SampleIdError
from sglang_hs.tools.capture import (FAILED, JOURNAL, CaptureConfig, ServersChangedError, _capture, capture,
                                     check_servers, load_done, server_for)


def exported(body, n=None):
    return web.json_response({"meta_info": {"hidden_states_export": {
        "dir": "d", "path": f"p/{body['rid']}", "num_tokens": n or len(body["input_ids"]), "bytes": 10}}})


async def healthy(request):
    return web.Response(text="ok")


@contextlib.asynccontextmanager
async def scripted_server(generate, port=0):
    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", healthy)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_records(path, n, start=0):
    path.write_text("".join(json.dumps({"input_ids": [1, 2, start + i]}) + "\n" for i in range(n)))


@given(st.text(min_size=1, max_size=40), st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=6, unique=True))
def test_a_sample_always_goes_to_the_same_server(sid, servers):
    first = server_for(sid, servers)
    assert first in servers
    assert all(server_for(sid, list(servers)) == first for _ in range(3))


def test_samples_spread_over_the_servers():
    counts = Counter(server_for(f"{i:08d}-{i * 7919:x}", ["a", "b", "c"]) for i in range(3000))
    assert all(800 < c < 1200 for c in counts.values()), counts


def test_a_rerun_with_another_server_list_is_refused_unless_allowed(tmp_path):
    out = str(tmp_path)
    check_servers(out, ["http://a", "http://b"], allow_new=False)
    check_servers(out, ["http://a", "http://b"], allow_new=False)  # the same list resumes
    with pytest.raises(ServersChangedError, match="same list in the same order"):
        check_servers(out, ["http://b", "http://a"], allow_new=False)
    check_servers(out, ["http://a", "http://b", "http://c"], allow_new=True)
    with pytest.raises(ServersChangedError):
        check_servers(out, ["http://a", "http://b"], allow_new=False)


def test_journal_survives_a_torn_last_line(tmp_path):
    (tmp_path / "capture.jsonl").write_text(json.dumps({"id": "a", "path": "p"}) + "\n" + '{"id": "b", "pa')
    assert set(load_done(str(tmp_path))) == {"a"}  # b is simply sent again (409 if it was durable)


def test_capture_retries_in_flight_ids_and_records_odd_answers_without_stopping(tmp_path):
    """423 (the id is still in flight on the server) is retried, 409 counts as exported, and a
    200 without export info or a 400 fails that sample only."""
    data = tmp_path / "data.jsonl"
    write_records(data, 4, start=3)
    seen = Counter()

    async def generate(request):
        body = await request.json()
        kind = body["input_ids"][2] - 3
        seen[kind] += 1
        if kind == 0 and seen[kind] == 1:
            return web.json_response({"error": {"message": "in flight"}}, status=423)
        if kind == 0:
            return exported(body)
        if kind == 1:
            return web.json_response({"error": {"message": "already exported"}}, status=409)
        if kind == 2:
            return web.json_response({"meta_info": {"id": body["rid"]}})
        return web.json_response({"error": {"message": "bad loss_mask"}}, status=400)

    async def main():
        async with scripted_server(generate) as url:
            cfg = CaptureConfig(servers=[url], data=str(data), out=str(tmp_path / "out"), progress=False, retries=3)
            return await _capture(cfg, tok=None)

    s = asyncio.run(main())
    assert (s.exported, s.already_exported, s.failed, s.total) == (1, 1, 2, 4)
    assert seen[0] == 2, "423 must be retried"
    assert len(load_done(str(tmp_path / "out"))) == 2
    failed = [json.loads(x) for x in (tmp_path / "out" / FAILED).read_text().splitlines()]
    assert any("hidden_states_export" in f["error"] for f in failed)
    assert any("HTTP 400" in f["error"] for f in failed)
    assert (tmp_path / "out" / JOURNAL).exists()


def test_an_id_prefix_the_server_would_refuse_stops_the_run_before_it_starts(tmp_path):
    cfg = CaptureConfig(servers=["http://127.0.0.1:9"], data=str(tmp_path / "none.jsonl"), out=str(tmp_path),
                        id_prefix="_run")
    with pytest.raises(SampleIdError, match="--id-prefix '_run'"):
        capture(cfg)


def test_a_malformed_jsonl_line_fails_that_record_only(tmp_path):
    """One line that is not JSON used to abort the whole run before anything was sent; it is
    now that record's failure, and the records around it are sent."""
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n" + '{"input_ids": [1, 2\n'
                    + json.dumps({"input_ids": [4, 5, 6]}) + "\n")
    sent = []

    async def generate(request):
        body = await request.json()
        sent.append(body["input_ids"])
        return exported(body)

    async def main():
        async with scripted_server(generate) as url:
            cfg = CaptureConfig(servers=[url], data=str(data), out=str(tmp_path / "out"), progress=False)
            return await _capture(cfg, tok=None)

    s = asyncio.run(main())
    assert (s.total, s.exported, s.failed) == (3, 2, 1)
    assert sorted(sent) == [[1, 2, 3], [4, 5, 6]]
    failed = [json.loads(x) for x in (tmp_path / "out" / FAILED).read_text().splitlines()]
    assert len(failed) == 1 and "data.jsonl:2: not JSON" in failed[0]["error"]


def test_records_are_sent_while_the_dataset_is_still_being_read(tmp_path):
    """The client used to read and tokenise the whole dataset, and create a task per sample,
    before sending anything: memory grew with the dataset. Fed through a pipe whose writer
    holds back the rest until the server has seen a request, it now sends the first records
    while the rest are unread, and never has more than `concurrency` unanswered."""
    fifo = str(tmp_path / "data.fifo")
    os.mkfifo(fifo)
    first_request, live, peak = threading.Event(), [0], [0]

    def feed():
        with open(fifo, "w") as f:
            for i in range(6):
                f.write(json.dumps({"input_ids": [1, 2, i]}) + "\n")
            f.flush()
            held_back = first_request.wait(30)
            for i in range(6, 40):
                f.write(json.dumps({"input_ids": [1, 2, i]}) + "\n")
            if not held_back:
                f.write("the client sent nothing before reading the whole dataset\n")

    async def generate(request):
        body = await request.json()
        first_request.set()
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        await asyncio.sleep(0.02)
        live[0] -= 1
        return exported(body)

    async def main():
        async with scripted_server(generate) as url:
            cfg = CaptureConfig(servers=[url], data=fifo, out=str(tmp_path / "out"), progress=False, concurrency=4)
            return await _capture(cfg, tok=None)

    writer = threading.Thread(target=feed)
    writer.start()
    s = asyncio.run(main())
    writer.join()
    assert (s.total, s.exported, s.failed) == (40, 40, 0), (tmp_path / "out" / FAILED).read_text()
    assert peak[0] <= 4


def test_a_server_that_goes_away_is_waited_for_and_its_samples_are_resent(tmp_path):
    """When the server died, the client used to fail every remaining sample after a few quick
    retries. It now waits for the server to answer /health again and resends to it."""
    data = tmp_path / "data.jsonl"
    write_records(data, 6)
    port = free_port()

    async def generate(request):
        return exported(await request.json())

    async def main():
        cfg = CaptureConfig(servers=[f"http://127.0.0.1:{port}"], data=str(data), out=str(tmp_path / "out"),
                            progress=False, retries=1, server_wait_s=60)
        run = asyncio.ensure_future(_capture(cfg, tok=None))
        await asyncio.sleep(3)  # nothing listens on the port yet: connections are refused
        async with scripted_server(generate, port):
            return await run

    s = asyncio.run(main())
    assert (s.exported, s.failed, s.interrupted) == (6, 0, False)


def test_a_server_that_stays_away_stops_the_run_and_a_rerun_resumes(tmp_path):
    """Samples not sent because the server was gone are not marked failed: the run stops,
    says why, and the rerun sends exactly those."""
    data = tmp_path / "data.jsonl"
    write_records(data, 5)
    port = free_port()
    out = str(tmp_path / "out")
    cfg = CaptureConfig(servers=[f"http://127.0.0.1:{port}"], data=str(data), out=out, progress=False,
                        retries=2, server_wait_s=2, concurrency=2)
    t0 = time.monotonic()
    s = asyncio.run(_capture(cfg, tok=None))
    assert s.interrupted and "not back within 2 s" in s.stopped_because
    assert s.failed == 0 and time.monotonic() - t0 < 30
    assert "rerun to resume" in s.line()

    async def rerun():
        async def generate(request):
            return exported(await request.json())

        async with scripted_server(generate, port):
            return await _capture(cfg, tok=None)

    s2 = asyncio.run(rerun())
    assert (s2.exported, s2.failed, s2.skipped_done) == (5, 0, 0)
    assert len(load_done(out)) == 5
