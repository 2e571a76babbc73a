"""What crosses process boundaries, shared by both sides: the export options a client puts
in a request, the outcome a writer reports to the HTTP process, and the errors /generate
answers with (each carries its HTTP status).

Plain Python: the capture client, the HTTP hook and the scheduler-side writer all read it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional

# Key of SamplingParams.custom_params under which a client passes export options.
REQUEST_KEY = "sglang_hs"
MAX_METADATA_CHARS = 16_384


class ExportError(ValueError):
    """An error /generate answers with: SGLang's HTTP layer turns a ValueError raised in
    generate_request into an error response, with the exception's status_code."""

    status_code = 500

    def __init__(self, message: str, status_code: Optional[int] = None):
        super().__init__(message)
        if status_code is not None:
            self.status_code = status_code


class RequestOptionsError(ExportError):
    status_code = 400


class SampleIdError(ExportError):
    status_code = 400


class DuplicateSampleError(ExportError):
    status_code = 409


class SampleInFlightError(ExportError):
    """The rid is being exported by a request still in flight; retry once it has finished."""

    status_code = 423


@dataclasses.dataclass
class RequestOptions:
    # True: export it; False: never; None (not said): the server's --export-sample-rate decides.
    export: Optional[bool] = None
    loss_mask: Optional[List[int]] = None
    metadata: Optional[Dict[str, Any]] = None
    # Set by the HTTP process, one per /generate call: tells a request's outcome apart from
    # that of an earlier request with the same rid (e.g. one aborted when its client died).
    call_id: Optional[str] = None
    # SpecForge's per-request `spec_capture` entry (where its Mooncake objects go), moved here
    # from the /generate body by the HTTP process; see check_spec_capture.
    specforge: Optional[Dict[str, Any]] = None
    # Decode rows: the generated tokens' rows too, kept as they are decoded; the sample is
    # written when the request finishes and holds prompt and answer (format: README).
    decode_rows: bool = False


_OPTION_KEYS = {"export", "loss_mask", "metadata", "call_id", "specforge", "decode_rows"}


def check_spec_capture(entry: object) -> Dict[str, Any]:
    """One entry of SpecForge 0.2.0's `spec_capture` request field: store_id, sample_id, gen,
    replace, features {"aux": name, "last_hidden": name}, passthrough [{name, data, shape,
    dtype "int64"}]. Returns it; raises RequestOptionsError naming what is wrong."""
    def bad(why: str):
        return RequestOptionsError(f"spec_capture entry {why}; got {entry!r:.200}")

    if not isinstance(entry, dict):
        raise bad("must be an object")
    for key in ("store_id", "sample_id"):
        if not isinstance(entry.get(key), str) or not entry[key]:
            raise bad(f"needs {key} (a non-empty string)")
    if not isinstance(entry.get("gen"), int) or isinstance(entry.get("gen"), bool) or entry["gen"] < 0:
        raise bad("needs gen (an integer >= 0)")
    feats = entry.get("features")
    if not isinstance(feats, dict) or not feats or set(feats) - {"aux", "last_hidden"} or not all(
            isinstance(v, str) and v for v in feats.values()):
        raise bad('needs features {"aux": NAME, "last_hidden": NAME} (either or both)')
    for p in entry.get("passthrough") or []:
        if not (isinstance(p, dict) and isinstance(p.get("name"), str) and isinstance(p.get("data"), list)
                and isinstance(p.get("shape"), list) and len(p["shape"]) >= 2 and p.get("dtype") == "int64"):
            raise bad("passthrough items need name, data (a list), shape [1, L, ...] and dtype int64")
    return entry


def parse_request_options(custom_params: Optional[dict]) -> RequestOptions:
    """Read `sampling_params.custom_params["sglang_hs"]`: {"export", "loss_mask", "metadata",
    "decode_rows"} (and "call_id", which the server sets itself)."""
    raw = (custom_params or {}).get(REQUEST_KEY) if isinstance(custom_params, dict) else None
    if raw is None:
        return RequestOptions()
    if not isinstance(raw, dict) or set(raw) - _OPTION_KEYS:
        raise RequestOptionsError(
            f"custom_params[{REQUEST_KEY!r}] must be a dict with keys export (bool), "
            f"loss_mask (list of 0/1, one per prompt token), metadata (dict), decode_rows (bool); got {raw!r:.200}"
        )
    flags = {k: raw.get(k, d) for k, d in (("export", None), ("decode_rows", False))}
    for k, v in flags.items():
        if k in raw and not isinstance(v, bool):  # bool("false") is True: a string must not mean yes
            raise RequestOptionsError(f"{k} must be true or false (a JSON boolean); got {v!r:.50}")
    opts = RequestOptions(call_id=raw.get("call_id"), **flags)
    if raw.get("specforge") is not None:
        opts.specforge = check_spec_capture(raw["specforge"])
    lm = raw.get("loss_mask")
    if lm is not None:
        if not isinstance(lm, list) or any(v not in (0, 1) or isinstance(v, float) for v in lm):
            raise RequestOptionsError("loss_mask must be a list of 0/1 integers, one per prompt token")
        opts.loss_mask = [int(v) for v in lm]
    md = raw.get("metadata")
    if md is not None:
        if not isinstance(md, dict):
            raise RequestOptionsError("metadata must be a JSON object (dict)")
        if len(json.dumps(md)) > MAX_METADATA_CHARS:
            raise RequestOptionsError(f"metadata must serialize to at most {MAX_METADATA_CHARS} characters")
        opts.metadata = md
    return opts


@dataclasses.dataclass
class Outcome:
    """What became of one exported request, from the writer rank to the HTTP process.

    ok: the sample is durable in its sink (num_tokens, bytes): for the directory sink, the file
    is listed in the manifest (path); other sinks give `answer`, what the response hands the
    trainer (overlay.sinks). aborted: the request was aborted, nothing was written. Otherwise
    it failed: error, status.
    """

    rid: str
    call_id: Optional[str]
    ok: bool = False
    aborted: bool = False
    path: Optional[str] = None
    num_tokens: Optional[int] = None
    bytes: Optional[int] = None
    error: Optional[str] = None
    status: int = 500
    sink: str = "directory"
    answer: Optional[Dict[str, Any]] = None

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "Outcome":
        d = json.loads(raw)
        if not isinstance(d, dict) or not isinstance(d.get("rid"), str):
            raise ValueError(f"not an export outcome: {raw!r:.200}")
        return cls(**d)

    def meta_info(self, out_dir: str) -> Optional[dict]:
        """meta_info["hidden_states_export"] of the response; None for an aborted request;
        a failure raises the error /generate answers with."""
        if self.ok and self.sink == "directory":
            return {"dir": out_dir, "path": self.path, "num_tokens": self.num_tokens, "bytes": self.bytes}
        if self.ok:
            return {"sink": self.sink, "num_tokens": self.num_tokens, "bytes": self.bytes, "answer": self.answer}
        if self.aborted:
            return None
        raise ExportError(f"hidden-state export failed: {self.error}", self.status)
