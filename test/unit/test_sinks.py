"""The sinks other than the directory, read back by the trainers' own readers (hs-connectors
0.9.0), and what they do when their store goes away."""

import os
import signal

import pytest
import torch

from harness.mooncake import MooncakeMaster
from sglang_hs.layouts import speculators_planes
from sglang_hs.overlay.config import MooncakeSettings
from sglang_hs.overlay.sinks import HandoffSink, SpeculatorsMooncakeSink, sample_rows
from sglang_hs.overlay.staging import SlabPool
from sglang_hs.overlay.writer import SampleWriter
from sglang_hs.protocol import DuplicateSampleError, ExportError

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
