"""Several export directories as one dataset (tools/dirs.py), as a capture through several
servers leaves them: one real export (HF states of the tiny model, written by our writer)
split over directories the way servers would have written it, then read back by every tool
and compared with the one directory."""

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from hypothesis import given, settings
from hypothesis import strategies as hs

from harness.fixtures import write_test_export_json
from sglang_hs.format import EXPORT_JSON, MANIFEST, read_manifest
from sglang_hs.tools.cli import main as cli
from sglang_hs.tools.convert import ExportDataset, dataset_order, inspect_export, to_speculators
from sglang_hs.tools.dirs import ExportDirs, expand
from sglang_hs.tools.verify import verify_export
from test_convert import write_export  # noqa: E402 (test/unit is on sys.path)


def split(src, dests, where):
    """Copy export `src` into directories `dests`: sample i's file and manifest line go to
    every directory in where(i) (more than one: the sample was exported twice)."""
    for d in dests:
        os.makedirs(d)
        shutil.copy(os.path.join(src, EXPORT_JSON), d)
    for i, e in enumerate(read_manifest(src)):
        for k in where(i):
            os.makedirs(os.path.join(dests[k], os.path.dirname(e["path"])), exist_ok=True)
            shutil.copy(os.path.join(src, e["path"]), os.path.join(dests[k], e["path"]))
            with open(os.path.join(dests[k], MANIFEST), "a") as f:
                f.write(json.dumps(e) + "\n")
    return dests


@pytest.fixture(scope="module")
def export(tiny_path, tmp_path_factory):
    return write_export(tiny_path, str(tmp_path_factory.mktemp("dirs") / "one"))


@pytest.fixture
def three(export, tmp_path):
    """Round-robin over three servers, and sample 1 exported twice (a resend that reached
    another worker)."""
    d, _, _ = export
    dests = [str(tmp_path / f"node{k}") for k in range(3)]
    return split(d, dests, lambda i: [i % 3, (i + 1) % 3] if i == 1 else [i % 3])


def test_three_directories_read_as_the_one_they_were_split_from(export, three):
    d, samples, _ = export
    one, many = ExportDataset(d), ExportDataset(three)
    assert [e["id"] for e in many.entries] == [e["id"] for e in one.entries] == list(samples)
    for i in range(len(one)):
        a, b = one[i], many[i]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    dup = read_manifest(d)[1]["id"]  # split's sample 1: the second manifest line
    assert many.dirs.duplicates == {dup: [three[1], three[2]]}
    assert any(repr(dup) in line and f"read from {three[1]}" in line for line in many.dirs.lines())


def test_a_trainer_gets_the_same_files_from_the_split_directories(export, three, tmp_path):
    d, _, _ = export
    to_speculators(d, str(tmp_path / "from-one"))
    rep = to_speculators(three, str(tmp_path / "from-three"))
    assert rep.samples == len(ExportDataset(d)) and any("listed in 2 directories" in n for n in rep.notes)
    names = sorted(os.listdir(tmp_path / "from-one" / "hidden_states"))
    assert names == sorted(os.listdir(tmp_path / "from-three" / "hidden_states"))
    for n in names:  # equal tensors and metadata (safetensors writes metadata keys in no fixed order)
        files = [str(tmp_path / f / "hidden_states" / n) for f in ("from-one", "from-three")]
        (a, ma), (b, mb) = [(load_file(f), safe_open(f, "pt").metadata()) for f in files]
        assert ma == mb and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), n
    sources = json.load(open(tmp_path / "from-three" / "sglang_hs_index.json"))["sources"]
    assert sources == [os.path.abspath(x) for x in three]


def test_inspect_and_verify_count_each_sample_once(export, three, tiny_path):
    d, samples, _ = export
    one, many = inspect_export(d), inspect_export(three)
    for k in ("samples", "tokens", "length_histogram", "aux_layer_ids"):
        assert one[k] == many[k], k
    assert many["bytes"] == one["bytes"] and many["dirs"] == three
    rep = verify_export(three, samples=2)
    assert rep.ok and rep.samples == 2 and rep.notes, rep.table()


def test_a_list_file_names_the_directories(three, tmp_path):
    listing = tmp_path / "nodes.txt"
    listing.write_text("# one line per node\nnode0\n\nnode1  # the second\nnode2\n")
    assert expand([str(listing)]) == [str(tmp_path / f"node{k}") for k in range(3)]
    assert [e["id"] for e in ExportDataset([str(listing)]).entries] == [e["id"] for e in ExportDataset(three).entries]


def test_directories_of_other_rows_are_refused_naming_what_differs(three):
    info = json.load(open(os.path.join(three[2], EXPORT_JSON)))
    moved = {**info, "model_path": "/elsewhere/" + os.path.basename(info["model_path"].rstrip("/"))}
    json.dump(moved, open(os.path.join(three[2], EXPORT_JSON), "w"))
    ExportDirs.open(three)  # the same checkpoint at another path on another node
    json.dump({**moved, "aux_layer_ids": [1, 4, 6], "export_dtype": "fp8_e4m3"},
              open(os.path.join(three[2], EXPORT_JSON), "w"))
    with pytest.raises(ValueError, match=r"node2 holds other rows than .*node0.*aux_layer_ids: \[2, 4, 6\] vs "
                                         r"\[1, 4, 6\]; export_dtype: None vs 'fp8_e4m3'"):
        ExportDirs.open(three)
    with pytest.raises(ValueError, match="given twice"):
        ExportDirs.open([three[0], three[0] + "/"])
    with pytest.raises(ValueError, match="not an export directory"):
        ExportDirs.open([three[0], os.path.dirname(three[0])])


def test_the_cli_takes_several_directories(three, capsys):
    cli(["inspect", *three])
    out = capsys.readouterr().out
    assert "listed in 2 directories" in out and "5 samples" in out
    cli(["repair", *three])
    out = capsys.readouterr().out
    assert all(f"{d}:" in out for d in three)
    with pytest.raises(SystemExit, match="one export directory"):  # options between DIRs and DEST, as in the README
        cli(["convert", *three, "--to", "speculators", "/tmp/x", "--follow"])


@settings(max_examples=60, deadline=None)
@given(hs.lists(hs.lists(hs.integers(0, 3), min_size=1, max_size=3, unique=True), min_size=1, max_size=25),
       hs.randoms())
def test_every_sample_id_is_read_once_in_dataset_order_and_every_repeat_is_reported(placements, rnd):
    """Sample i is listed in the directories placements[i] (several: exported twice), each
    directory's manifest in its own completion order."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        dirs = [os.path.join(tmp, f"d{k}") for k in range(4)]
        ids = [f"run-{i:08d}-x" for i in range(len(placements))]
        lines = {d: [] for d in dirs}
        for sid, where in zip(ids, placements):
            for k in where:
                lines[dirs[k]].append({"id": sid, "path": f"dp0-00000/{sid}.safetensors", "num_tokens": 3})
        for d in dirs:
            os.makedirs(d)
            write_test_export_json(d, 8)
            rnd.shuffle(lines[d])
            with open(os.path.join(d, MANIFEST), "w") as f:
                f.writelines(json.dumps(e) + "\n" for e in lines[d])
        got = ExportDirs.open(dirs)
        read = [e["id"] for e in got.entries]
        assert sorted(read) == ids  # each once
        assert [read[i] for i in dataset_order(read)] == ids
        assert got.duplicates == {sid: [dirs[k] for k in sorted(w)] for sid, w in zip(ids, placements) if len(w) > 1}
        assert all(e["dir"] == dirs[min(w)] for e in got.entries for sid, w in zip(ids, placements) if e["id"] == sid)
