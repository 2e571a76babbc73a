"""Which sample ids an export directory holds, kept on disk instead of in memory: an SQLite
index beside the manifest (DIR/.ids.sqlite). A server that exports for weeks holds in memory
only what is in flight; what is done is on disk.

The manifest stays the truth. The launcher recreates the index from it at every start, after
repair (so the index never needs to survive a crash: it is written without fsync). A writer
adds an id once its sample is listed; the ids it is writing are in memory (in flight, so
bounded), and a failed write (a full disk) leaves nothing in the index to undo. The HTTP
process asks the index whether a rid is done, and adds the rids a trainer's sink reports
(the manifest lists only the directory's). Each connection's page cache is capped
(CACHE_KIB), so the memory an index takes stays flat however many ids it holds.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from typing import Iterable

INDEX = ".ids.sqlite"
CACHE_KIB = 2048


class IdIndex:
    """The export directory's done ids: `sid in index`, `add`. One connection, shared by the
    threads of its process."""

    def __init__(self, out_dir: str):
        path = os.path.join(out_dir, INDEX)
        fresh = not os.path.exists(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, timeout=60, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=OFF")  # recreated from the manifest at every start
        self._db.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
        self._db.execute("CREATE TABLE IF NOT EXISTS ids (id TEXT PRIMARY KEY) WITHOUT ROWID")
        if fresh:  # a directory this server did not start on (a tool, a test): list the manifest's
            from sglang_hs.format import read_manifest

            self._fill(e["id"] for e in read_manifest(out_dir))

    @classmethod
    def recreate(cls, out_dir: str) -> "IdIndex":
        """At start-up, after repair: a new index of exactly the manifest's ids."""
        for suffix in ("", "-wal", "-shm"):
            try:
                os.unlink(os.path.join(out_dir, INDEX + suffix))
            except FileNotFoundError:
                pass
        return cls(out_dir)

    def _fill(self, ids: Iterable[str]) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany("INSERT OR IGNORE INTO ids VALUES (?)", ((i,) for i in ids))
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def __contains__(self, sid: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM ids WHERE id = ?", (sid,)).fetchone() is not None

    def add(self, sid: str) -> None:
        """A sample is durable (listed in the manifest, or in a trainer's sink): refuse its rid
        from now on."""
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO ids VALUES (?)", (sid,))

    def close(self) -> None:
        with self._lock:
            self._db.close()
