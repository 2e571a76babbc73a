"""The flag table feeds SGLang's parser and ExportConfig alike: each default exists once, and
each flag reaches its field."""

import argparse
import dataclasses

from sglang_hs.overlay.config import FLAGS, SINKS, ExportConfig, MooncakeSettings, add_flags


def parse(*argv):
    p = argparse.ArgumentParser()
    add_flags(p)
    return p, p.parse_args(list(argv))


def test_no_flags_give_the_configs_own_defaults():
    _, args = parse()
    cfg = ExportConfig.of_args(args, "/out", None)
    assert dataclasses.replace(cfg, notify_addr="") == ExportConfig("/out")
    assert cfg.notify_addr.startswith("ipc://")
    assert ExportConfig("/out").mooncake == MooncakeSettings(hostname=MooncakeSettings().hostname)


def test_every_flag_with_a_field_reaches_it_and_every_field_has_one_flag():
    given = {"--export-host-buffer-gib": ["0.25"], "--export-writer-threads": ["3"], "--export-write-timeout": ["7"],
             "--export-dtype": ["fp8_e4m3"], "--export-final-rows": ["loss"], "--export-sink": ["specforge"],
             "--export-mooncake-master": ["h:1"], "--export-mooncake-protocol": ["rdma"],
             "--export-mooncake-device": ["mlx5_0"], "--export-mooncake-segment-gib": ["0.5"],
             "--export-sample-rate": ["0.3"], "--export-mode": ["live"], "--export-allow-untested-model": []}
    _, args = parse(*[x for k, v in given.items() for x in (k, *v)])
    cfg, default = ExportConfig.of_args(args, "/out", None), ExportConfig("/out")
    with_flag = {f.field for f in FLAGS if f.field}
    assert with_flag == {f.name for f in dataclasses.fields(ExportConfig)} - {"out_dir", "aux_layer_ids", "notify_addr"}
    assert {f.name for f in FLAGS if f.field} == set(given)
    assert all(getattr(cfg, k) != getattr(default, k) for k in with_flag)
    assert (cfg.host_buffer_bytes, cfg.mooncake_segment_bytes, cfg.writer_threads) == (1 << 28, 1 << 29, 3)


def test_help_names_every_sink_and_its_choices_are_the_specs():
    p, _ = parse()
    sink = next(a for a in p._actions if a.dest == "export_sink")
    assert sink.choices == list(SINKS) and sink.default == "directory"
    text = p.format_help()
    assert all(name in text for name in SINKS)
    assert "(default 8)" in text  # the writer threads' default, from the table
