"""What an export is configured by: one table of our launcher flags (it feeds SGLang's
argparse parser and `ExportConfig`, so each default exists once), one spec per sink, and the
resolved config every process reads (no SGLang imports)."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import uuid
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from sglang_hs.format import Storage


class ExportConfigError(ValueError):
    """A start-up setting that cannot work; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class SinkSpec:
    """What one --export-sink does, read wherever the sink matters (never its name)."""

    name: str
    writes: str  # what it writes, for --help
    # Answers (decode rows) as well as prompts; live capture, which writes both, needs it.
    decode_rows: bool = False
    # --export-dtype and --export-final-rows shape its files (the directory's own format);
    # every other sink writes its trainer's layout from full-precision rows at every position.
    storage_options: bool = False
    # Its samples carry the aux layer ids; without them the trainer assumes its own default,
    # which the export then captures unless told otherwise.
    names_layers: bool = True
    # Python modules its producer code needs, and how to install them.
    modules: Tuple[Tuple[str, str], ...] = ()
    # Where the response tells the consumer where its sample is, beside
    # meta_info["hidden_states_export"]: None, "kv_transfer_params" (a completion's top
    # level, as hs-connectors reads it) or "spec_capture" (meta_info, as SpecForge reads it).
    answer_field: Optional[str] = None

    @property
    def takes_spec_capture(self) -> bool:
        """It exports what SpecForge's `spec_capture` requests ask for, and only those."""
        return self.answer_field == "spec_capture"


_MOONCAKE = ("mooncake.store", "mooncake-transfer-engine (GPU hosts) or mooncake-transfer-engine-non-cuda (CPU), "
                               "and on Debian apt-get install libibverbs1 libnl-3-200 libnl-route-3-200")
SINKS: Dict[str, SinkSpec] = {s.name: s for s in (
    SinkSpec("directory", "the export directory (default)", decode_rows=True, storage_options=True),
    SinkSpec("speculators-file", "files in DIR/handoff/ that speculators' online trainer deletes once read",
             names_layers=False, answer_field="kv_transfer_params"),
    SinkSpec("speculators-fp8", "the same in hs-connectors' fp8 layout", names_layers=False,
             answer_field="kv_transfer_params"),
    SinkSpec("speculators-mooncake", "one packed Mooncake object per request (hs-connectors' producer)",
             names_layers=False, modules=(("hs_connectors", "hs-connectors==0.9.0 --no-deps"), _MOONCAKE),
             answer_field="kv_transfer_params"),
    SinkSpec("specforge", "SpecForge's spec_capture requests, into Mooncake", modules=(_MOONCAKE,),
             answer_field="spec_capture"),
)}


@dataclasses.dataclass(frozen=True)
class Flag:
    """One launcher flag: argparse's arguments, and the ExportConfig field it sets (`field`,
    times `scale`: GiB -> bytes); no field for a flag the launcher resolves itself."""

    name: str
    default: Any
    help: str
    type: Optional[Callable] = None
    choices: Optional[Sequence[str]] = None
    metavar: Optional[str] = None
    nargs: Optional[str] = None
    field: Optional[str] = None
    scale: int = 1

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")

    def argparse_kwargs(self) -> dict:
        if self.default is False and self.type is None:
            return {"action": "store_true", "help": self.help}
        kw = {"default": self.default, "help": self.help, "type": self.type, "choices": self.choices,
              "metavar": self.metavar, "nargs": self.nargs}
        return {k: v for k, v in kw.items() if v is not None or k == "default"}

    def config_value(self, given: Any) -> Any:
        return int(given * self.scale) if self.scale != 1 else given


GIB = 1 << 30
FLAGS: Tuple[Flag, ...] = (
    Flag("--export-hidden-states-dir", None, type=str, metavar="DIR",
         help="Write the EAGLE-3 aux hidden states and the post-norm final hidden state of every prompt token of "
              "every generation request to DIR (one safetensors file per request; see the sglang-hs README)."),
    Flag("--export-aux-layer-ids", None, type=int, nargs="+", metavar="K",
         help="Aux layers as indices into Hugging Face output_hidden_states (0 = embeddings; k = input of decoder "
              "layer k). Default: the model's EAGLE-3 default, [2, L//2, L-3] for Llama/Qwen/DeepSeek."),
    Flag("--export-host-buffer-gib", 2.0, type=float, metavar="GIB", field="host_buffer_bytes", scale=GIB,
         help="Host memory for exported rows not yet on disk; when full, the forward loop waits for the writer "
              "(default %(default)s)."),
    Flag("--export-writer-threads", 8, type=int, metavar="N", field="writer_threads",
         help="Background threads writing sample files (default %(default)s)."),
    Flag("--export-write-timeout", 600.0, type=float, metavar="S", field="write_timeout_s",
         help="Seconds /generate waits for its sample to be durable (default %(default)s)."),
    Flag("--export-dtype", None, choices=["bf16", "fp8_e4m3"], field="export_dtype",
         help="How rows are stored: bf16, or fp8_e4m3 with one float32 scale per row and plane (quantized on the "
              "device, about half the bytes). Default: the model's dtype."),
    Flag("--export-final-rows", "all", choices=["all", "loss"], field="final_rows",
         help="Final-state rows at every prompt position (all, the default), or only where the request's "
              "loss_mask is 1 (loss: every exported request must send a loss_mask)."),
    Flag("--platform-preset", None, type=str, metavar="NAME",
         help="Environment variables (NCCL) and server flags for one kind of machine, from "
              "sglang_hs/data/presets.json (sm120-pcie-tp8, hopper-nvlink); what you set or give wins."),
    Flag("--export-sink", "directory", choices=list(SINKS), field="sink",
         help="Where samples go: " + "; ".join(f"{s.name}: {s.writes}" for s in SINKS.values())
              + ". See docs/online-training.md."),
    Flag("--export-mooncake-master", "127.0.0.1:50051", metavar="HOST:PORT", field="mooncake_master",
         help="The Mooncake master of the Mooncake sinks (default %(default)s). The writer's own address is "
              "MOONCAKE_LOCAL_HOSTNAME (default 127.0.0.1)."),
    Flag("--export-mooncake-protocol", "tcp", choices=["tcp", "rdma"], field="mooncake_protocol",
         help="Mooncake's transport (default %(default)s)."),
    Flag("--export-mooncake-device", "", metavar="NAME", field="mooncake_device",
         help="RDMA device(s) for Mooncake, e.g. mlx5_0 (default: Mooncake chooses)."),
    Flag("--export-mooncake-segment-gib", 4.0, type=float, metavar="GIB", field="mooncake_segment_bytes", scale=GIB,
         help="Memory the writer lends the Mooncake store; it must hold the samples trainers have not read yet "
              "(default %(default)s)."),
    Flag("--export-sample-rate", 1.0, type=float, metavar="P", field="sample_rate",
         help="Share of requests exported when a request does not say (custom_params sglang_hs.export true/false "
              "always wins), chosen from the rid so a replay exports the same requests (default 1: every request)."),
    Flag("--export-mode", "held", choices=["held", "live"], field="mode",
         help="held (default): each exported request is answered once its sample is durable (capture jobs). live: "
              "answers never wait; sampled requests are exported with their answers (decode rows), and when the "
              "host buffer is full a sample is dropped and counted instead of slowing serving. See "
              "docs/live-capture.md."),
    Flag("--export-allow-untested-model", False, field="allow_untested_model",
         help="Export a model class whose layer ids read back right but whose export sglang-hs has not compared "
              "with Hugging Face (see the README's family table)."),
)
_BY_FIELD = {f.field: f for f in FLAGS if f.field}


def add_flags(parser) -> None:
    """Our flags as one group of SGLang's launcher parser."""
    g = parser.add_argument_group("sglang-hs hidden-state export")
    for f in FLAGS:
        g.add_argument(f.name, dest=f.dest, **f.argparse_kwargs())


def _default(field: str) -> Any:
    f = _BY_FIELD[field]
    return f.config_value(f.default)


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    out_dir: str
    # Indices into Hugging Face `output_hidden_states` (0 = embeddings). None: the model's
    # own EAGLE-3 default, resolved once the model is loaded.
    aux_layer_ids: Optional[Tuple[int, ...]] = None
    # Host memory for rows that are copied off the device but not yet on disk. When it is
    # full the forward loop waits (back-pressure) instead of growing RAM.
    host_buffer_bytes: int = _default("host_buffer_bytes")
    writer_threads: int = _default("writer_threads")
    # Seconds /generate waits for a sample to become durable before failing the request.
    write_timeout_s: float = _default("write_timeout_s")
    # ZeroMQ address on which writers tell the HTTP process that a sample is durable.
    notify_addr: str = ""
    allow_untested_model: bool = _default("allow_untested_model")
    export_dtype: Optional[str] = _default("export_dtype")
    final_rows: str = _default("final_rows")
    sink: str = _default("sink")
    mooncake_master: str = _default("mooncake_master")
    mooncake_protocol: str = _default("mooncake_protocol")
    mooncake_device: str = _default("mooncake_device")
    mooncake_segment_bytes: int = _default("mooncake_segment_bytes")
    # Which requests are exported when they do not say, and whether answers wait for their
    # sample (held) or not (live): admission.Policy.
    sample_rate: float = _default("sample_rate")
    mode: str = _default("mode")

    @classmethod
    def of_args(cls, args, out_dir: str, aux_layer_ids: Optional[Tuple[int, ...]]) -> "ExportConfig":
        """The config of parsed launcher flags (after start-up checks resolved the directory
        and the layer ids), with a fresh address for the writers' notices."""
        given = {f.field: f.config_value(getattr(args, f.dest)) for f in FLAGS if f.field}
        return cls(out_dir=out_dir, aux_layer_ids=aux_layer_ids, notify_addr=cls.new_notify_addr(), **given)

    @property
    def sink_spec(self) -> SinkSpec:
        return SINKS[self.sink]

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


@dataclasses.dataclass(frozen=True)
class MooncakeSettings:
    """How a writer rank joins a Mooncake store (the settings hs-connectors and SpecForge take)."""

    master: str = _default("mooncake_master")
    protocol: str = _default("mooncake_protocol")
    device: str = _default("mooncake_device")
    segment_bytes: int = _default("mooncake_segment_bytes")
    local_buffer_bytes: int = 512 << 20
    metadata_server: str = "P2PHANDSHAKE"
    # Address the other clients reach this process at (Mooncake's own variable, as hs-connectors reads it).
    hostname: str = dataclasses.field(default_factory=lambda: os.environ.get("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1"))
