"""The launcher's start-up checks: our parsed flags and what SGLang resolved, turned into one
`ExportConfig`, or refused with what to do, before any process is spawned or weights are read
(plain code; seams.from_cli_args reads SGLang's objects and calls it)."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

from sglang_hs.format import check_compatible, read_export_json, repair_export
from sglang_hs.layouts import default_aux_layer_ids
from sglang_hs.overlay.config import SINKS, ExportConfig, ExportConfigError, SinkSpec
from sglang_hs.overlay.ids import IdIndex

logger = logging.getLogger("sglang_hs")

# The name of the preset this launch applied, for export.json (written in a scheduler process).
ENV_PRESET = "SGLANG_HS_PLATFORM_PRESET"


class Server(NamedTuple):
    """What start-up needs to know of the server SGLang resolved."""

    model_path: str
    pp_size: int
    speculative_algorithm: Optional[str]
    tokenizer_worker_num: int
    nnodes: int
    row_breaking: Sequence[str]  # why each row-breaking upstream flag that is on is refused


def check_startup(args, server: Server, num_layers: Callable[[], int]) -> ExportConfig:
    """Every check, then the repair of what a crash left in the directory; nothing is changed
    by a start-up that is refused. num_layers: the model's layer count, read only if needed."""
    if server.row_breaking:
        raise ExportConfigError("--export-hidden-states-dir cannot be combined with " + "; ".join(server.row_breaking)
                                + ". Drop the flag.")
    if server.pp_size > 1:
        raise ExportConfigError("--export-hidden-states-dir with --pp-size > 1 is not supported yet.")
    if server.speculative_algorithm is not None:
        raise ExportConfigError("--export-hidden-states-dir cannot be combined with speculative decoding yet: "
                                "a verify forward computes rows of draft tokens that are then rejected, and SGLang "
                                "does not say which rows were accepted (docs/upstream-rfc.md). Export with a plain "
                                "target server.")
    if server.tokenizer_worker_num > 1:
        raise ExportConfigError("--export-hidden-states-dir needs --tokenizer-worker-num 1.")
    if server.nnodes > 1:
        # Writers tell the HTTP process over an ipc:// socket, which exists on one host only.
        raise ExportConfigError("--export-hidden-states-dir with --nnodes > 1 is not supported yet: run one "
                                "server per node (each with its own export directory) behind a router.")
    out_dir = check_out_dir(args.export_hidden_states_dir)
    spec = SINKS[args.export_sink]
    ids = None
    if args.export_aux_layer_ids is not None:
        ids = check_aux_layer_ids(args.export_aux_layer_ids, num_layers())
    check_sink(spec, args.export_dtype, args.export_final_rows)
    check_policy(args.export_mode, args.export_sample_rate, spec, args.export_final_rows)
    check_sink_imports(spec)
    if not spec.names_layers and ids is None:
        # its payload carries no layer ids: capture what its trainer's draft assumes unless told
        ids = check_aux_layer_ids(default_aux_layer_ids(num_layers()), num_layers())
    elif not spec.names_layers:
        logger.warning("sglang-hs: --export-aux-layer-ids %s: speculators' payload carries no layer ids, so train "
                       "with `speculators train ... --target-layer-ids %s`", list(ids), " ".join(map(str, ids)))
    existing = read_export_json(out_dir)
    if existing is not None:
        new = {"model_path": server.model_path, "export_dtype": args.export_dtype,
               "final_rows": args.export_final_rows}
        if ids is not None:
            new["aux_layer_ids"] = list(ids)
        try:
            check_compatible(existing, new)
        except ValueError as e:
            raise ExportConfigError(f"{out_dir}: {e}") from None
    if args.export_host_buffer_gib <= 0 or args.export_writer_threads < 1:
        raise ExportConfigError("--export-host-buffer-gib must be > 0 and --export-writer-threads >= 1.")
    # Every check passed and no server writes here yet (schedulers start later): reconcile what
    # a crash left behind.
    repaired = repair_export(out_dir, apply=True)
    for line in repaired.lines() if repaired.changed else []:
        logger.warning("sglang-hs: repaired %s at start-up: %s", out_dir, line)
    IdIndex.recreate(out_dir).close()  # the done ids, from the repaired manifest
    return ExportConfig.of_args(args, out_dir, ids)


def apply_platform_preset(args, parser_defaults: dict) -> None:
    """Before ServerArgs exists and before any process spawns (children inherit os.environ):
    a preset sets a flag only where the user left the parser's default."""
    from sglang_hs.overlay.presets import PresetError, apply_preset, flag_given, get_preset

    try:
        preset = get_preset(args.platform_preset)
        applied = apply_preset(preset, os.environ, lambda f: flag_given(f, sys.argv[1:], args, parser_defaults), args)
    except PresetError as e:
        raise ExportConfigError(str(e)) from None
    os.environ[ENV_PRESET] = preset.name
    for line in applied.lines:
        logger.warning("sglang-hs: platform preset %s: %s", preset.name, line)


def check_sink(spec: SinkSpec, export_dtype: Optional[str], final_rows: str) -> None:
    """A sink other than the directory writes its trainer's own layout from full-precision
    rows at every position."""
    if not spec.storage_options and (export_dtype is not None or final_rows != "all"):
        raise ExportConfigError(
            f"--export-sink {spec.name} writes its trainer's own layout: drop --export-dtype and "
            "--export-final-rows, which shape the export directory's files only (speculators-fp8 is the fp8 handoff).")


def check_policy(mode: str, sample_rate: float, spec: SinkSpec, final_rows: str) -> None:
    """Live capture writes prompt and answer (decode rows), which only some sinks hold and
    which have no loss mask to keep final rows by."""
    if not 0.0 <= sample_rate <= 1.0:
        raise ExportConfigError(f"--export-sample-rate {sample_rate}: give a share of requests in [0, 1].")
    if mode == "live" and (not spec.decode_rows or final_rows != "all"):
        takes = ", ".join(s.name for s in SINKS.values() if s.decode_rows)
        raise ExportConfigError(
            f"--export-mode live writes each sampled request's prompt and answer: use it with --export-sink {takes} "
            "and --export-final-rows all (the defaults).")


def check_sink_imports(spec: SinkSpec) -> None:
    """Fail at start-up, not at the first sample, when a sink's producer code is missing."""
    for mod, install in spec.modules:
        try:
            __import__(mod)
        except ImportError as e:
            raise ExportConfigError(f"--export-sink {spec.name} needs the Python module {mod} ({e}): "
                                    f"pip install {install}") from None


def check_out_dir(path: str) -> str:
    """Create DIR if needed and prove we can write into it; return its absolute path."""
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-") as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise ExportConfigError(
            f"--export-hidden-states-dir {path}: cannot create or write there ({e.strerror}). "
            "Pass a directory this user can write to, e.g. /dev/shm/hs."
        ) from None
    return path


def check_aux_layer_ids(ids: Sequence[int], num_layers: int) -> Tuple[int, ...]:
    """Validate aux layer ids in the HF convention for a model of `num_layers` layers.

    Index k is the input of decoder layer k (the output of layer k-1). SGLang's capture
    loop can record k in [1, num_layers - 1]: 0 (the embeddings) crashes upstream at
    warm-up and num_layers (after the last layer) is silently never captured.
    """
    ids = tuple(int(i) for i in ids)
    if not ids:
        raise ExportConfigError("--export-aux-layer-ids: give at least one layer id.")
    bad = [i for i in ids if not 1 <= i <= num_layers - 1]
    if bad:
        raise ExportConfigError(
            f"--export-aux-layer-ids {list(ids)}: {bad} out of range. Ids are indices into "
            f"Hugging Face output_hidden_states (0 = embeddings); this model has {num_layers} "
            f"layers, so each id must be in [1, {num_layers - 1}]. The final state is always "
            "exported separately (post-norm)."
        )
    if len(set(ids)) != len(ids) or list(ids) != sorted(ids):
        raise ExportConfigError(
            f"--export-aux-layer-ids {list(ids)}: ids must be strictly increasing and "
            f"distinct, e.g. {sorted(set(ids))}."
        )
    return ids
