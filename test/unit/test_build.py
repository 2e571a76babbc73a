"""A scheduler's export machinery from its config: one writer rank per data-parallel group,
the sink its spec names, export.json from what it serves."""

import pytest

from sglang_hs.format import read_export_json
from sglang_hs.overlay import sinks
from sglang_hs.overlay.build import Served, is_writer_rank, make_writer
from sglang_hs.overlay.config import ExportConfig

SERVED = Served(model_path="m", architecture="LlamaForCausalLM", hidden_size=16, num_layers=10, dtype="bfloat16",
                device="cpu", attention_backend="torch_native", tp_size=1, dp_size=1, sglang_version="0.5.x")


@pytest.mark.parametrize("tp,dp,dp_attention,writers", [
    (1, 1, False, [0]),
    (2, 1, False, [0]),           # plain TP: one writer for the group
    (8, 1, False, [0]),
    (4, 2, True, [0, 2]),         # DP attention: attn_tp_size 2, one writer per DP group
    (8, 8, True, list(range(8))),
])
def test_one_writer_rank_per_data_parallel_group(tp, dp, dp_attention, writers):
    attn_tp = tp // dp if dp_attention else tp
    got = [r for r in range(tp) if is_writer_rank(r % attn_tp, 0, True)]
    assert got == writers
    assert not is_writer_rank(0, 0, False)  # not the last pipeline stage
    assert not is_writer_rank(0, 1, True)   # context-parallel peers hold the same rows


def test_the_writer_records_what_it_serves_and_refuses_a_directory_of_another_model(tmp_path):
    cfg = ExportConfig(str(tmp_path), host_buffer_bytes=1 << 20, notify_addr=f"ipc://{tmp_path}/n")
    w = make_writer(cfg, SERVED, (2, 5, 7), "dp0")
    try:
        assert isinstance(w.sink, sinks.DirectorySink) and len(w._threads) == cfg.writer_threads
        info = read_export_json(str(tmp_path))
        assert (info["architecture"], info["aux_layer_ids"], info["hidden_size"]) == ("LlamaForCausalLM", [2, 5, 7], 16)
        assert info["numerics"]["attention_backend"] == "torch_native" and info["chat_template_sha256"] is None
    finally:
        w.close()
    with pytest.raises(ValueError, match="hidden_size"):
        make_writer(cfg, Served(**{**SERVED.__dict__, "hidden_size": 32}), (2, 5, 7), "dp0")

