"""The capture client against scripted HTTP servers (aiohttp on localhost): what the client
does with each kind of answer, with a server that goes away, and with a dataset read as it
is sent. The live-server version is test/server/test_capture_cpu.py."""

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, strategies as st

from sglang_hs.format import SampleIdError
from sglang_hs.tools.capture import (FAILED, JOURNAL, CaptureConfig, ServersChangedError, ServerUnreachable, Stop,
                                     Waits, _capture, capture, check_servers, load_done, reach_servers, server_for)


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


def test_a_transient_answer_is_resent_after_a_backoff_not_at_once(tmp_path):
    """A server answering 503 gets each resend after a growing pause (0.5 s, then 1 s, ... each
    up to twice that), not a burst that spends the retries in milliseconds."""
    data = tmp_path / "data.jsonl"
    write_records(data, 1)
    times = []

    async def generate(request):
        times.append(time.monotonic())
        return web.json_response({"error": {"message": "busy"}}, status=503)

    async def main():
        async with scripted_server(generate) as url:
            cfg = CaptureConfig(servers=[url], data=str(data), out=str(tmp_path / "out"), progress=False, retries=2)
            return await _capture(cfg, tok=None)

    s = asyncio.run(main())
    assert s.failed == 1 and len(times) == 3
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert 0.5 <= gaps[0] < 1.5 and 1.0 <= gaps[1] < 3.0, gaps


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
    assert s.exit_code() == 75, "a server that stayed away is EX_TEMPFAIL, not a stop signal's 130"
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


# The CLI as a user runs it, in its own process, stopped with real signals.


def cli(server, data, out, *extra):
    return [sys.executable, "-m", "sglang_hs.tools.cli", "capture", "--server", server, "--data", str(data),
            "--out", str(out), *extra]


def wait_for_text(path, text, timeout):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if text in path.read_text():
            return True
        time.sleep(0.1)
    return False


def journal_is_intact(out):
    p = out / JOURNAL
    lines = p.read_text().splitlines() if p.exists() else []
    return all(json.loads(line)["id"] for line in lines)


def test_a_server_that_cannot_be_reached_at_start_fails_within_seconds_naming_it(tmp_path, smollm2_path):
    """A mistyped port used to be treated as a server that went away: up to ten silent minutes."""
    data = tmp_path / "data.jsonl"
    write_records(data, 3)
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    r = subprocess.run(cli(url, data, tmp_path / "out", "--tokenizer", smollm2_path), capture_output=True,
                       text=True, timeout=90)
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"cannot reach {url} (Connection refused)" in r.stderr and "--server-wait" in r.stderr, r.stderr
    assert took < 15, took


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_ends_the_wait_for_a_server_within_seconds(tmp_path, smollm2_path, sig):
    """Waiting (--server-wait 600) for a server not there yet: Ctrl-C or SIGTERM used to act
    only once the wait ran out, and nothing said what the client was waiting for."""
    data = tmp_path / "data.jsonl"
    write_records(data, 3)
    url = f"http://127.0.0.1:{free_port()}"
    log = tmp_path / "client.log"
    with open(log, "w") as f:
        p = subprocess.Popen(cli(url, data, tmp_path / "out", "--tokenizer", smollm2_path, "--server-wait", "600"),
                             stdout=f, stderr=subprocess.STDOUT)
    try:
        assert wait_for_text(log, f"{url} is not answering (Connection refused): waiting up to 600 s", 60), \
            log.read_text()
        assert wait_for_text(log, f"waiting for {url} (Connection refused) for ", 10), log.read_text()
        t0 = time.monotonic()
        p.send_signal(sig)
        rc = p.wait(30)
        took = time.monotonic() - t0
    finally:
        p.kill()
    text = log.read_text()
    assert rc == 128 + sig and took < 5, (rc, took, text)
    assert f"stopped by {signal.Signals(sig).name}" in text and "rerun to resume" in text, text
    assert journal_is_intact(tmp_path / "out")


@contextlib.contextmanager
def server_in_thread(generate):
    """A scripted server on its own event loop, for a client running in another process."""
    loop, box = asyncio.new_event_loop(), {}
    ready = threading.Event()

    def run():
        asyncio.set_event_loop(loop)
        box["cm"] = scripted_server(generate)
        box["url"] = loop.run_until_complete(box["cm"].__aenter__())
        ready.set()
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(10)
    try:
        yield box["url"], loop
    finally:
        asyncio.run_coroutine_threadsafe(box["cm"].__aexit__(None, None, None), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)


def test_a_second_ctrl_c_exits_at_once_while_answers_are_awaited(tmp_path, smollm2_path):
    """The first Ctrl-C waits for requests a live server is still answering (they become
    durable there and are journaled); the second used to be ignored the same way."""
    data = tmp_path / "data.jsonl"
    write_records(data, 6)
    release = asyncio.Event()
    answered = []

    async def generate(request):
        body = await request.json()
        if body["input_ids"][2] == 0:  # one answers at once, the rest are slow
            answered.append(body["rid"])
            return exported(body)
        await release.wait()
        return exported(body)

    log = tmp_path / "client.log"
    with server_in_thread(generate) as (url, loop):
        with open(log, "w") as f:
            p = subprocess.Popen(cli(url, data, tmp_path / "out", "--tokenizer", smollm2_path, "--no-progress",
                                     "--concurrency", "6"), stdout=f, stderr=subprocess.STDOUT)
        try:
            t0 = time.monotonic()
            while len(load_done(str(tmp_path / "out"))) < 1 and time.monotonic() - t0 < 60:
                time.sleep(0.1)
            p.send_signal(signal.SIGINT)
            assert wait_for_text(log, "SIGINT: stopping", 10), log.read_text()
            time.sleep(2)
            assert p.poll() is None, "the first Ctrl-C must let answers in progress finish"
            t0 = time.monotonic()
            p.send_signal(signal.SIGINT)
            rc = p.wait(30)
            took = time.monotonic() - t0
        finally:
            p.kill()
            loop.call_soon_threadsafe(release.set)
    assert rc == 130 and took < 5, (rc, took, log.read_text())
    assert journal_is_intact(tmp_path / "out")
    assert list(load_done(str(tmp_path / "out"))) == answered


def test_a_server_still_starting_is_waited_for_and_one_never_reached_is_not(tmp_path):
    """/health answering 503 (starting) is waited for without --server-wait; a refused
    connection fails at once unless the user asked to wait."""
    starting = {"now": True}

    async def health(request):
        return web.Response(status=503 if starting["now"] else 200)

    async def main():
        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        nobody = f"http://127.0.0.1:{free_port()}"
        cfg = CaptureConfig(servers=[url], data="-", out=str(tmp_path), server_wait_s=30)
        notes = []
        async with aiohttp.ClientSession() as session:
            waits = Waits(session, cfg.server_wait_s, Stop(), notes.append)
            asyncio.get_running_loop().call_later(3, starting.update, {"now": False})
            t0 = time.monotonic()
            await reach_servers([url], cfg, waits)
            waited = time.monotonic() - t0
            with pytest.raises(ServerUnreachable, match=f"cannot reach {nobody}"):
                await reach_servers([url, nobody], cfg, waits)
        await runner.cleanup()
        return waited, notes

    waited, notes = asyncio.run(main())
    assert 3 <= waited < 10
    assert "/health answered HTTP 503" in notes[0] and "is back after" in notes[1], notes


def test_a_busy_server_whose_health_answers_slowly_is_not_a_wrong_url(tmp_path):
    """SGLang's /health is a one-token generation queued behind the server's work: on CI, after
    a killed capture's requests, it took over 5 s and the rerun said "cannot reach ... (timed
    out)" of a server that was serving."""
    async def health(request):
        await asyncio.sleep(8)
        return web.Response(status=200)

    async def main():
        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        cfg = CaptureConfig(servers=[url], data="-", out=str(tmp_path), server_wait_s=60)
        async with aiohttp.ClientSession() as session:
            t0 = time.monotonic()
            await reach_servers([url], cfg, Waits(session, cfg.server_wait_s, Stop(), print))
            took = time.monotonic() - t0
        await runner.cleanup()
        return took

    assert 8 <= asyncio.run(main()) < 20


def test_a_router_is_up_when_it_lists_every_worker_healthy():
    """What sglang-router 0.3.2's GET /workers answers (the shape test_router_cpu reads live)."""
    from sglang_hs.tools.capture import router_unhealthy

    def worker(url, healthy):
        return {"id": url, "url": url, "is_healthy": healthy, "worker_type": "regular"}

    assert router_unhealthy(200, {"workers": [worker("http://a", True), worker("http://b", True)], "total": 2}) is None
    why = router_unhealthy(200, {"workers": [worker("http://a", True), worker("http://b", False)]})
    assert why.startswith("/health answered") and "1 of 2 workers unhealthy: http://b" in why
    assert "no worker yet" in router_unhealthy(200, {"workers": [], "total": 0})  # just started
    assert "is this an sglang-router" in router_unhealthy(404, {"detail": "Not Found"})  # a plain server


def test_through_a_router_every_worker_is_asked_directly_since_the_router_never_marks_one_down():
    """A router set up for capture (no health checks) lists a dead worker as healthy: capture
    is up only once each listed worker answers its own /health."""
    state = {"worker": 503}

    async def main():
        async def workers(request):
            return web.json_response({"workers": [{"url": worker_url, "is_healthy": True},
                                                  {"url": dead, "is_healthy": True}], "total": 2})

        async def worker_health(request):
            return web.Response(status=state["worker"])

        runners = []
        for routes in ([("/health", healthy), ("/workers", workers)], [("/health", worker_health)]):
            app = web.Application()
            for path, handler in routes:
                app.router.add_get(path, handler)
            runners.append(web.AppRunner(app))
            await runners[-1].setup()
            await web.TCPSite(runners[-1], "127.0.0.1", 0).start()
        router_url, worker_url = (f"http://127.0.0.1:{r.addresses[0][1]}" for r in runners)
        dead = f"http://127.0.0.1:{free_port()}"
        async with aiohttp.ClientSession() as session:
            waits = Waits(session, 30, Stop(), print, router=True)
            both = await waits.health(router_url)
            state["worker"] = 200
            one = await waits.health(router_url)
            dead = worker_url  # the dead worker restarted (the router lists it by the same URL)
            none = await waits.health(router_url)
        for r in runners:
            await r.cleanup()
        return both, one, none, worker_url

    both, one, none, worker_url = asyncio.run(main())
    assert "does not answer /health" in both and f"{worker_url} (HTTP 503)" in both and "Connection refused" in both
    assert worker_url not in one and "Connection refused" in one
    assert none is None


def test_via_router_takes_the_router_alone(tmp_path):
    with pytest.raises(ValueError, match="router's URL alone"):
        capture(CaptureConfig(["http://a", "http://b"], "d.jsonl", str(tmp_path), via_router=True))
