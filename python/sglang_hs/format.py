"""The on-disk export format: one safetensors file per sample, a manifest, and export.json.

README.md ("File format") is the human description; `validate_export` is the executable one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import struct
import uuid
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Union

import torch
from safetensors import safe_open

from sglang_hs.protocol import DuplicateSampleError, SampleIdError

# /2 adds fp8 planes with per-row scales and final rows at loss positions only; a /1 file is a
# /2 file stored in the model's dtype with every final row, and reads the same. /3 adds
# samples with decode rows (metadata prompt_tokens): one row fewer than tokens; a /2 file is a
# /3 file without them.
FORMAT_VERSION = "sglang-hs/3"
EXPORT_JSON = "export.json"
MANIFEST = "manifest.jsonl"
FILES_PER_SHARD = 10_000

REQUIRED_KEYS = ("token_ids", "aux_hidden_states", "final_hidden_states")
SCALE_KEYS = ("aux_hidden_states_scale", "final_hidden_states_scale")
OPTIONAL_KEYS = ("loss_mask", *SCALE_KEYS, "final_positions")

_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


def check_sample_id(rid: object) -> str:
    """A sample id becomes a file name, so only a plain, bounded name is accepted."""
    if not isinstance(rid, str) or not _SAFE_ID.fullmatch(rid) or rid.endswith(".tmp"):
        raise SampleIdError(
            f"rid {rid!r} cannot name an exported sample: use 1-200 characters from "
            "A-Z a-z 0-9 . _ -, starting with a letter or digit (e.g. 'sample-000123')."
        )
    return rid


def shard_dir_name(writer_tag: str, index: int) -> str:
    return f"{writer_tag}-{index:05d}"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64",
              torch.int32: "I32", torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}

Parts = Union[torch.Tensor, Sequence[torch.Tensor]]


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


# Bytes up to which consecutive small pieces are joined before one write (see `coalesce`).
COALESCE_BYTES = 8 << 20


def coalesce(parts: Sequence[torch.Tensor], max_bytes: Optional[int] = None) -> List[torch.Tensor]:
    """The same rows in fewer tensors: runs of consecutive pieces smaller than max_bytes are
    joined (one copy of at most max_bytes each); larger pieces stay as they are.

    Why: every torch call and every write gives up the GIL, and taking it back while the
    scheduler thread runs Python costs up to the switch interval (5 ms). A sample with decode
    rows has a one-row piece per generated token: written piece by piece, 257 pieces took 3.0 s
    instead of 13 ms with a busy Python thread beside the writer (benchmark/results/
    cpu_gil_writer.json), and a held answer waits for that."""
    max_bytes = max_bytes or COALESCE_BYTES
    out: List[torch.Tensor] = []
    run: List[torch.Tensor] = []
    run_bytes = 0

    def flush():
        nonlocal run, run_bytes
        if run:
            out.append(run[0] if len(run) == 1 else torch.cat(run))
        run, run_bytes = [], 0

    for p in parts:
        nbytes = p.numel() * p.element_size()
        if nbytes >= max_bytes:
            flush()
            out.append(p)
            continue
        if run_bytes + nbytes > max_bytes:
            flush()
        run.append(p)
        run_bytes += nbytes
    flush()
    return out


def _stream_safetensors(fd: int, tensors: Mapping[str, Parts], metadata: Dict[str, str]) -> None:
    """The safetensors layout (8-byte header size, JSON header, raw bytes), written straight
    from the tensors' memory: a value may be a list of pieces stored one after the other as
    one tensor (rows of successive chunks); only small pieces are joined (`coalesce`), so a
    sample is never copied whole in memory."""
    header: Dict[str, object] = {"__metadata__": dict(metadata)}
    order, offset = [], 0
    for name in sorted(tensors):
        parts = tensors[name]
        parts = [parts] if isinstance(parts, torch.Tensor) else list(parts)
        first = parts[0]
        shape = [sum(p.shape[0] for p in parts), *first.shape[1:]] if first.dim() else []
        nbytes = sum(p.numel() * p.element_size() for p in parts)
        header[name] = {"dtype": _ST_DTYPES[first.dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        order += coalesce(parts)
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    _write_all(fd, struct.pack("<Q", len(raw)) + raw)
    for p in order:
        if p.numel():
            _write_all(fd, p.contiguous().view(torch.uint8).numpy())


def write_sample_file(path: str, tensors: Mapping[str, Parts], metadata: Dict[str, str]) -> int:
    """Write atomically and never over an existing sample: temp file, fsync, link, fsync dir.

    Returns the file size. Raises DuplicateSampleError if `path` exists; on any error the
    temporary file is removed and nothing is left under `path`.
    """
    folder = os.path.dirname(path)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _stream_safetensors(fd, tensors, metadata)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # atomic, and fails instead of overwriting
        except FileExistsError:
            raise DuplicateSampleError(
                f"sample {os.path.basename(path)} already exists in {folder}; "
                "send a new rid or remove the old file and its manifest line"
            ) from None
        except OSError:
            # Filesystems without hard links: check, then rename (not race-free there).
            if os.path.exists(path):
                raise DuplicateSampleError(f"sample {path} already exists") from None
            os.rename(tmp, path)
        size = os.path.getsize(path)
        _fsync_dir(folder)
        return size
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def append_manifest(fd: int, sample_id: str, rel_path: str, num_tokens: int) -> None:
    """Append one line and fsync it, or raise and leave the manifest as it was.

    A write can be short (a full disk, a file-size limit): the rest is written, and if that
    fails the partial line is cut off, so the next append never glues onto it. Callers
    serialise their appends to one descriptor (the cut assumes no other line was added).
    """
    line = (json.dumps({"id": sample_id, "path": rel_path, "num_tokens": num_tokens}) + "\n").encode()
    start = os.fstat(fd).st_size
    try:
        _write_all(fd, line)
        os.fsync(fd)
    except BaseException:
        os.ftruncate(fd, start)
        raise


def open_manifest(out_dir: str) -> int:
    return os.open(os.path.join(out_dir, MANIFEST), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def read_manifest(out_dir: str) -> List[dict]:
    """Manifest entries in order. A line that is not JSON (a write torn by a crash or a full
    disk) is not a sample and is skipped; `validate_export` reports it."""
    return [e for e in _manifest_lines(out_dir) if isinstance(e, dict)]


def _manifest_lines(out_dir: str) -> List[object]:
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.exists(path):
        return []
    out: List[object] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                out.append(f"{MANIFEST}:{n}: not JSON (torn write?)")
    return out


def read_export_json(out_dir: str) -> Optional[dict]:
    path = os.path.join(out_dir, EXPORT_JSON)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_export_json(out_dir: str, info: dict) -> None:
    path = os.path.join(out_dir, EXPORT_JSON)
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "w") as f:
        json.dump(info, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# Keys of export.json that must match when a server appends to an existing directory.
IDENTITY_KEYS = ("model_path", "aux_layer_ids", "hidden_size", "num_layers", "dtype", "export_dtype", "final_rows")
# What a directory written before a key existed holds (format sglang-hs/1).
_IDENTITY_DEFAULTS = {"export_dtype": None, "final_rows": "all"}


def check_compatible(existing: dict, new: Mapping[str, object]) -> None:
    diff = {k: (existing.get(k, _IDENTITY_DEFAULTS.get(k)), new[k]) for k in IDENTITY_KEYS
            if k in new and existing.get(k, _IDENTITY_DEFAULTS.get(k)) != new[k]}
    if diff:
        detail = ", ".join(f"{k}: {a!r} there vs {b!r} now" for k, (a, b) in diff.items())
        raise ValueError(
            f"the export directory already holds samples of another configuration ({detail}). "
            "Use a new --export-hidden-states-dir or the same model, layers and storage."
        )


def chat_template_sha256(template) -> Optional[str]:
    """A fingerprint of a tokenizer's chat template (a string, or a list/dict of named
    templates), the same on the server (export.json) and in `capture` (each sample)."""
    if not template:
        return None
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()

# --------------------------------------------------------------------------------------
# Storage of the planes: --export-dtype and --export-final-rows
# --------------------------------------------------------------------------------------

# --export-dtype values and what they store; None (the default) stores the model's dtype.
EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
FINAL_ROWS = ("all", "loss")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# The scale is rounded up by more than a bf16 rounding step, so the row's largest entry never
# lands above FP8_MAX when the division runs in bf16 (where it is computed on the device).
_SCALE_MARGIN = 1.0 + 2.0 ** -7


@dataclasses.dataclass(frozen=True)
class Storage:
    """How samples store their planes: `dtype` (an EXPORT_DTYPES name, None for the model's
    own dtype) and which final rows (`all`, or `loss`: only at loss-mask positions)."""

    dtype: Optional[str] = None
    final_rows: str = "all"

    def __post_init__(self):
        if self.dtype is not None and self.dtype not in EXPORT_DTYPES:
            raise ValueError(f"export dtype must be one of {', '.join(EXPORT_DTYPES)}, got {self.dtype!r}")
        if self.final_rows not in FINAL_ROWS:
            raise ValueError(f"final rows must be one of {', '.join(FINAL_ROWS)}, got {self.final_rows!r}")

    @property
    def scaled(self) -> bool:
        return self.dtype == "fp8_e4m3"

    def row_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return EXPORT_DTYPES[self.dtype] if self.dtype else model_dtype

    @classmethod
    def of_export(cls, info: Mapping) -> "Storage":
        """From export.json (a /1 directory has neither key: model dtype, every final row)."""
        return cls(info.get("export_dtype"), info.get("final_rows", "all"))


def quantize_rows(x: torch.Tensor):
    """(fp8 e4m3 [..., H], float32 scale [...]): one scale per row, amax / 448, so each row
    uses fp8's whole range; dequantized = q * scale. A zero row gets the smallest normal
    float32 as its scale (and zeros), never 0/0. Runs where x is (on the GPU before the copy
    to the host, so the copy shrinks too) and divides `x` in place when it is bf16 or float32
    (the caller's own gathered rows), so no full-size temporary is made."""
    work = x if x.dtype in (torch.bfloat16, torch.float32) else x.float()
    # max |x| per row as a reduction, without a full-size |x| temporary on the forward's device
    amax = torch.linalg.vector_norm(work, ord=float("inf"), dim=-1).float()
    scale = (amax * (_SCALE_MARGIN / FP8_MAX)).clamp_min(torch.finfo(torch.float32).tiny)
    divisor = scale.to(work.dtype)
    q = work.div_(divisor.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, divisor.float()  # the divisor actually used, exactly


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def decode_sample(t: Dict[str, torch.Tensor], dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """A sample's tensors with its planes in `dtype` whatever their storage: fp8 planes are
    dequantized with their scales (the scale keys are consumed). `final_positions`, when
    present, says which positions the final rows are of (see `final_at_every_position`)."""
    t = dict(t)
    for key in ("aux_hidden_states", "final_hidden_states"):
        scale = t.pop(f"{key}_scale", None)
        t[key] = dequantize_rows(t[key], scale, dtype) if scale is not None else t[key].to(dtype)
    return t


def num_rows(num_tokens: int, meta: Mapping[str, str]) -> int:
    """Rows of a sample of num_tokens tokens: one per token, but a sample with decode rows
    (metadata prompt_tokens: where the generated tokens start) has none for its last token,
    which the model generated and no forward ever computed."""
    return num_tokens - 1 if meta.get("prompt_tokens") is not None else num_tokens


def row_at_every_token(t: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A sample (as stored or decoded) with a row for every token: a sample with decode rows
    gets a zero row (fp8: scale 1) for its last token, which predicts nothing (no token
    follows it), as layouts of one row per token need."""
    n = t["token_ids"].shape[0]
    out = dict(t)
    for key in ("aux_hidden_states", "final_hidden_states", *SCALE_KEYS):
        x = out.get(key)
        if x is None or x.shape[0] != n - 1 or (key.startswith("final") and "final_positions" in t):
            continue
        pad = torch.zeros((1, *x.shape[1:]), dtype=torch.float32)
        out[key] = torch.cat([x, (pad + 1 if key in SCALE_KEYS else pad).to(x.dtype)])
    return out


def final_at_every_position(t: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """[T, H]: the final rows of a decoded sample at their positions, zeros where the export
    kept none (`--export-final-rows loss`: positions outside the loss mask)."""
    fin = t["final_hidden_states"]
    pos = t.get("final_positions")
    if pos is None:
        return fin
    full = fin.new_zeros((t["token_ids"].shape[0], fin.shape[-1]))
    full[pos.long()] = fin
    return full


# How a sample's loss mask was made, in its provenance: from the model's chat template by
# `capture`, given with the record (pre-tokenized input), or none (raw text: all ones).
MASK_POLICIES = ("template", "given", "none")
PROVENANCE_KEY = "capture"


@dataclasses.dataclass(frozen=True)
class CaptureProvenance:
    """What made one sample, written by `sglang-hs capture` into the sample's metadata (under
    "capture") and shown by `inspect`; converters read `mask_policy` to know whether a mask may
    be re-derived for a trainer's convention."""

    source: str
    tokenizer: str
    chat_template_sha256: Optional[str]
    mask_policy: str
    last_turn_only: bool
    mask_reasoning: bool
    max_length: Optional[int]
    truncated: bool
    regenerated: bool
    sglang_hs_version: str

    def __post_init__(self):
        if self.mask_policy not in MASK_POLICIES:
            raise ValueError(f"mask_policy must be one of {MASK_POLICIES}, got {self.mask_policy!r}")

    @classmethod
    def of_sample(cls, meta: Mapping[str, str]) -> Optional["CaptureProvenance"]:
        """From a sample file's metadata; None for a sample not written through `capture`."""
        try:
            raw = json.loads(meta.get("metadata") or "{}").get(PROVENANCE_KEY)
        except (ValueError, AttributeError):
            return None
        if not isinstance(raw, dict):
            return None
        fields = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in raw.items() if k in fields})
        except (TypeError, ValueError):
            return None


def load_sample(path: str) -> Dict[str, torch.Tensor]:
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def sample_metadata(path: str) -> Dict[str, str]:
    with safe_open(path, framework="pt") as f:
        return dict(f.metadata() or {})


def iter_samples(out_dir: str) -> Iterator[tuple]:
    for entry in read_manifest(out_dir):
        yield entry, os.path.join(out_dir, entry["path"])


@dataclasses.dataclass
class ValidationReport:
    samples: int = 0
    tokens: int = 0
    bytes: int = 0
    errors: List[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def validate_export(
    out_dir: str,
    expected_tokens: Optional[Mapping[str, Sequence[int]]] = None,
    check_values: bool = True,
) -> ValidationReport:
    """Check an export directory against the format: export.json, manifest, and every file's
    keys, dtypes, shapes, metadata, finite values, and (if given) token ids."""
    rep = ValidationReport()
    info = read_export_json(out_dir)
    if info is None:
        rep.errors.append(f"{out_dir}: no {EXPORT_JSON}")
        return rep
    for key in ("model_path", "architecture", "hidden_size", "num_layers", "dtype", "aux_layer_ids",
                "final_is_post_norm", "format"):
        if key not in info:
            rep.errors.append(f"{EXPORT_JSON}: missing '{key}'")
    if rep.errors:
        return rep
    rep.errors += [x for x in _manifest_lines(out_dir) if isinstance(x, str)]
    seen = set()
    for entry, path in iter_samples(out_dir):
        sid = entry.get("id")
        where = f"sample {sid!r}"
        if sid in seen:
            rep.errors.append(f"{where}: listed twice in {MANIFEST}")
            continue
        seen.add(sid)
        if not os.path.exists(path):
            rep.errors.append(f"{where}: {entry.get('path')} is in the manifest but missing")
            continue
        rep.samples += 1
        rep.bytes += os.path.getsize(path)
        want = expected_tokens.get(sid) if expected_tokens is not None else None
        errors, n = sample_errors(info, sid, path, entry.get("num_tokens"), want, check_values)
        rep.tokens += max(n, 0)
        rep.errors += [f"{where}: {e}" for e in errors]
    if expected_tokens is not None:
        rep.errors += [f"sample {sid!r}: expected but not exported" for sid in expected_tokens if sid not in seen]
    return rep


def sample_errors(info: Mapping, sid: str, path: str, num_tokens: Optional[int] = None,
                  expected_tokens: Optional[Sequence[int]] = None, check_values: bool = True):
    """(what is wrong with one sample file, its token count or -1) against export.json `info`;
    num_tokens: what the manifest says (None: not listed yet)."""
    try:
        t = load_sample(path)
        meta = sample_metadata(path)
    except Exception as e:  # a damaged file is a finding, not a crash of the validator
        return [f"unreadable ({e})"], -1
    missing = [k for k in REQUIRED_KEYS if k not in t]
    extra = [k for k in t if k not in REQUIRED_KEYS + OPTIONAL_KEYS]
    if missing or extra:
        return [f"missing keys {missing}, unexpected keys {extra}"], -1
    storage = Storage.of_export(info)
    hidden, k_aux = info["hidden_size"], len(info["aux_layer_ids"])
    model_dtype = _DTYPES.get(info["dtype"])
    dtype = storage.row_dtype(model_dtype) if model_dtype is not None or storage.dtype else None
    tok, aux, fin = t["token_ids"], t["aux_hidden_states"], t["final_hidden_states"]
    n = tok.shape[0] if tok.dim() == 1 else -1
    rows = num_rows(n, meta)
    prompt = meta.get("prompt_tokens")
    lm = t.get("loss_mask")
    pos = t.get("final_positions")
    if storage.final_rows == "loss":
        if lm is None or pos is None:
            return [f"final rows are kept at loss positions only, but the file has no "
                    f"{'loss_mask' if lm is None else 'final_positions'}"], n
        r = pos.shape[0]
        at_loss = torch.nonzero(lm[:rows].to(torch.int64) == 1).flatten()
        pos_ok = pos.dtype == torch.int64 and pos.dim() == 1 and torch.equal(pos, at_loss)
    else:
        r, pos_ok = rows, pos is None
    checks = [
        (tok.dim() == 1 and not tok.is_floating_point(), f"token_ids {tuple(tok.shape)} {tok.dtype}"),
        (prompt is None or (prompt.isdigit() and 0 < int(prompt) < n),
         f"metadata prompt_tokens {prompt!r} must be a count of prompt tokens below {n}"),
        (tuple(aux.shape) == (rows, k_aux, hidden), f"aux_hidden_states {tuple(aux.shape)} != {(rows, k_aux, hidden)}"),
        (tuple(fin.shape) == (r, hidden), f"final_hidden_states {tuple(fin.shape)} != {(r, hidden)}"),
        (dtype is None or (aux.dtype == dtype and fin.dtype == dtype), f"dtype {aux.dtype}/{fin.dtype} != {dtype}"),
        (pos_ok, "final_positions must be the loss mask's positions (int64), and only with --export-final-rows loss"),
        (num_tokens is None or num_tokens == n, f"manifest num_tokens {num_tokens} != {n}"),
        (meta.get("id") == sid, f"metadata id {meta.get('id')!r}"),
        (meta.get("aux_layer_ids") == json.dumps(info["aux_layer_ids"]), f"metadata aux_layer_ids {meta.get('aux_layer_ids')}"),
    ]
    scales = [t.get(k) for k in SCALE_KEYS]
    if storage.scaled:
        a_s, f_s = scales
        checks.append((a_s is not None and f_s is not None and a_s.dtype == f_s.dtype == torch.float32
                       and tuple(a_s.shape) == (rows, k_aux) and tuple(f_s.shape) == (r,),
                       f"fp8 planes need float32 scales [{rows}, {k_aux}] and [{r}]"))
        if check_values and a_s is not None and f_s is not None:
            checks.append((bool(torch.isfinite(a_s).all() and torch.isfinite(f_s).all()
                                and (a_s > 0).all() and (f_s > 0).all()), "scales must be finite and > 0"))
    else:
        checks.append((all(x is None for x in scales), f"scale keys in a {dtype} export"))
    if lm is not None:
        checks.append((lm.dtype == torch.uint8 and tuple(lm.shape) == (n,) and bool(((lm == 0) | (lm == 1)).all()),
                       f"loss_mask {tuple(lm.shape)} {lm.dtype} must be [T] uint8 of 0/1"))
    if expected_tokens is not None:
        checks.append((tok.tolist() == list(expected_tokens), "token_ids differ from the client's tokens"))
    if check_values:
        # torch has no isfinite for fp8: upcast those planes only
        finite = lambda x: bool(torch.isfinite(x.float() if x.element_size() == 1 else x).all())  # noqa: E731
        checks.append((finite(aux) and finite(fin), "NaN or Inf in hidden states"))
    return [msg for ok, msg in checks if not ok], n


# --------------------------------------------------------------------------------------
# Repair: what a crash, a kill or a full disk can leave behind, reconciled
# --------------------------------------------------------------------------------------

_SHARD = re.compile(r"dp\d+-\d{5}")


@dataclasses.dataclass
class RepairReport:
    dir: str
    applied: bool
    torn_lines: List[str] = dataclasses.field(default_factory=list)  # manifest lines that are not JSON: cut
    adopted: List[str] = dataclasses.field(default_factory=list)  # valid files never listed: listed now
    quarantined: List[str] = dataclasses.field(default_factory=list)  # unlisted, invalid: renamed *.corrupt
    missing: List[str] = dataclasses.field(default_factory=list)  # listed, file gone: line dropped
    duplicates: List[str] = dataclasses.field(default_factory=list)  # listed twice: one line kept
    temp_files: List[str] = dataclasses.field(default_factory=list)  # interrupted writes: removed

    @property
    def changed(self) -> bool:
        return any((self.torn_lines, self.adopted, self.quarantined, self.missing, self.duplicates, self.temp_files))

    def lines(self) -> List[str]:
        out = []
        for what, items in (("torn manifest lines cut", self.torn_lines),
                            ("unlisted valid samples listed", self.adopted),
                            ("unlisted invalid files renamed to *.corrupt", self.quarantined),
                            ("listed samples with no file unlisted (resend them)", self.missing),
                            ("duplicate manifest lines dropped", self.duplicates),
                            ("temporary files removed", self.temp_files)):
            if items:
                shown = ", ".join(items[:10]) + (f", ... ({len(items)} in all)" if len(items) > 10 else "")
                out.append(f"{len(items)} {what}: {shown}")
        if not out:
            return [f"{self.dir}: nothing to repair"]
        return out if self.applied else [f"dry run, nothing changed (pass --apply to repair {self.dir}):"] + out


def repair_export(out_dir: str, apply: bool = False) -> RepairReport:
    """Reconcile an export directory after a crash, with no server writing to it.

    A sample exists once its manifest line does: the writer commits the file, then appends
    the line. A crash in between leaves a valid file nobody lists (it is validated and
    listed, so a resend of its id is answered "already exported" truthfully); a crash or a
    full disk mid-append leaves a torn line (cut, and the manifest rewritten atomically);
    an interrupted write leaves a temporary file (removed). Dry run unless `apply`.
    """
    rep = RepairReport(out_dir, apply)
    path = os.path.join(out_dir, MANIFEST)
    kept: List[dict] = []
    listed = set()
    if os.path.exists(path):
        with open(path, "rb") as f:
            raw = f.read()
        for n, line in enumerate(raw.split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                e = json.loads(line)
                ok = isinstance(e, dict) and isinstance(e.get("id"), str) and isinstance(e.get("path"), str)
            except ValueError:
                ok = False
            if not ok:
                rep.torn_lines.append(f"line {n}")
            elif e["id"] in listed:
                rep.duplicates.append(e["id"])
            elif not os.path.exists(os.path.join(out_dir, e["path"])):
                rep.missing.append(e["id"])
            else:
                listed.add(e["id"])
                kept.append(e)
    info = read_export_json(out_dir)
    shards = sorted(d for d in os.listdir(out_dir) if _SHARD.fullmatch(d)) if os.path.isdir(out_dir) else []
    for d in shards:
        for name in sorted(os.listdir(os.path.join(out_dir, d))):
            rel, full = f"{d}/{name}", os.path.join(out_dir, d, name)
            if name.startswith(".") and name.endswith(".tmp"):
                rep.temp_files.append(rel)
                if apply:
                    os.unlink(full)
            elif name.endswith(".safetensors") and name[:-len(".safetensors")] not in listed:
                sid = name[:-len(".safetensors")]
                errors, n = sample_errors(info, sid, full) if info else (["no export.json"], -1)
                if errors:
                    rep.quarantined.append(f"{rel} ({errors[0]})")
                    if apply:
                        os.replace(full, full + ".corrupt")
                else:
                    rep.adopted.append(sid)
                    listed.add(sid)
                    kept.append({"id": sid, "path": rel, "num_tokens": n})
    for name in os.listdir(out_dir) if os.path.isdir(out_dir) else []:
        if name.startswith(f"{EXPORT_JSON}.") and name.endswith(".tmp"):
            rep.temp_files.append(name)
            if apply:
                os.unlink(os.path.join(out_dir, name))
    if apply and (rep.torn_lines or rep.adopted or rep.missing or rep.duplicates):
        tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps({"id": e["id"], "path": e["path"], "num_tokens": e.get("num_tokens")}) + "\n"
                         for e in kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(out_dir)
    return rep


def human_bytes(n: float) -> str:
    if n <= 0:
        return "0 B"
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    i = min(int(math.log(n, 1024)), len(units) - 1)
    return f"{n / 1024 ** i:.1f} {units[i]}"
