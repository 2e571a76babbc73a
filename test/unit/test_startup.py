import argparse
import os

import pytest

from sglang_hs.format import read_manifest, shard_dir_name
from sglang_hs.overlay.config import SINKS, ExportConfig, ExportConfigError, SinkSpec, add_flags
from sglang_hs.overlay.startup import (
    Server,
    check_aux_layer_ids,
    check_out_dir,
    check_policy,
    check_sink_imports,
    check_startup,
)
from harness.fixtures import write_test_export_json


def test_layer_ids_in_hf_convention():
    assert check_aux_layer_ids([2, 15, 27], 30) == (2, 15, 27)
    assert check_aux_layer_ids([1, 29], 30) == (1, 29)


@pytest.mark.parametrize("ids,what", [
    ([0, 5], "out of range"),      # embeddings: upstream crashes at warm-up
    ([2, 30], "out of range"),     # after the last layer: upstream never captures it
    ([5, 5], "strictly increasing"),
    ([9, 3], "strictly increasing"),
    ([], "at least one"),
])
def test_bad_layer_ids_say_what_to_do(ids, what):
    with pytest.raises(ExportConfigError, match=what):
        check_aux_layer_ids(ids, 30)


def test_out_dir_created_and_probed(tmp_path):
    d = check_out_dir(str(tmp_path / "a" / "b"))
    assert os.path.isdir(d) and os.listdir(d) == []


def test_out_dir_not_creatable(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ExportConfigError, match="cannot create or write"):
        check_out_dir(str(f / "sub"))


def test_live_capture_and_the_sample_rate_are_checked_at_start_up():
    check_policy("live", 0.1, SINKS["directory"], "all")
    check_policy("held", 0.0, SINKS["specforge"], "all")
    for mode, rate, sink, final_rows, what in (("held", 1.5, "directory", "all", r"\[0, 1\]"),
                                               ("live", 0.1, "specforge", "all", "--export-sink directory"),
                                               ("live", 1.0, "directory", "loss", "--export-final-rows all")):
        with pytest.raises(ExportConfigError, match=what):
            check_policy(mode, rate, SINKS[sink], final_rows)


SERVER = Server(model_path="m", pp_size=1, speculative_algorithm=None, tokenizer_worker_num=1, nnodes=1,
                row_breaking=[])


def flags(*argv):
    p = argparse.ArgumentParser()
    add_flags(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("server,what", [
    (SERVER._replace(speculative_algorithm="EAGLE3"), "speculative decoding"),
    (SERVER._replace(pp_size=2), "--pp-size"),
    (SERVER._replace(nnodes=2), "one server per node"),
    (SERVER._replace(tokenizer_worker_num=2), "--tokenizer-worker-num 1"),
    (SERVER._replace(row_breaking=["--enable-layernorm-sp shards the final rows by sequence"]), "layernorm-sp"),
])
def test_a_server_whose_rows_cannot_be_planned_is_refused_and_the_directory_left_alone(tmp_path, server, what):
    out = tmp_path / "out"
    with pytest.raises(ExportConfigError, match=what):
        check_startup(flags("--export-hidden-states-dir", str(out)), server, lambda: 30)
    assert not out.exists()


def test_a_start_up_resolves_the_config_and_repairs_what_a_crash_left(tmp_path):
    out = str(tmp_path / "out")
    shard = os.path.join(out, shard_dir_name("dp0", 0))
    os.makedirs(shard)
    write_test_export_json(out, hidden_size=8, model_path="m")
    torn = os.path.join(shard, ".torn.safetensors.0123abcd.tmp")  # a write the crash cut short
    with open(torn, "wb") as f:
        f.write(b"x")
    cfg = check_startup(flags("--export-hidden-states-dir", out, "--export-aux-layer-ids", "2", "5", "7",
                              "--export-host-buffer-gib", "0.5"), SERVER, lambda: 10)
    assert (cfg.out_dir, cfg.aux_layer_ids, cfg.host_buffer_bytes) == (out, (2, 5, 7), 1 << 29)
    assert cfg.notify_addr.startswith("ipc://") and read_manifest(out) == []
    assert not os.path.exists(torn)
    with pytest.raises(ExportConfigError, match="aux_layer_ids"):  # the directory holds other layers
        check_startup(flags("--export-hidden-states-dir", out, "--export-aux-layer-ids", "3", "5", "7"), SERVER,
                      lambda: 10)


def test_a_sink_whose_payload_names_no_layers_captures_its_trainers_default(tmp_path):
    cfg = check_startup(flags("--export-hidden-states-dir", str(tmp_path), "--export-sink", "speculators-file"),
                        SERVER, lambda: 32)
    assert cfg.aux_layer_ids == (2, 16, 29)  # speculators' [2, L//2, L-3]
    cfg = check_startup(flags("--export-hidden-states-dir", str(tmp_path / "d")), SERVER, lambda: 32)
    assert cfg.aux_layer_ids is None  # the directory records them: resolved once the model loads


def test_storage_options_are_refused_for_a_sink_that_writes_its_trainers_layout(tmp_path):
    for extra in (["--export-dtype", "fp8_e4m3"], ["--export-final-rows", "loss"]):
        with pytest.raises(ExportConfigError, match="drop --export-dtype and --export-final-rows"):
            check_startup(flags("--export-hidden-states-dir", str(tmp_path), "--export-sink", "speculators-file",
                                *extra), SERVER, lambda: 32)


def test_a_sink_whose_producer_module_is_missing_is_refused_with_how_to_install_it():
    spec = SinkSpec("x", "nowhere", modules=(("sglang_hs_no_such_module", "some-package==1.0"),))
    with pytest.raises(ExportConfigError, match="needs the Python module sglang_hs_no_such_module.*some-package==1.0"):
        check_sink_imports(spec)
    check_sink_imports(SINKS["directory"])
