import json

import pytest

from sglang_hs.tools.capture import _Router, load_done


def test_router_sends_to_the_least_loaded_server():
    r = _Router(["http://a/", "http://b"])
    first, second = r.acquire(), r.acquire()
    assert {first, second} == {"http://a", "http://b"}
    r.release(first)
    assert r.acquire() == first  # the one with nothing outstanding
    assert r.load == {"http://a": 1, "http://b": 1}


def test_journal_survives_a_torn_last_line(tmp_path):
    (tmp_path / "capture.jsonl").write_text(json.dumps({"id": "a", "path": "p"}) + "\n" + '{"id": "b", "pa')
    assert set(load_done(str(tmp_path))) == {"a"}  # b is simply sent again (409 if it was durable)


def test_capture_retries_in_flight_ids_and_records_odd_answers_without_stopping(tmp_path):
    """Against a scripted HTTP server: 423 (the id is still in flight on the server) is retried,
    409 counts as exported, and a 200 without export info or a 400 fails that sample only."""
    import asyncio

    from aiohttp import web

    from sglang_hs.tools.capture import FAILED, JOURNAL, CaptureConfig, _capture

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [1, 2, 3 + i]}) + "\n" for i in range(4)))
    seen = {}

    async def generate(request):
        body = await request.json()
        n = seen[body["input_ids"][2]] = seen.get(body["input_ids"][2], 0) + 1
        kind = body["input_ids"][2] - 3
        info = {"dir": "d", "path": f"p/{body['rid']}", "num_tokens": 3, "bytes": 10}
        if kind == 0 and n == 1:
            return web.json_response({"error": {"message": "in flight"}}, status=423)
        if kind == 0:
            return web.json_response({"meta_info": {"hidden_states_export": info}})
        if kind == 1:
            return web.json_response({"error": {"message": "already exported"}}, status=409)
        if kind == 2:
            return web.json_response({"meta_info": {"id": body["rid"]}})
        return web.json_response({"error": {"message": "bad loss_mask"}}, status=400)

    async def main():
        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            cfg = CaptureConfig(servers=[f"http://127.0.0.1:{port}"], data=str(data), out=str(tmp_path / "out"),
                                progress=False, retries=3)
            return await _capture(cfg, tok=None)
        finally:
            await runner.cleanup()

    s = asyncio.run(main())
    assert (s.exported, s.already_exported, s.failed, s.total) == (1, 1, 2, 4)
    assert seen[3] == 2, "423 must be retried"
    assert len(load_done(str(tmp_path / "out"))) == 2
    failed = [json.loads(x) for x in (tmp_path / "out" / FAILED).read_text().splitlines()]
    assert any("hidden_states_export" in f["error"] for f in failed)
    assert any("HTTP 400" in f["error"] for f in failed)
    assert (tmp_path / "out" / JOURNAL).exists()


def test_an_id_prefix_the_server_would_refuse_stops_the_run_before_it_starts(tmp_path):
    from sglang_hs.tools.capture import CaptureConfig, capture
    from sglang_hs.format import SampleIdError

    cfg = CaptureConfig(servers=["http://127.0.0.1:9"], data=str(tmp_path / "none.jsonl"), out=str(tmp_path),
                        id_prefix="_run")
    with pytest.raises(SampleIdError, match="--id-prefix '_run'"):
        capture(cfg)


def test_a_malformed_jsonl_line_fails_that_record_only(tmp_path):
    """One line that is not JSON used to abort the whole run before anything was sent; it is
    now that record's failure, and the records around it are sent."""
    import asyncio

    from aiohttp import web

    from sglang_hs.tools.capture import FAILED, CaptureConfig, _capture

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n" + '{"input_ids": [1, 2\n'
                    + json.dumps({"input_ids": [4, 5, 6]}) + "\n")
    sent = []

    async def generate(request):
        body = await request.json()
        sent.append(body["input_ids"])
        return web.json_response({"meta_info": {"hidden_states_export": {
            "dir": "d", "path": f"p/{body['rid']}", "num_tokens": 3, "bytes": 10}}})

    async def main():
        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            cfg = CaptureConfig(servers=[f"http://127.0.0.1:{runner.addresses[0][1]}"], data=str(data),
                                out=str(tmp_path / "out"), progress=False)
            return await _capture(cfg, tok=None)
        finally:
            await runner.cleanup()

    s = asyncio.run(main())
    assert (s.total, s.exported, s.failed) == (3, 2, 1)
    assert sorted(sent) == [[1, 2, 3], [4, 5, 6]]
    failed = [json.loads(x) for x in (tmp_path / "out" / FAILED).read_text().splitlines()]
    assert len(failed) == 1 and "data.jsonl:2: not JSON" in failed[0]["error"]
