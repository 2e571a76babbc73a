"""Where a complete sample goes, behind one interface: `put(st)` returns once the sample is
durable where its consumer will look, and says what the answer must tell that consumer.

- `directory` (`DirectorySink`): the export directory (`sglang_hs.format`): a sample file,
  then its manifest line.
- `speculators-file`, `speculators-fp8` (`HandoffSink`): one safetensors file per request in
  hs-connectors' `file`/`fp8` layout, in `DIR/handoff/`, outside the manifest: speculators'
  online trainer deletes each file once it has read it. The answer is its
  `kv_transfer_params` `{"hidden_states_path": ...}`.
- `speculators-mooncake` (`SpeculatorsMooncakeSink`): one packed Mooncake object per request,
  written by hs-connectors' own producer code (`MooncakeHiddenStatesStore.put_sample`); the
  answer is its transfer manifest.
- `specforge` (`SpecForgeSink`): SpecForge 0.2.0's `spec_capture` contract: one Mooncake
  object per tensor under `{store_id}/{sample_id}/g{gen}/{name}`, hard-pinned, as SpecForge's
  own store reads them; the answer is `meta_info["spec_capture"]`.

Sinks other than the directory list nothing in the manifest, so recovery and
`validate_export` see only the directory's own samples.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sqlite3
import threading
import time
from typing import Dict, Optional, Sequence, Tuple

import torch

from sglang_hs.format import (
    FILES_PER_SHARD,
    FORMAT_VERSION,
    Storage,
    append_manifest,
    open_manifest,
    quantize_rows,
    shard_dir_name,
    write_sample_file,
)
from sglang_hs.layouts import SPECULATORS_LAST_LAYER, specforge_online, speculators_fp8_planes, speculators_planes
from sglang_hs.overlay.config import MooncakeSettings
from sglang_hs.overlay.ids import IdIndex
from sglang_hs.overlay.rows import RequestState, build_sample
from sglang_hs.overlay.staging import joined
from sglang_hs.protocol import DuplicateSampleError, ExportError

logger = logging.getLogger("sglang_hs.overlay.sinks")

HANDOFF_DIR = "handoff"
# speculators reads and deletes a handoff file inside the call that got its answer; one this
# old belongs to a trainer that died before reading it and will never be read.
HANDOFF_ORPHAN_S = 600


@dataclasses.dataclass
class Placed:
    """Where a durable sample is: `path` relative to the export directory (directory sink),
    `bytes` written, and `answer`, what the response hands the consumer (other sinks)."""

    bytes: int
    path: Optional[str] = None
    answer: Optional[dict] = None


def sample_rows(st: RequestState) -> Tuple[torch.Tensor, torch.Tensor]:
    """(aux [T, K, H], final [T, H]) of a complete request, its pieces put end to end."""
    return torch.cat(joined(st.pieces, "aux")), torch.cat(joined(st.pieces, "final"))


class DirectorySink:
    name = "directory"

    def __init__(self, out_dir: str, writer_tag: str, aux_layer_ids: Sequence[int], storage: Storage = Storage()):
        self.out_dir = out_dir
        self.tag = writer_tag
        self.aux_layer_ids = list(aux_layer_ids)
        self.storage = storage
        self._lock = threading.Lock()
        self._manifest_lock = threading.Lock()
        self._done = IdIndex(out_dir)  # the directory's samples, on disk
        self._writing = set()  # ids being written by this writer (in flight: bounded)
        self._shard, self._in_shard = self._find_shard()
        self._manifest_fd = open_manifest(out_dir)

    def _find_shard(self):
        pat = re.compile(re.escape(self.tag) + r"-(\d{5})")
        idx = max((int(m.group(1)) for d in os.listdir(self.out_dir) if (m := pat.fullmatch(d))), default=0)
        d = os.path.join(self.out_dir, shard_dir_name(self.tag, idx))
        n = len([f for f in os.listdir(d) if f.endswith(".safetensors")]) if os.path.isdir(d) else 0
        return idx, n

    def _claim_path(self, sid: str) -> str:
        with self._lock:
            if sid in self._writing or sid in self._done:
                raise DuplicateSampleError(
                    f"sample id {sid!r} is already exported in {self.out_dir}; send a new rid"
                )
            self._writing.add(sid)
            if self._in_shard >= FILES_PER_SHARD:
                self._shard, self._in_shard = self._shard + 1, 0
            self._in_shard += 1
            rel = os.path.join(shard_dir_name(self.tag, self._shard), f"{sid}.safetensors")
        os.makedirs(os.path.join(self.out_dir, os.path.dirname(rel)), exist_ok=True)
        return rel

    def _unclaim(self, sid: str) -> None:
        with self._lock:
            self._writing.discard(sid)
            self._in_shard -= 1

    def put(self, st: RequestState) -> Placed:
        """Write the file, then list it: a sample exists once its manifest line does."""
        tensors = build_sample(st, self.storage)
        meta = {
            "format": FORMAT_VERSION,
            "id": st.rid,
            "aux_layer_ids": json.dumps(self.aux_layer_ids),
            "metadata": json.dumps(st.options.metadata or {}),
        }
        if st.output_ids:  # decode rows: where the answer starts
            meta["prompt_tokens"] = str(st.prompt_len)
        rel = self._claim_path(st.rid)
        path = os.path.join(self.out_dir, rel)
        try:
            size = write_sample_file(path, tensors, meta)
            try:
                with self._manifest_lock:  # one line at a time (append_manifest cuts a torn one)
                    append_manifest(self._manifest_fd, st.rid, rel, st.num_tokens)
            except BaseException:
                os.unlink(path)  # not in the manifest: not a sample
                raise
        except BaseException:
            self._unclaim(st.rid)
            raise
        with self._lock:
            self._writing.discard(st.rid)
            try:
                self._done.add(st.rid)
            except sqlite3.Error as e:  # the sample is listed: the index catches up at the next start
                logger.warning("sglang-hs: could not add %s to the id index (%s); it is in the manifest", st.rid, e)
        return Placed(bytes=size, path=rel)

    def close(self) -> None:
        os.close(self._manifest_fd)
        self._done.close()


class HandoffSink:
    """speculators' `file` (fp8=False) or `fp8` backend: `DIR/handoff/{rid}.safetensors`,
    published atomically (the reader never sees a partial file, so no `.lock` is needed)."""

    storage = Storage()  # model dtype: the sink makes its own layout

    def __init__(self, out_dir: str, aux_layer_ids: Sequence[int], norm_weight: torch.Tensor, fp8: bool):
        self.name = "speculators-fp8" if fp8 else "speculators-file"
        self.dir = os.path.join(out_dir, HANDOFF_DIR)
        os.makedirs(self.dir, exist_ok=True)
        self.orphans_removed = remove_orphans(self.dir, HANDOFF_ORPHAN_S)
        self.aux_layer_ids = list(aux_layer_ids)
        self.norm_weight = norm_weight
        self.fp8 = fp8

    def put(self, st: RequestState) -> Placed:
        aux, final = sample_rows(st)
        if self.fp8:
            q, s = quantize_rows(aux.clone())
            planes = speculators_fp8_planes(q, s, final, self.norm_weight)
        else:
            planes = speculators_planes(aux, final, self.norm_weight)
        path = os.path.join(self.dir, f"{st.rid}.safetensors")
        if os.path.lexists(path):
            raise DuplicateSampleError(f"{path} exists: the trainer has not read an earlier sample with rid {st.rid!r}; "
                                       "send a new rid")
        size = write_sample_file(path, {**planes, "token_ids": torch.tensor(list(st.prompt_ids), dtype=torch.int64)},
                                 {"id": st.rid, "last_layer": SPECULATORS_LAST_LAYER,
                                  "aux_layer_ids": json.dumps(self.aux_layer_ids)})
        return Placed(bytes=size, answer={"hidden_states_path": path})

    def close(self) -> None:
        pass


def remove_orphans(handoff_dir: str, age_s: float) -> int:
    """Remove handoff files (and temp files of a crashed write) older than `age_s`: left by a
    trainer killed between an answer and its read, or by a server killed mid-write."""
    n, now = 0, time.time()
    for name in os.listdir(handoff_dir):
        path = os.path.join(handoff_dir, name)
        try:
            if now - os.lstat(path).st_mtime > age_s:
                os.unlink(path)
                n += 1
        except FileNotFoundError:  # read and deleted by a trainer meanwhile
            pass
    return n


def _hs_store(cfg: MooncakeSettings):
    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig

    return MooncakeHiddenStatesStore(MooncakeStoreConfig(
        local_hostname=cfg.hostname, metadata_server=cfg.metadata_server, master_server_address=cfg.master,
        global_segment_size=cfg.segment_bytes, local_buffer_size=cfg.local_buffer_bytes, protocol=cfg.protocol,
        device_name=cfg.device)).setup()


# Mooncake's status codes a producer meets (mooncake-store `ErrorCode`), and what to do about each.
MOONCAKE_STATUS = {
    -200: "no space left in the Mooncake segments: the trainer has not removed what it read, or is gone (its "
          "unread objects hold the space); raise --export-mooncake-segment-gib or restart the trainer",
    -900: "the Mooncake master does not answer: is mooncake_master running at {master}? Puts resume once it is "
          "back (samples stored before it went away are lost with its metadata)",
}


def mooncake_failure(what: str, status: int, master: str) -> ExportError:
    """A failed put as the request's error (503: the server serves on; a resend may succeed)."""
    why = MOONCAKE_STATUS.get(status, "see the Mooncake log of this server")
    return ExportError(f"could not put {what} into Mooncake (status {status}): {why.format(master=master)}", 503)


_STATUS = re.compile(r"status=(-?\d+)")


def mooncake_key(rid: str) -> str:
    """A rid as a Mooncake key, the way hs-connectors' vLLM connector makes one."""
    safe = re.sub(r"[^a-zA-Z0-9_-]", "_", rid)
    return ("k" + safe) if safe[:1].isdigit() else safe


class SpeculatorsMooncakeSink:
    """speculators' `mooncake` backend, through hs-connectors' producer code: bf16 only (its
    consumer does not dequantize)."""

    name = "speculators-mooncake"

    storage = Storage()  # model dtype: the sink makes its own layout

    def __init__(self, cfg: MooncakeSettings, norm_weight: torch.Tensor, store=None):
        from hs_connectors.mooncake_store import VERSION, packed_layout

        self._layout, self._version = packed_layout, VERSION
        self.norm_weight = norm_weight
        self.master = cfg.master
        self.store = store or _hs_store(cfg)

    def put(self, st: RequestState) -> Placed:
        aux, final = sample_rows(st)
        tensors = {**speculators_planes(aux, final, self.norm_weight),
                   "token_ids": torch.tensor(list(st.prompt_ids), dtype=torch.int64)}
        spec, total = self._layout({k: (list(v.shape), v.dtype) for k, v in tensors.items()})
        manifest = {"handle": mooncake_key(st.rid), "version": self._version, "tensors": spec,
                    "metadata": {"num_tokens": st.prompt_len, "total_aligned_bytes": total,
                                 "extract_mode": "prompt_only"}}
        try:
            self.store.put_sample(manifest, tensors)
        except RuntimeError as e:  # a full segment, the master gone: the request fails, the server serves on
            m = _STATUS.search(str(e))  # hs-connectors says "... with status=N"
            if m is None:
                raise ExportError(f"could not put sample {st.rid} into Mooncake: {e}", 503) from None
            raise mooncake_failure(f"sample {st.rid}", int(m.group(1)), self.master) from None
        return Placed(bytes=total, answer=manifest)

    def close(self) -> None:
        pass


class SpecForgeSink:
    """SpecForge 0.2.0's `spec_capture` writes: each request names its store, sample id and
    generation; each tensor is its own hard-pinned Mooncake object."""

    name = "specforge"

    storage = Storage()  # model dtype: the sink makes its own layout

    def __init__(self, cfg: MooncakeSettings, specforge_layer_ids: Sequence[int], store=None):
        self.layer_ids = list(specforge_layer_ids)
        self.master = cfg.master
        if store is None:
            from mooncake.store import MooncakeDistributedStore

            store = MooncakeDistributedStore()
            rc = store.setup(cfg.hostname, cfg.metadata_server, cfg.segment_bytes, cfg.local_buffer_bytes,
                             cfg.protocol, cfg.device, cfg.master)
            if rc != 0:
                raise RuntimeError(f"cannot join the Mooncake store at {cfg.master} (status {rc}); "
                                   "is mooncake_master running there?")
        self.store = store

    def _pin(self):
        from mooncake.store import ReplicateConfig

        rc = ReplicateConfig()
        rc.replica_num = 1
        rc.with_hard_pin = True  # SpecForge's consumer frees it (release/abort), not Mooncake's eviction
        return rc

    def put(self, st: RequestState) -> Placed:
        req = st.options.specforge
        aux, final = sample_rows(st)
        n = st.prompt_len
        tensors: Dict[str, torch.Tensor] = {}
        feats = req["features"]
        online = specforge_online(aux, final)
        if "aux" in feats:
            tensors[feats["aux"]] = online["hidden_state"]
        if "last_hidden" in feats:
            tensors[feats["last_hidden"]] = online["target"]
        for p in req.get("passthrough", ()):
            t = torch.tensor(p["data"], dtype=torch.int64).reshape(p["shape"])
            if t.shape[1] != n:
                raise ExportError(f"spec_capture passthrough {p['name']!r} has {t.shape[1]} positions, the prompt "
                                  f"{n}", 400)
            tensors[p["name"]] = t.contiguous()
        prefix = f"{req['store_id']}/{req['sample_id']}/g{int(req['gen'])}/"
        if req.get("replace"):
            for name in tensors:
                self.store.remove(prefix + name, force=True)
        written, size = [], 0
        try:
            for name, t in tensors.items():
                nb = t.numel() * t.element_size()
                self.store.register_buffer(t.data_ptr(), nb)
                try:
                    rc = self.store.put_from(prefix + name, t.data_ptr(), nb, self._pin())
                finally:
                    self.store.unregister_buffer(t.data_ptr())
                if rc is not None and int(rc) < 0:
                    raise mooncake_failure(prefix + name, int(rc), self.master)
                written.append(prefix + name)
                size += nb
        except BaseException:
            for key in written:  # nothing half-written stays behind
                self.store.remove(key, force=True)
            raise
        return Placed(bytes=size, answer={
            "sample_id": req["sample_id"], "store_id": req["store_id"], "gen": int(req["gen"]),
            "aux_layer_ids": self.layer_ids,
            "features": {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
                         for k, v in tensors.items()}})

    def close(self) -> None:
        pass
