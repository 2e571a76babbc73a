"""Admission of /generate calls, on the normalised form the seam reads off SGLang's request
(the conformance test pins that form): which entries are exported, which are refused and
with what status, and holding the response until the outcome arrives."""

import asyncio
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_hs.overlay.admission import Admission, Policy, admit, hold_until_durable, sampled, take_spec_capture
from sglang_hs.protocol import (
    REQUEST_KEY,
    DuplicateSampleError,
    ExportError,
    Outcome,
    RequestOptionsError,
    SampleIdError,
    SampleInFlightError,
)

OPT_OUT = {"custom_params": {REQUEST_KEY: {"export": False}}}


def call_ids(params):
    return [(sp.get("custom_params") or {}).get(REQUEST_KEY, {}).get("call_id") for sp in params]


def test_a_single_request_is_tagged_with_the_call_id():
    params = [{"max_new_tokens": 1}]
    adm = admit(["a"], params, 1, False, set(), "c1")
    assert adm.rids == ["a"] and adm.unclaimed == {"a"} and call_ids(params) == ["c1"]


def test_a_batch_with_one_shared_params_dict_opts_out_every_entry():
    shared = dict(OPT_OUT)
    params = [shared] * 3  # SGLang repeats one shared dict per entry
    adm = admit(["a", "b", "c"], params, 1, False, set(), "c1")
    assert adm.rids == [] and call_ids(params) == [None] * 3


def test_a_batch_exports_all_but_the_entries_that_opt_out():
    params = [{}, dict(OPT_OUT), {"custom_params": {"other": 1}}]
    adm = admit(["a", "b", "c"], params, 1, False, set(), "c1")
    assert adm.rids == ["a", "c"] and call_ids(params) == ["c1", None, "c1"]
    assert params[2]["custom_params"]["other"] == 1, "the client's own custom params are kept"


def test_each_exported_entry_of_a_batch_that_shared_one_params_dict_gets_its_own_tagged_copy():
    shared = {"max_new_tokens": 3}
    params = [shared] * 3
    adm = admit(["a", "b", "c"], params, 1, False, set(), "c1", policy=Policy(sample_rate=0.0))
    assert adm.rids == [] and shared == {"max_new_tokens": 3}
    params = [shared, shared, shared]
    params[1] = {**shared, **OPT_OUT}
    adm = admit(["a", "b", "c"], params, 1, False, set(), "c1")
    assert adm.rids == ["a", "c"] and call_ids(params) == ["c1", None, "c1"]
    assert shared == {"max_new_tokens": 3} and params[0] is not params[2]


def test_health_checks_are_never_exported():
    adm = admit(["HEALTH_CHECK_1"], [{}], 1, False, set(), "c1", skip_prefix="HEALTH_CHECK")
    assert adm.rids == []


@pytest.mark.parametrize("rid", ["../x", "_a", ".hidden", "-a", "a" * 201, "a.tmp", "a b"])
def test_a_rid_that_cannot_name_a_file_is_refused(rid):
    with pytest.raises(SampleIdError) as e:
        admit([rid], [{}], 1, False, set(), "c1")
    assert e.value.status_code == 400


def test_an_exported_rid_is_refused_and_nothing_is_tagged():
    params = [{}, {}]
    with pytest.raises(DuplicateSampleError) as e:
        admit(["new", "old"], params, 1, False, {"old"}, "c1")
    assert e.value.status_code == 409 and call_ids(params) == [None, None]


def test_an_opted_out_entry_may_reuse_an_exported_rid():
    assert admit(["old"], [dict(OPT_OUT)], 1, False, {"old"}, "c1").rids == []


def test_n_above_one_is_refused_with_export_on_and_allowed_opted_out():
    # SGLang's normalised form for n=2: one rid, the params list repeated twice.
    with pytest.raises(RequestOptionsError, match="send n=1"):
        admit(["a"], [{"n": 2}, {"n": 2}], 2, False, set(), "c1")
    assert admit(["a"], [dict(OPT_OUT, n=2)] * 2, 2, False, set(), "c1").rids == []


def test_input_embeds_are_refused_with_export_on():
    with pytest.raises(RequestOptionsError, match="input_embeds"):
        admit(["a"], [{}], 1, True, set(), "c1")
    assert admit(["a"], [dict(OPT_OUT)], 1, True, set(), "c1").rids == []


def test_bad_options_are_refused():
    with pytest.raises(RequestOptionsError):
        admit(["a"], [{"custom_params": {REQUEST_KEY: {"export": "false"}}}], 1, False, set(), "c1")


class Waiter:
    """Outcomes by (rid, call id), as ExportWaiter.wait returns them."""

    def __init__(self, outcomes):
        self.outcomes = {(o.rid, o.call_id): o for o in outcomes}
        self.waited = []
        self.delay_s = {}  # rid: seconds until its sample is durable

    async def wait(self, rid, call_id):
        self.waited.append(rid)
        await asyncio.sleep(self.delay_s.get(rid, 0.0))
        return self.outcomes[(rid, call_id)]


def finished(rid, fin={"type": "length"}):
    return {"text": "", "meta_info": {"id": rid, "finish_reason": fin}}


def hold(out, adm, waiter):
    asyncio.new_event_loop().run_until_complete(hold_until_durable(out, adm, waiter, "/d"))
    return out


def test_a_finished_exported_request_gets_its_export_info():
    adm = Admission("c1", ["a", "b"])
    w = Waiter([Outcome("a", "c1", ok=True, path="p/a", num_tokens=3, bytes=9)])
    out = hold([finished("a"), finished("z")], adm, w)  # z: opted out, not waited for
    info = out[0]["meta_info"]["hidden_states_export"]
    assert {k: info[k] for k in ("dir", "path", "num_tokens", "bytes")} == {"dir": "/d", "path": "p/a", "num_tokens": 3,
                                                                         "bytes": 9}
    assert "hidden_states_export" not in out[1]["meta_info"] and w.waited == ["a"]
    assert adm.unclaimed == {"b"}


def test_held_ms_is_how_long_each_answer_waited_for_its_sample():
    """A batch's answers wait in turn: each says how long it was held from the moment SGLang
    handed the output over (what export added to that request's latency)."""
    adm = Admission("c1", ["a", "b"])
    w = Waiter([Outcome("a", "c1", ok=True, path="p/a", num_tokens=3, bytes=9),
                Outcome("b", "c1", ok=True, path="p/b", num_tokens=3, bytes=9)])
    w.delay_s = {"a": 0.2, "b": 0.1}
    t0 = time.perf_counter()
    out = hold([finished("a"), finished("b")], adm, w)
    wall_ms = 1000 * (time.perf_counter() - t0)
    a, b = (o["meta_info"]["hidden_states_export"]["held_ms"] for o in out)
    assert 195 <= a < b <= wall_ms and b >= 295  # asyncio.sleep may wake a clock tick early


def test_unfinished_and_aborted_requests_wait_for_nothing():
    adm = Admission("c1", ["a", "b"])
    w = Waiter([])
    hold([finished("a", None), finished("b", {"type": "abort", "message": "x"})], adm, w)
    assert w.waited == [] and adm.unclaimed == {"a", "b"}  # the abort's outcome is dropped on release


def test_a_failed_sample_answers_with_its_status():
    adm = Admission("c1", ["a"])
    w = Waiter([Outcome("a", "c1", error="No space left on device", status=507)])
    with pytest.raises(ExportError) as e:
        hold(finished("a"), adm, w)
    assert e.value.status_code == 507 and adm.unclaimed == set()


def test_a_loss_rows_server_refuses_an_exported_entry_without_a_loss_mask():
    masked = {"custom_params": {REQUEST_KEY: {"loss_mask": [0, 1]}}}
    adm = admit(["a", "b"], [dict(masked), dict(OPT_OUT)], 1, False, set(), "c1", need_loss_mask=True)
    assert adm.rids == ["a"]  # an opted-out entry needs no mask
    with pytest.raises(RequestOptionsError, match="--export-final-rows loss") as e:
        admit(["a", "b"], [dict(masked), {}], 1, False, set(), "c2", need_loss_mask=True)
    assert e.value.status_code == 400


@given(st.lists(st.integers(-5, 60), min_size=1, max_size=20), st.booleans())
def test_token_ids_outside_the_vocabulary_are_refused_with_400(ids, batch):
    from sglang_hs.overlay.admission import check_input_ids

    vocab = 50
    bad = [t for t in ids if not 0 <= t < vocab]
    try:
        check_input_ids([ids, [1]] if batch else ids, vocab)
    except RequestOptionsError as e:
        assert bad and e.status_code == 400 and str(bad[0]) in str(e)
    else:
        assert not bad


def test_shapes_that_are_not_token_ids_are_left_to_sglang():
    from sglang_hs.overlay.admission import check_input_ids

    for x in (None, "text", [], [["a"]], ["x", 1], 7):
        check_input_ids(x, 50)


SPEC = {"store_id": "run", "sample_id": "run:t0", "gen": 1, "replace": False,
        "features": {"aux": "hidden_state", "last_hidden": "target"},
        "passthrough": [{"name": "input_ids", "data": [5, 6], "shape": [1, 2], "dtype": "int64"}]}


class Body:
    """What take_spec_capture reads of a GenerateReqInput before SGLang normalises it."""

    def __init__(self, input_ids, sampling_params):
        self.input_ids, self.sampling_params = input_ids, sampling_params


def test_spec_capture_moves_into_each_entry_of_a_batch_that_shared_one_params_dict():
    shared = {"max_new_tokens": 0}
    obj = Body([[5, 6], [7, 8]], shared)
    take_spec_capture(obj, {"spec_capture": [SPEC, {**SPEC, "sample_id": "run:t1"}]})
    assert [sp["custom_params"][REQUEST_KEY]["specforge"]["sample_id"] for sp in obj.sampling_params] == \
        ["run:t0", "run:t1"]
    assert shared == {"max_new_tokens": 0}  # the caller's dict is not written into
    adm = admit(["a", "b"], obj.sampling_params, 1, False, set(), "c1", sink="specforge")
    assert adm.rids == ["a", "b"]


def test_spec_capture_is_checked_and_counted():
    with pytest.raises(RequestOptionsError, match="2 prompts"):
        take_spec_capture(Body([[5, 6], [7, 8]], {}), {"spec_capture": [SPEC]})
    with pytest.raises(RequestOptionsError, match="gen"):
        take_spec_capture(Body([5, 6], {}), {"spec_capture": {**SPEC, "gen": "1"}})
    obj = Body([5, 6], None)
    take_spec_capture(obj, {"input_ids": [5, 6]})  # no spec_capture: untouched
    assert obj.sampling_params is None


def test_only_a_specforge_server_takes_spec_capture_and_it_exports_nothing_else():
    asked = [{"custom_params": {REQUEST_KEY: {"specforge": SPEC}}}]
    with pytest.raises(RequestOptionsError, match="--export-sink specforge"):
        admit(["a"], asked, 1, False, set(), "c1", sink="directory")
    assert admit(["a"], [{}], 1, False, set(), "c1", sink="specforge").rids == []


def test_decode_rows_are_taken_by_the_directory_sink_only():
    asked = lambda: [{"custom_params": {REQUEST_KEY: {"decode_rows": True}}}]  # noqa: E731
    assert admit(["a"], asked(), 1, False, set(), "c1").rids == ["a"]
    for sink in ("speculators-file", "speculators-mooncake"):
        with pytest.raises(RequestOptionsError, match="decode_rows, which only the directory sink"):
            admit(["a"], asked(), 1, False, set(), "c1", sink=sink)


def export_tags(params):
    return [(sp.get("custom_params") or {}).get(REQUEST_KEY, {}) for sp in params]


@given(st.lists(st.from_regex(r"[a-f0-9][a-f0-9_]{0,11}", fullmatch=True), min_size=1, max_size=30, unique=True),
       st.floats(0.0, 1.0), st.sampled_from([None, True, False]))
def test_a_request_that_does_not_say_is_exported_exactly_when_its_rid_is_sampled(rids, rate, said):
    params = [{} if said is None else {"custom_params": {REQUEST_KEY: {"export": said}}} for _ in rids]
    adm = admit(rids, params, 1, False, set(), "c1", policy=Policy(sample_rate=rate))
    want = [r for r in rids if said is True or (said is None and sampled(r, rate))]
    assert adm.rids == want
    for rid, tag in zip(rids, export_tags(params)):
        # the schedulers export what is not tagged export=false: every entry left out says so
        assert (tag.get("export") is not False) == (rid in want) and (tag.get("call_id") == "c1") == (rid in want)


def test_sampling_follows_the_rid_alone_and_keeps_about_the_rate():
    rids = [f"req-{i}" for i in range(20000)]
    picked = [r for r in rids if sampled(r, 0.1)]
    assert picked == [r for r in rids if sampled(r, 0.1)]  # a replay samples the same requests
    assert 0.09 < len(picked) / len(rids) < 0.11
    assert set(picked) <= {r for r in rids if sampled(r, 0.5)}  # a higher rate keeps what a lower one took
    assert not any(sampled(r, 0.0) for r in rids) and all(sampled(r, 1.0) for r in rids)


def test_a_live_server_serves_unexported_what_it_chose_but_cannot_export():
    live = Policy(live=True)
    params = [{}, {}, {}, {}]
    adm = admit(["ok", "old", "busy", "../x"], params, 1, False, {"old"}, "c1", in_flight={"busy"}, policy=live)
    assert adm.rids == ["ok"]
    assert export_tags(params) == [{"call_id": "c1", "decode_rows": True}] + [{"export": False}] * 3
    params = [{}]
    assert admit(["e"], params, 1, True, set(), "c1", policy=live).rids == [] and export_tags(params) == [{"export": False}]
    params = [{}, {}]  # n=2: one prompt sampled twice is never exported, and not refused either
    assert admit(["n"], params, 2, False, set(), "c1", policy=live).rids == []
    assert export_tags(params) == [{"export": False}] * 2


def test_a_live_server_still_refuses_an_explicit_opt_in_it_cannot_export():
    asked = lambda: [{"custom_params": {REQUEST_KEY: {"export": True}}}]  # noqa: E731
    with pytest.raises(DuplicateSampleError):
        admit(["old"], asked(), 1, False, {"old"}, "c1", policy=Policy(live=True))
    with pytest.raises(RequestOptionsError, match="send n=1"):
        admit(["n"], asked() * 2, 2, False, set(), "c1", policy=Policy(sample_rate=0.1, live=True))


def test_a_rid_in_flight_or_twice_in_one_call_is_refused_with_a_retryable_status():
    with pytest.raises(SampleInFlightError) as e:
        admit(["a", "b"], [{}, {}], 1, False, set(), "c1", in_flight={"b"})
    assert e.value.status_code == 423 and "'b'" in str(e.value)
    with pytest.raises(SampleInFlightError):
        admit(["a", "a"], [{}, {}], 1, False, set(), "c1")
