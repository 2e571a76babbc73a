"""Typed configuration of the export, its start-up checks and what export.json records
(no SGLang imports)."""

from __future__ import annotations

import dataclasses
import datetime
import os
import tempfile
import uuid
from typing import Optional, Sequence, Tuple

from sglang_hs import __version__
from sglang_hs.format import FORMAT_VERSION, Storage


class ExportConfigError(ValueError):
    """A start-up setting that cannot work; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    out_dir: str
    # Indices into Hugging Face `output_hidden_states` (0 = embeddings). None: the model's
    # own EAGLE-3 default, resolved once the model is loaded.
    aux_layer_ids: Optional[Tuple[int, ...]] = None
    # Host memory for rows that are copied off the device but not yet on disk. When it is
    # full the forward loop waits (back-pressure) instead of growing RAM.
    host_buffer_bytes: int = 2 << 30
    writer_threads: int = 8
    # Seconds /generate waits for a sample to become durable before failing the request.
    write_timeout_s: float = 600.0
    # ZeroMQ address on which writers tell the HTTP process that a sample is durable.
    notify_addr: str = ""
    # Export a model class sglang-hs has not compared with HF (sglang_hs.overlay.aux_layers).
    allow_untested_model: bool = False
    # --export-dtype (None: the model's dtype) and --export-final-rows (format.Storage).
    export_dtype: Optional[str] = None
    final_rows: str = "all"
    # --export-sink (overlay.sinks.SINKS) and, for the Mooncake sinks, where the store is.
    sink: str = "directory"
    mooncake_master: str = "127.0.0.1:50051"
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""
    mooncake_segment_bytes: int = 4 << 30
    # --export-sample-rate and --export-mode (admission.Policy): which requests are exported
    # when they do not say, and whether answers wait for their sample (held) or not (live).
    sample_rate: float = 1.0
    mode: str = "held"

    @property
    def storage(self) -> Storage:
        return Storage(self.export_dtype, self.final_rows)

    @property
    def mooncake(self) -> "MooncakeSettings":
        return MooncakeSettings(master=self.mooncake_master, protocol=self.mooncake_protocol,
                                device=self.mooncake_device, segment_bytes=self.mooncake_segment_bytes)

    @staticmethod
    def new_notify_addr() -> str:
        return f"ipc://{tempfile.gettempdir()}/sglang-hs-{os.getpid()}-{uuid.uuid4().hex[:8]}"


# Where samples go (--export-sink; overlay/sinks.py builds each).
SINKS = ("directory", "speculators-file", "speculators-fp8", "speculators-mooncake", "specforge")


@dataclasses.dataclass(frozen=True)
class MooncakeSettings:
    """How a writer rank joins a Mooncake store (the settings hs-connectors and SpecForge take)."""

    master: str = "127.0.0.1:50051"
    protocol: str = "tcp"
    device: str = ""
    segment_bytes: int = 4 << 30
    local_buffer_bytes: int = 512 << 20
    metadata_server: str = "P2PHANDSHAKE"
    # Address the other clients reach this process at (Mooncake's own variable, as hs-connectors reads it).
    hostname: str = dataclasses.field(default_factory=lambda: os.environ.get("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1"))


def check_sink(sink: str, export_dtype: Optional[str], final_rows: str) -> None:
    """A sink other than the directory writes its trainer's own layout from full-precision
    rows at every position."""
    if sink != "directory" and (export_dtype is not None or final_rows != "all"):
        raise ExportConfigError(
            f"--export-sink {sink} writes {sink.split('-')[0]}'s own layout (speculators-fp8 is the fp8 one): "
            "drop --export-dtype and --export-final-rows, which shape the directory's files only.")


def check_policy(mode: str, sample_rate: float, sink: str, final_rows: str) -> None:
    """Live capture writes prompt and answer (decode rows), which the directory alone holds
    and which have no loss mask to keep final rows by."""
    if not 0.0 <= sample_rate <= 1.0:
        raise ExportConfigError(f"--export-sample-rate {sample_rate}: give a share of requests in [0, 1].")
    if mode == "live" and (sink != "directory" or final_rows != "all"):
        raise ExportConfigError(
            "--export-mode live writes each sampled request's prompt and answer into the export directory: "
            "use it with --export-sink directory and --export-final-rows all (the defaults).")


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


def is_writer_rank(attn_tp_rank: int, attn_cp_rank: int, is_last_pp_rank: bool) -> bool:
    """One rank per data-parallel group copies and writes.

    Tensor-parallel ranks of one attention group hold identical (all-reduced) hidden states
    and the same batch, so rank 0 of the group writes for all of them. With DP attention each
    group sees its own requests, so each group's rank 0 writes its own.
    """
    return attn_tp_rank == 0 and attn_cp_rank == 0 and is_last_pp_rank


def export_info(*, model_path: str, architecture: str, hidden_size: int, num_layers: int, dtype: str,
                aux_layer_ids: Sequence[int], attention_backend: Optional[str], device: str, tp_size: int,
                dp_size: int, sglang_version: str, tokenizer_path: Optional[str] = None,
                chat_template_sha256: Optional[str] = None, quantization: Optional[str] = None,
                kv_cache_dtype: Optional[str] = None, numerics: Optional[dict] = None,
                storage: Storage = Storage()) -> dict:
    """export.json: what the directory holds and what the numbers were computed with."""
    return {
        "format": FORMAT_VERSION,
        "model_path": model_path,
        "architecture": architecture,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "dtype": dtype,
        # How the planes are stored: None = in `dtype`; "fp8_e4m3" = fp8 with a float32 scale
        # per row and plane. final_rows "loss": final rows only at loss-mask positions.
        "export_dtype": storage.dtype,
        "final_rows": storage.final_rows,
        "aux_layer_ids": list(aux_layer_ids),
        "layer_id_convention": "hf_output_hidden_states",
        "final_is_post_norm": True,
        "attention_backend": attention_backend,
        "device": device,
        "tp_size": tp_size,
        "dp_size": dp_size,
        "quantization": quantization,
        "kv_cache_dtype": kv_cache_dtype,
        # NCCL variables, all-reduce path, graphs, GPU: the numbers change with them.
        "numerics": numerics or {},
        # The tokenizer the server was started with, and its chat template's fingerprint, to
        # compare with each sample's capture provenance (`inspect` does).
        "tokenizer_path": tokenizer_path,
        "chat_template_sha256": chat_template_sha256,
        "sglang_version": sglang_version,
        "sglang_hs_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
