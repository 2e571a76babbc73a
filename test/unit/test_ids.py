"""The export directory's id index (overlay/ids.py): exactly the manifest's ids at start-up,
and what one process adds the others see (each process has its own connection)."""

import os

from sglang_hs.format import append_manifest, open_manifest
from sglang_hs.overlay.ids import INDEX, IdIndex


def test_recreated_at_start_it_lists_exactly_the_manifest(tmp_path):
    d = str(tmp_path)
    fd = open_manifest(d)
    for sid in ("a", "b"):
        append_manifest(fd, sid, f"dp0-00000/{sid}.safetensors", 3)
    os.close(fd)
    stale = IdIndex(d)
    stale.add("crashed-mid-write")  # claimed, never listed: a crash before the manifest line
    stale.close()
    idx = IdIndex.recreate(d)
    assert "a" in idx and "b" in idx and "crashed-mid-write" not in idx and "c" not in idx
    assert os.path.exists(os.path.join(d, INDEX))


def test_an_index_opened_on_an_existing_directory_lists_its_manifest(tmp_path):
    d = str(tmp_path)
    fd = open_manifest(d)
    append_manifest(fd, "old", "dp0-00000/old.safetensors", 3)
    os.close(fd)
    assert "old" in IdIndex(d)


def test_an_id_one_process_adds_is_done_for_the_others(tmp_path):
    writer, http = IdIndex(str(tmp_path)), IdIndex(str(tmp_path))  # two processes' connections
    assert "x" not in http
    writer.add("x")
    writer.add("x")  # the HTTP process adds what it is told too: adding twice is no error
    assert "x" in http
