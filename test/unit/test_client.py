import json

from sglang_hs.client import _Router, load_done


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
