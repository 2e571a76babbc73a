import pytest

from sglang_hs.protocol import (
    DuplicateSampleError,
    ExportError,
    Outcome,
    RequestOptionsError,
    SampleIdError,
    SampleInFlightError,
    parse_request_options,
)


def test_request_options():
    assert parse_request_options(None).export is None  # not said: the server's sample rate decides
    o = parse_request_options({"sglang_hs": {"loss_mask": [0, 1], "metadata": {"src": "x"}}})
    assert o.loss_mask == [0, 1] and o.metadata == {"src": "x"}
    assert not parse_request_options({"sglang_hs": {"export": False}}).export
    assert parse_request_options({"sglang_hs": {"decode_rows": True}}).decode_rows
    assert not parse_request_options(None).decode_rows
    for bad in ({"loss_mask": [0, 2]}, {"loss_mask": "11"}, {"metadata": [1]}, {"nope": 1},
                {"metadata": {"x": "y" * 20000}}, {"export": "false"}, {"export": 0}, {"export": None},
                {"decode_rows": "true"}, {"decode_rows": 1}):
        with pytest.raises(RequestOptionsError):
            parse_request_options({"sglang_hs": bad})


def test_outcome_round_trips_and_answers_the_response():
    ok = Outcome("a", "c1", ok=True, path="dp0-00000/a.safetensors", num_tokens=3, bytes=100)
    assert Outcome.from_bytes(ok.to_bytes()) == ok
    assert ok.meta_info("/d") == {"dir": "/d", "path": "dp0-00000/a.safetensors", "num_tokens": 3, "bytes": 100}
    assert Outcome("a", "c1", aborted=True).meta_info("/d") is None
    with pytest.raises(ExportError) as e:
        Outcome("a", "c1", error="disk full", status=507).meta_info("/d")
    assert e.value.status_code == 507 and "disk full" in str(e.value)


@pytest.mark.parametrize("raw", [b"not json", b"[]", b'{"ok": true}', b'{"rid": "a", "call_id": null, "x": 1}'])
def test_a_message_that_is_not_an_outcome_is_refused(raw):
    with pytest.raises((ValueError, TypeError)):
        Outcome.from_bytes(raw)


def test_every_export_error_is_a_value_error_with_its_http_status():
    # SGLang's HTTP layer answers a ValueError from generate_request with its status_code.
    statuses = {RequestOptionsError: 400, SampleIdError: 400, DuplicateSampleError: 409, SampleInFlightError: 423}
    for cls, status in statuses.items():
        assert issubclass(cls, ValueError) and cls("x").status_code == status
    assert ExportError("x").status_code == 500 and ExportError("x", 507).status_code == 507
