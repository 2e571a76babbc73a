"""The sinks other than the directory, read back by the trainers' own readers (hs-connectors
0.9.0), and their faults against a real `mooncake_master`: killed, restarted, out of space."""

import os
import signal
import time

import pytest
import torch

from harness.mooncake import MooncakeMaster
from sglang_hs.layouts import speculators_planes
from sglang_hs.overlay.config import MooncakeSettings
from sglang_hs.overlay.sinks import (HANDOFF_DIR, HANDOFF_ORPHAN_S, HandoffSink, SpecForgeSink, SpeculatorsMooncakeSink,
                                     sample_rows)
from sglang_hs.overlay.staging import SlabPool
from sglang_hs.overlay.writer import SampleWriter
from sglang_hs.protocol import DuplicateSampleError, ExportError, check_spec_capture

from test_writer import H, K, complete_state  # noqa: E402 (test/unit is on sys.path)

W = torch.rand(H) + 0.5  # a final-norm weight


@pytest.mark.parametrize("fp8", [False, True])
def test_handoff_files_are_what_hs_connectors_reads(tmp_path, trainers, fp8):
    from hs_connectors.transfer import FP8Transfer, FileTransfer

    sink = HandoffSink(str(tmp_path), [2, 5, 7], W, fp8=fp8)
    st = complete_state("r1", 9)
    placed = sink.put(st)
    path = placed.answer["hidden_states_path"]
    assert os.path.dirname(path) == os.path.join(str(tmp_path), "handoff")
    t = (FP8Transfer if fp8 else FileTransfer)(tmp_path).get_generated(placed.answer)
    aux, final = sample_rows(st)
    want = speculators_planes(aux, final, W)["hidden_states"]
    assert t["token_ids"].tolist() == list(range(9)) and t["hidden_states"].shape == (9, K + 1, H)
    if fp8:  # one scale per row and plane: within e4m3's relative step
        torch.testing.assert_close(t["hidden_states"].float(), want.float(), rtol=0.07, atol=1e-3)
    else:
        assert torch.equal(t["hidden_states"], want)
    with pytest.raises(DuplicateSampleError):  # the trainer has not deleted it yet
        sink.put(complete_state("r1", 9))
    (FP8Transfer if fp8 else FileTransfer)(tmp_path).delete(path)
    assert os.listdir(os.path.join(str(tmp_path), "handoff")) == []


def test_mooncake_sink_round_trip_then_master_gone_fails_that_sample_and_the_writer_goes_on(tmp_path, trainers):
    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig

    with MooncakeMaster(str(tmp_path / "master.log")) as m:
        cfg = MooncakeSettings(master=m.address, segment_bytes=32 << 20, local_buffer_bytes=32 << 20)
        msgs = []
        w = SampleWriter(SpeculatorsMooncakeSink(cfg, W), SlabPool(1 << 24, slab_bytes=1 << 16), msgs.append)
        reader = MooncakeHiddenStatesStore(MooncakeStoreConfig(
            local_hostname="127.0.0.1", master_server_address=m.address, global_segment_size=16 << 20,
            local_buffer_size=16 << 20)).setup()
        st = complete_state("r-1", 7)
        want = speculators_planes(*sample_rows(st), W)["hidden_states"]
        w.submit(st, lambda: False)
        w.flush()
        assert msgs[0].ok and msgs[0].sink == "speculators-mooncake"
        got = reader.get_sample(msgs[0].answer)
        assert torch.equal(got["hidden_states"], want) and got["token_ids"].tolist() == list(range(7))
        reader.delete_sample(msgs[0].answer["handle"])

        m.kill(signal.SIGKILL)
        w.submit(complete_state("r-2", 5), lambda: False)
        w.flush()
        assert not msgs[1].ok and msgs[1].status == 503 and "Mooncake" in msgs[1].error
        with pytest.raises(ExportError, match="Mooncake"):
            msgs[1].meta_info("unused")
        assert w.stats["failed"] == 1 and w.queued == 0
        w.close()


def test_handoff_files_no_trainer_will_read_are_removed_when_the_server_starts(tmp_path):
    """A trainer killed between an answer and its read leaves that file behind for good (it
    reads inside the call that got the answer); a restarted server removes such files, and
    only those old enough that no live trainer can still be reading them."""
    handoff = tmp_path / HANDOFF_DIR
    handoff.mkdir()
    old = time.time() - HANDOFF_ORPHAN_S - 60
    for name in ("r-dead.safetensors", ".r-crash.safetensors.1a2b3c4d.tmp"):
        (handoff / name).write_bytes(b"x")
        os.utime(handoff / name, (old, old))
    (handoff / "r-live.safetensors").write_bytes(b"x")  # answered a moment ago: its trainer reads it now
    sink = HandoffSink(str(tmp_path), [2, 5, 7], W, fp8=False)
    assert sink.orphans_removed == 2 and os.listdir(handoff) == ["r-live.safetensors"]


def spec_state(rid, n, sample_id):
    st = complete_state(rid, n)
    st.options.specforge = check_spec_capture({
        "store_id": "run", "sample_id": sample_id, "gen": 1, "features": {"aux": "hidden_state", "last_hidden": "target"},
        "passthrough": [{"name": "input_ids", "data": [list(range(n))], "shape": [1, n], "dtype": "int64"}]})
    return st


def mooncake_sink(kind, m, segment_bytes=32 << 20):
    cfg = MooncakeSettings(master=m.address, segment_bytes=segment_bytes, local_buffer_bytes=32 << 20)
    if kind == "speculators-mooncake":
        sink = SpeculatorsMooncakeSink(cfg, W)
        return sink, sink.store._require_store(), lambda i: spec_state(f"r-{i}", 16384, f"run:t{i}")
    sink = SpecForgeSink(cfg, [1, 3, 4])
    return sink, sink.store, lambda i: spec_state(f"r-{i}", 16384, f"run:t{i}")


def keys_of(placed):
    if "handle" in placed.answer:
        return [placed.answer["handle"]]
    a = placed.answer
    return [f"{a['store_id']}/{a['sample_id']}/g{a['gen']}/{name}" for name in a["features"]]


@pytest.mark.parametrize("kind", ["speculators-mooncake", "specforge"])
def test_a_restarted_master_loses_what_it_held_and_the_sink_puts_again(tmp_path, trainers, kind):
    """Master killed mid-run: each put fails with a 503 that names the master; once it is back
    on the same address the same sink (no server restart) puts again. What the old master
    held is gone with its metadata, which the error says."""
    with MooncakeMaster(str(tmp_path / "master.log")) as m:
        sink, store, state = mooncake_sink(kind, m)
        before = sink.put(state(0))
        assert all(store.is_exist(k) == 1 for k in keys_of(before))
        m.kill(signal.SIGKILL)
        with pytest.raises(ExportError, match=f"master does not answer: is mooncake_master running at {m.address}") as e:
            sink.put(state(1))
        assert e.value.status_code == 503
        m.start()
        deadline, after = time.monotonic() + 30, None
        while after is None and time.monotonic() < deadline:
            try:
                after = sink.put(state(2))
            except ExportError:  # the client finds the new master within a second or two
                time.sleep(0.5)
        assert after is not None, "no put succeeded within 30 s of the master's restart"
        assert all(store.is_exist(k) == 1 for k in keys_of(after))
        assert all(store.is_exist(k) == 0 for k in keys_of(before))


def test_a_full_segment_fails_a_specforge_sample_whole_until_the_trainer_releases_one(tmp_path, trainers):
    """Nobody reads: puts fill the server's 16 MiB segment, then the next sample fails with
    a 503 that says the segment is full, and none of the objects it had put stay behind (a
    SpecForge sample is several objects). They are hard-pinned, so the segment stays full
    until SpecForge's consumer releases a sample; then the next put fits."""
    with MooncakeMaster(str(tmp_path / "master.log")) as m:
        sink, store, state = mooncake_sink("specforge", m, segment_bytes=16 << 20)
        placed = []
        with pytest.raises(ExportError, match="no space left in the Mooncake segments") as e:
            for i in range(40):  # ~1.1 MiB each
                placed.append(sink.put(state(i)))
        assert e.value.status_code == 503 and len(placed) >= 8
        failed = f"run:t{len(placed)}"
        assert all(store.is_exist(f"run/{failed}/g1/{n}") == 0 for n in ("hidden_state", "target", "input_ids"))
        time.sleep(2)
        with pytest.raises(ExportError, match="no space left"):  # nothing was evicted meanwhile
            sink.put(state(98))
        assert all(store.is_exist(k) == 1 for p in placed for k in keys_of(p))
        for k in keys_of(placed[0]):  # what SpecForge's store does on release
            assert store.remove(k, force=True) == 0
        assert all(store.is_exist(k) == 1 for k in keys_of(sink.put(state(99))))


def test_a_full_segment_evicts_unread_speculators_samples(tmp_path, trainers):
    """hs-connectors' producer puts unpinned objects (as its vLLM connector does). A full
    segment fails the next sample with a 503 that says so; then Mooncake's eviction (above its
    high watermark) makes room by removing samples that no trainer has read. That frees
    what a killed trainer left behind, and is the limit for a live one: the segment must hold
    every sample answered but not read yet, or the trainer finds one gone (hs-connectors'
    reader raises after polling for it)."""
    # Eviction starts at the high watermark (90% by default) and runs beside the puts: on a busy
    # machine (two test workers) it kept pace with 40 puts and the segment never filled. At 100%
    # it starts only once a put finds the segment full, so the test sees both, at any speed.
    with MooncakeMaster(str(tmp_path / "master.log"), flags=["--eviction_high_watermark_ratio=1.0"]) as m:
        sink, store, state = mooncake_sink("speculators-mooncake", m, segment_bytes=16 << 20)
        placed = []
        with pytest.raises(ExportError, match="no space left in the Mooncake segments") as e:
            for i in range(40):
                placed.append(sink.put(state(i)))
        assert e.value.status_code == 503
        deadline, later = time.monotonic() + 60, None
        while later is None and time.monotonic() < deadline:
            try:
                later = sink.put(state(99))
            except ExportError:
                time.sleep(0.5)
        assert later is not None, "Mooncake evicted nothing within 60 s"
        gone = [p for p in placed if store.is_exist(keys_of(p)[0]) == 0]
        assert gone and store.is_exist(keys_of(later)[0]) == 1
