"""A scheduler's export machinery, built once its model is loaded: the sink its config names,
the host buffer and the writer on the one rank per data-parallel group that writes, and
export.json's provenance (plain code; seams.init_attention_backends reads SGLang's objects and
calls it)."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from typing import Optional, Sequence

import torch

from sglang_hs import __version__
from sglang_hs.format import FORMAT_VERSION, Storage, check_compatible, read_export_json, write_export_json
from sglang_hs.overlay.config import ExportConfig
from sglang_hs.overlay.startup import ENV_PRESET

logger = logging.getLogger("sglang_hs")


@dataclasses.dataclass(frozen=True)
class Served:
    """What this scheduler serves, as export.json records it (read from SGLang's resolved
    server args and model runner by the seam)."""

    model_path: str
    architecture: str
    hidden_size: int
    num_layers: int
    dtype: str
    device: str  # "cuda", "cpu", ...
    attention_backend: Optional[str]
    tp_size: int
    dp_size: int
    sglang_version: str
    tokenizer_path: Optional[str] = None
    trust_remote_code: bool = False
    quantization: Optional[str] = None
    kv_cache_dtype: Optional[str] = None
    disable_custom_all_reduce: bool = False
    enable_torch_compile: bool = False
    disable_cuda_graph: bool = False

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")


def is_writer_rank(attn_tp_rank: int, attn_cp_rank: int, is_last_pp_rank: bool) -> bool:
    """One rank per data-parallel group copies and writes.

    Tensor-parallel ranks of one attention group hold identical (all-reduced) hidden states
    and the same batch, so rank 0 of the group writes for all of them. With DP attention each
    group sees its own requests, so each group's rank 0 writes its own.
    """
    return attn_tp_rank == 0 and attn_cp_rank == 0 and is_last_pp_rank


def make_writer(cfg: ExportConfig, served: Served, ids: Sequence[int], shard: str):
    """export.json (written, or checked against the one there), then the writer with its host
    buffer and sink."""
    from sglang_hs.overlay.notify import Notifier
    from sglang_hs.overlay.staging import SLAB_BYTES, SlabPool
    from sglang_hs.overlay.writer import SampleWriter

    info = export_info(served, ids, cfg.storage)
    existing = read_export_json(cfg.out_dir)
    if existing is None:
        write_export_json(cfg.out_dir, info)
    else:
        check_compatible(existing, info)
    # A buffer below 16 slabs has 16 smaller ones (each still room for 64 float32 rows).
    row_max = (len(ids) + 1) * (served.hidden_size * 4 + 4)
    slab = min(SLAB_BYTES, max(cfg.host_buffer_bytes // 16, 64 * row_max))
    # live capture never makes the forward loop wait for host memory: it drops the sample
    pool = SlabPool(cfg.host_buffer_bytes, slab_bytes=slab, pin=served.on_cuda, drop_when_full=cfg.mode == "live")
    return SampleWriter(make_sink(cfg, served.model_path, ids, shard), pool, Notifier(cfg.notify_addr),
                        threads=cfg.writer_threads, counters=metrics_counters(shard))


def make_sink(cfg: ExportConfig, model_path: str, ids: Sequence[int], shard: str):
    from sglang_hs.layouts import final_norm_weight
    from sglang_hs.overlay import sinks

    if cfg.sink == "directory":
        return sinks.DirectorySink(cfg.out_dir, shard, ids, cfg.storage)
    if cfg.sink == "specforge":  # SpecForge numbers aux layers one lower (see convert.eagle3_draft_config)
        return sinks.SpecForgeSink(cfg.mooncake, [i - 1 for i in ids])
    w = final_norm_weight(model_path)
    if cfg.sink == "speculators-mooncake":
        return sinks.SpeculatorsMooncakeSink(cfg.mooncake, w)
    sink = sinks.HandoffSink(cfg.out_dir, ids, w, fp8=cfg.sink == "speculators-fp8")
    if sink.orphans_removed:
        logger.warning("sglang-hs: removed %d handoff files in %s older than %d s: a trainer died before reading "
                       "them", sink.orphans_removed, sink.dir, sinks.HANDOFF_ORPHAN_S)
    return sink


# The writer's counts as they appear on SGLang's /metrics (`_total` is added by Prometheus).
METRICS = {"samples": ("sglang_hs:exported_samples", "Samples exported (durable in their sink)"),
           "tokens": ("sglang_hs:exported_tokens", "Token positions of the samples exported"),
           "bytes": ("sglang_hs:exported_bytes", "Bytes of the samples exported"),
           "failed": ("sglang_hs:failed_samples", "Samples that could not be exported (each answered with its error)"),
           "dropped": ("sglang_hs:dropped_samples", "Samples live capture dropped because the host buffer was full")}


def metrics_counters(shard: str) -> dict:
    """Dependency (ledgered in FORK_NOTES.md): with --enable-metrics, SGLang sets
    PROMETHEUS_MULTIPROC_DIR before its schedulers start and serves /metrics from every
    process's prometheus_client files; counters made in a scheduler process then appear there."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return {}
    from prometheus_client import Counter

    return {k: Counter(name, doc, ["shard"]).labels(shard=shard) for k, (name, doc) in METRICS.items()}


def export_info(served: Served, aux_layer_ids: Sequence[int], storage: Storage = Storage()) -> dict:
    """export.json: what the directory holds and what the numbers were computed with."""
    return {
        "format": FORMAT_VERSION,
        "model_path": served.model_path,
        "architecture": served.architecture,
        "hidden_size": served.hidden_size,
        "num_layers": served.num_layers,
        "dtype": served.dtype,
        # How the planes are stored: None = in `dtype`; "fp8_e4m3" = fp8 with a float32 scale
        # per row and plane. final_rows "loss": final rows only at loss-mask positions.
        "export_dtype": storage.dtype,
        "final_rows": storage.final_rows,
        "aux_layer_ids": list(aux_layer_ids),
        "layer_id_convention": "hf_output_hidden_states",
        "final_is_post_norm": True,
        "attention_backend": served.attention_backend,
        "device": served.device,
        "tp_size": served.tp_size,
        "dp_size": served.dp_size,
        "quantization": served.quantization,
        "kv_cache_dtype": served.kv_cache_dtype,
        # NCCL variables, all-reduce path, graphs, GPU: the numbers change with them.
        "numerics": numerics(served),
        # The tokenizer the server was started with, and its chat template's fingerprint, to
        # compare with each sample's capture provenance (`inspect` does).
        "tokenizer_path": served.tokenizer_path,
        "chat_template_sha256": chat_template_sha256(served),
        "sglang_version": served.sglang_version,
        "sglang_hs_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def numerics(served: Served) -> dict:
    """What the exported numbers depend on beyond the model, as this scheduler process sees it."""
    from sglang_hs.overlay.presets import recorded_env

    gpu = None
    if served.on_cuda and torch.cuda.is_available():
        gpu = {"name": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability())}
    return {"env": recorded_env(os.environ), "platform_preset": os.environ.get(ENV_PRESET),
            "attention_backend": served.attention_backend, "disable_custom_all_reduce": served.disable_custom_all_reduce,
            "enable_torch_compile": served.enable_torch_compile, "disable_cuda_graph": served.disable_cuda_graph,
            "gpu": gpu}


def chat_template_sha256(served: Served) -> Optional[str]:
    """The fingerprint of the chat template of the tokenizer the server was started with
    (None when it has none or cannot be loaded here: the export does not depend on it)."""
    from transformers import AutoTokenizer

    from sglang_hs.format import chat_template_sha256 as fingerprint

    if served.tokenizer_path is None:
        return None
    try:
        tok = AutoTokenizer.from_pretrained(served.tokenizer_path, trust_remote_code=served.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - provenance only
        logger.warning("sglang-hs: could not load the tokenizer for export.json provenance: %s", e)
        return None
    return fingerprint(getattr(tok, "chat_template", None))
