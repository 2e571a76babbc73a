"""Several export directories read as one dataset: one directory per server, replica or node
of a capture, each written by its own writers, read by `inspect`, `verify`, `repair`,
`convert` and `ExportDataset` together.

They must hold the same kind of rows (model, layers, storage, numerics, releases); a sample
id listed in more than one is reported, and read once, from the first directory given.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Mapping, Sequence

from sglang_hs.format import EXPORT_JSON, read_export_json, read_manifest

# export.json keys that must agree for rows of several directories to be one dataset
# (model_path is compared by its last component: each node has its own copy of the model).
SAME = ("format", "architecture", "hidden_size", "num_layers", "dtype", "aux_layer_ids", "layer_id_convention",
        "final_is_post_norm", "export_dtype", "final_rows", "quantization", "kv_cache_dtype", "tp_size",
        "numerics", "chat_template_sha256", "sglang_version")


def expand(paths: Sequence[str]) -> List[str]:
    """The export directories named by `paths`: each a directory holding export.json, or a
    text file listing directories, one per line (`#` comments; relative to the file)."""
    dirs: List[str] = []
    for p in paths:
        if os.path.isfile(p):
            base = os.path.dirname(os.path.abspath(p))
            with open(p) as f:
                for line in f:
                    line = line.split("#", 1)[0].strip()
                    if line:
                        dirs.append(os.path.join(base, line))
        else:
            dirs.append(p)
    if not dirs:
        raise ValueError("no export directory given")
    seen = set()
    for d in dirs:
        if os.path.realpath(d) in seen:
            raise ValueError(f"{d} is given twice")
        seen.add(os.path.realpath(d))
        if not os.path.exists(os.path.join(d, EXPORT_JSON)):
            raise ValueError(f"{d} is not an export directory (no {EXPORT_JSON})")
    return dirs


def differences(a: Mapping, b: Mapping) -> List[str]:
    """What makes rows of export.json `b` another kind than those of `a`, one line per key."""
    out = [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in SAME if a.get(k) != b.get(k)]
    ma, mb = (os.path.basename(str(x.get("model_path", "")).rstrip("/")) for x in (a, b))
    if ma != mb:
        out.insert(0, f"model_path: {a.get('model_path')!r} vs {b.get('model_path')!r}")
    return out


@dataclasses.dataclass
class ExportDirs:
    """dirs: in the order given; info: the first's export.json; entries: manifest entries,
    each with its "dir", one per sample id (the first directory listing it); duplicates:
    sample id -> every directory listing it, for ids listed in more than one."""

    dirs: List[str]
    info: dict
    entries: List[dict]
    duplicates: Dict[str, List[str]]

    @classmethod
    def open(cls, paths: Sequence[str]) -> "ExportDirs":
        dirs = expand([paths] if isinstance(paths, str) else paths)
        infos = [read_export_json(d) for d in dirs]
        for d, info in zip(dirs[1:], infos[1:]):
            diff = differences(infos[0], info)
            if diff:
                raise ValueError(f"{d} holds other rows than {dirs[0]} and cannot join it in one dataset: "
                                 + "; ".join(diff))
        entries, where = [], {}
        for d in dirs:
            for e in read_manifest(d):
                where.setdefault(e["id"], []).append(d)
                if len(where[e["id"]]) == 1:
                    entries.append({**e, "dir": d})
        dups = {sid: ds for sid, ds in where.items() if len(ds) > 1}
        return cls(dirs, infos[0], entries, dups)

    def path(self, entry: Mapping) -> str:
        return os.path.join(entry["dir"], entry["path"])

    def lines(self) -> List[str]:
        """What a reader should know about the set (nothing for one directory without duplicates)."""
        out = []
        if len(self.dirs) > 1:
            out.append(f"{len(self.dirs)} export directories as one dataset: {', '.join(self.dirs)}")
        for sid, ds in sorted(self.duplicates.items())[:20]:
            out.append(f"sample {sid!r} is listed in {len(ds)} directories ({', '.join(ds)}); read from {ds[0]}")
        if len(self.duplicates) > 20:
            out.append(f"... {len(self.duplicates) - 20} more sample ids listed in several directories")
        return out
