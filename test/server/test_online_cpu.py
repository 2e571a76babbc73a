"""Online training on CPU: a real sglang-hs server (tiny Llama, chunked prefill of 16 tokens,
prefix cache on) hands each trainer its samples over the trainer's own transport, and the
trainer's own code reads them: speculators 0.9.0 with hs-connectors 0.9.0 (its ArrowDataset
with on_missing=generate over the `file` and `mooncake` backends, and its training entry
point for a few steps), SpecForge 0.2.0 (its server capture adapter, and its Mooncake
feature store as producer and consumer). Mooncake is a real `mooncake_master` over TCP on
loopback. Every row is compared with the directory export of the same requests, which is
itself compared with HF."""

import argparse
import contextlib
import dataclasses
import math
import os
import re
import signal
import subprocess
import time

import pytest
import requests
import torch

from harness.mooncake import MooncakeMaster
from harness.trainers import specforge_cmd, specforge_steps, speculators_cmd
from sglang_hs.format import load_sample, read_manifest
from sglang_hs.layouts import final_norm_weight, speculators_planes
from sglang_hs.tools.online import speculators_index
from sglang_hs.tools.serve import LocalServer
from sglang_hs.tools.verify import verify_export

pytestmark = pytest.mark.server
ROWS = 6
CHUNK = 16
DATA = os.path.join(os.path.dirname(__file__), "..", "..", "python", "sglang_hs", "data", "chats_200.jsonl")


@contextlib.contextmanager
def server(model, tmp, sink, *flags):
    out = str(tmp / f"out-{sink}")
    args = ["--model-path", model, "--export-hidden-states-dir", out, "--export-sink", sink,
            "--chunked-prefill-size", str(CHUNK), "--skip-server-warmup", *flags]
    with LocalServer(args, str(tmp / f"{sink}.log")) as srv:
        yield srv


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("online")


@pytest.fixture(scope="module")
def index(tiny_path, work):
    """speculators' --data-path: our index of the first ROWS conversations, no states in it."""
    data = work / "records.jsonl"
    with open(DATA) as f, open(data, "w") as g:
        g.writelines(f.readlines()[:ROWS])
    rep = speculators_index(str(data), tiny_path, str(work / "index"))
    assert rep.rows == ROWS and not rep.skipped
    from datasets import load_from_disk

    rows = load_from_disk(str(work / "index")).with_format(None)
    return str(work / "index"), [list(r) for r in rows["input_ids"]], [list(r) for r in rows["loss_mask"]]


@pytest.fixture(scope="module")
def directory_server(tiny_path, work):
    """One directory-sink server for the module (an idle CPU server costs no CPU)."""
    with server(tiny_path, work, "directory") as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(directory_server, index):
    """The directory export of the same prompts, one request at a time, checked against HF:
    {row: (aux [T, K, H], final [T, H])}."""
    _, ids, _ = index
    srv = directory_server
    for i, row in enumerate(ids):
        r = srv.generate({"rid": f"row-{i}", "input_ids": row, "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200, r.text
    # SpecForge's request on a server that does not write its layout: refused, and why.
    r = srv.generate({"input_ids": ids[0], "sampling_params": {"max_new_tokens": 0},
                      "spec_capture": [{"store_id": "s", "sample_id": "a", "gen": 1,
                                        "features": {"aux": "hidden_state"}}]})
    assert r.status_code == 400 and "--export-sink specforge" in r.text, r.text
    out = srv.export_dir
    rep = verify_export(out, samples=None)
    assert rep.ok, rep.table()
    by_id = {e["id"]: e for e in read_manifest(out)}
    ref = {}
    for i in range(len(ids)):
        t = load_sample(os.path.join(out, by_id[f"row-{i}"]["path"]))
        ref[i] = (t["aux_hidden_states"], t["final_hidden_states"])
    return ref


@pytest.fixture(scope="module")
def master(work):
    with MooncakeMaster(str(work / "mooncake_master.log")) as m:
        yield m


@pytest.fixture(scope="module")
def specforge_server(tiny_path, work, master):
    with server(tiny_path, work, "specforge", "--export-mooncake-master", master.address,
                "--export-mooncake-segment-gib", "0.125") as srv:
        yield srv


def read_all_rows(ds, reference, index, norm_weight):
    _, ids, masks = index
    for i in range(len(ids)):
        item = ds[i]
        aux, final = reference[i]
        want = speculators_planes(aux, final, norm_weight)["hidden_states"]
        assert item["input_ids"].tolist() == ids[i]
        assert torch.equal(item["hidden_states"], want[:, :-1].flatten(1).to(item["hidden_states"].dtype))
        assert torch.equal(item["verifier_last_hidden_states"], want[:, -1].to(item["hidden_states"].dtype))
        assert item["loss_mask"].tolist() == masks[i]


@pytest.mark.core  # the completion_kv_transfer_params seam on every release of the window
def test_speculators_file_backend_reads_a_live_server_and_trains_on_it(trainers, tiny_path, work, index,
                                                                          reference):
    from hs_connectors.transfer import HiddenStatesBackend
    from speculators.train.data import ArrowDataset

    path, ids, _ = index
    with server(tiny_path, work, "speculators-file") as srv:
        transfer = HiddenStatesBackend.registry["file"].from_train_args(argparse.Namespace(hidden_states_path=None),
                                                                        path)
        ds = ArrowDataset(max_len=4096, datapath=path, transfer=transfer, vllm_endpoint=srv.url + "/v1",
                          on_missing="generate", model=tiny_path, hidden_states_dtype=torch.float32)
        read_all_rows(ds, reference, index, final_norm_weight(tiny_path))
        handoff = os.path.join(srv.export_dir, "handoff")
        assert os.listdir(handoff) == []  # the trainer deleted each file once read
        assert not os.path.exists(os.path.join(srv.export_dir, "manifest.jsonl"))

        # speculators' own training entry point, unmodified, on the live stream.
        def train(run, steps, epochs):
            return speculators_cmd(
                "--data-path", path, "--verifier-name-or-path", tiny_path, "--vllm-endpoint", srv.url + "/v1",
                "--hidden-states-backend", "file", "--draft-vocab-size", "32", "--num-workers", "0",
                "--max-steps", str(steps), "--epochs", str(epochs), "--total-seq-len", "256", "--draft-attn-impl",
                "sdpa", "--loss-implementation", "eager", "--save-path", str(work / run), "--log-freq", "1")

        env = {**os.environ, "COLUMNS": "400"}
        # A trainer killed mid-run: the server serves on, and at most the sample in flight
        # (one with --num-workers 0) is left unread in the handoff folder.
        with open(work / "killed.log", "w") as log:
            killed = subprocess.Popen(train("killed", 1000, 100), stdout=log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)
        deadline = time.monotonic() + 300
        while "train/loss=" not in open(work / "killed.log").read() and time.monotonic() < deadline:
            assert killed.poll() is None, open(work / "killed.log").read()[-3000:]
            time.sleep(0.1)
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
        assert len(os.listdir(handoff)) <= 1 and not [n for n in os.listdir(handoff) if n.endswith(".tmp")]
        assert requests.get(srv.url + "/health", timeout=5).status_code == 200

        r = subprocess.run(train("run", 3, 1), capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        losses = [float(x) for x in re.findall(r"train/loss=([0-9.e+-]+)", r.stdout)]
        assert len(losses) >= 2 and all(math.isfinite(x) for x in losses), r.stdout[-3000:]
        assert os.path.isdir(work / "run" / "0")  # its checkpoint
        assert len(os.listdir(handoff)) <= 1  # the killed trainer's, if any; this one read all of its own


def test_speculators_mooncake_backend_reads_a_live_server(trainers, tiny_path, work, index, reference, master,
                                                          monkeypatch):
    from hs_connectors.transfer import HiddenStatesBackend
    from speculators.train.data import ArrowDataset

    monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")
    path, _, _ = index
    with server(tiny_path, work, "speculators-mooncake", "--export-mooncake-master", master.address,
                "--export-mooncake-segment-gib", "0.125") as srv:
        args = argparse.Namespace(mooncake_master=master.address, mooncake_metadata_server="P2PHANDSHAKE",
                                  mooncake_protocol="tcp", mooncake_device="", mooncake_global_segment_gib=0.0625,
                                  mooncake_local_buffer_gib=0.0625)
        transfer = HiddenStatesBackend.registry["mooncake"].from_train_args(args, path)
        ds = ArrowDataset(max_len=4096, datapath=path, transfer=transfer, vllm_endpoint=srv.url + "/v1",
                          on_missing="generate", model=tiny_path, hidden_states_dtype=torch.float32)
        read_all_rows(ds, reference, index, final_norm_weight(tiny_path))
        # The answer names an object that is in the store until its reader deletes it (the
        # trainer's own deletions above are not counted here: the store lists no keys).
        r = requests.post(srv.url + "/v1/completions", json={"model": tiny_path, "prompt": index[1][0],
                                                             "max_tokens": 1, "return_token_ids": True})
        handle = r.json()["kv_transfer_params"]["handle"]
        store = transfer.store
        assert store._require_store().is_exist(handle) == 1
        store.delete_sample(handle)
        assert store._require_store().is_exist(handle) == 0


def test_specforge_capture_adapter_and_store_read_a_live_server(trainers, index, reference, master,
                                                                specforge_server):
    from specforge.inference.adapters.server_capture import ServerCaptureSchema, SGLangServerCaptureAdapter
    from specforge.inference.capture import CaptureConfig
    from specforge.runtime.contracts import PromptTask
    from specforge.runtime.data_plane.mooncake_store import MooncakeFeatureStore

    _, ids, masks = index
    setup = {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "master_server_addr": master.address,
             "protocol": "tcp", "global_segment_size": 64 << 20, "local_buffer_size": 64 << 20}
    srv = specforge_server
    producer = MooncakeFeatureStore(store_id="run1", setup_kwargs=setup)
    # SpecForge's eagle3 server-streaming layout (algorithms/eagle3/providers.py)
    schema = ServerCaptureSchema(aux_feature="hidden_state", last_hidden_feature="target",
                                 passthrough=(("input_ids", "input_ids", ()), ("loss_mask", "loss_mask", ())),
                                 attention_mask_feature="attention_mask")
    adapter = SGLangServerCaptureAdapter(srv.url, producer, run_id="run1", algorithm="eagle3", schema=schema)
    # SpecForge's default aux ids for 8 layers, [1, L//2-1, L-4], in its own numbering.
    capture = CaptureConfig.from_strategy({"hidden_state", "target", "input_ids", "loss_mask", "attention_mask"},
                                          (1, 3, 4), target_repr="hidden_state", target_hidden_size=64)
    tasks = [PromptTask(task_id=f"t{i}", run_id="run1", source_id=f"s{i}",
                        payload={"input_ids": ids[i], "loss_mask": masks[i]}, max_length=4096)
             for i in range(len(ids))]
    # One prompt per call, as the reference was exported: the same rows bit for bit.
    refs = [adapter.produce_refs([t], capture=capture)[0] for t in tasks]
    assert [type(r).__name__ for r in refs] == ["SampleRef"] * len(ids), refs
    # SpecForge's own batches (one /generate, several prompts): within bf16's batching noise.
    batch = adapter.produce_refs([dataclasses.replace(t, task_id=f"b{i}") for i, t in enumerate(tasks[:3])],
                                 capture=capture)

    consumer = MooncakeFeatureStore(store_id="run1", setup_kwargs=setup)
    for i, ref in enumerate(refs + batch):
        got, handle = consumer.get(ref)
        aux, final = reference[i % len(ids)]
        T = aux.shape[0]
        want_aux, want_target = aux.reshape(1, T, -1).to(torch.bfloat16), final[None].to(torch.bfloat16)
        if i < len(refs):
            assert torch.equal(got["hidden_state"], want_aux) and torch.equal(got["target"], want_target)
        else:
            torch.testing.assert_close(got["hidden_state"], want_aux, atol=0.05, rtol=0.05)
            torch.testing.assert_close(got["target"], want_target, atol=0.05, rtol=0.05)
        assert got["input_ids"][0].tolist() == ids[i % len(ids)] and got["loss_mask"][0].tolist() == masks[i % len(ids)]
        assert got["attention_mask"].tolist() == [[1] * T]
        consumer.release(handle)
    consumer.drain_pending_removals()
    left = [f"run1/{r.sample_id}/g1/{n}" for r in refs + batch for n in r.feature_specs]
    assert [k for k in left if consumer._store.is_exist(k) == 1] == []  # the consumer freed every object

    # A server whose aux layers differ from what SpecForge asks for is refused by SpecForge's
    # own check, loudly, never trained on.
    other = CaptureConfig.from_strategy({"hidden_state", "target"}, (1, 3, 5), target_repr="hidden_state",
                                        target_hidden_size=64)
    bad = adapter.produce_refs([PromptTask(task_id="t-bad", run_id="run1", source_id="x",
                                           payload={"input_ids": ids[0], "loss_mask": masks[0]},
                                           max_length=4096)], capture=other)
    assert type(bad[0]).__name__ == "ServerCaptureFailure" and "aux-layer id mismatch" in bad[0].reason

    # Requests without spec_capture are served and not exported on this server.
    r = srv.generate({"input_ids": ids[0], "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200 and "hidden_states_export" not in r.json()["meta_info"]


def test_speculators_reads_its_index_while_the_capture_fills_it(trainers, work, index, directory_server, tmp_path):
    """Train while capturing: `convert --to speculators --follow` writes each captured sample
    into the index as its row's file; speculators' reader (on_missing=skip, as its trainer
    runs on a growing folder) skips rows not captured yet and reads each captured one, equal to
    what `convert` writes from the finished export. The follow exits by itself once every row
    has its states. (The export also holds the reference's samples, rids of no record: the
    follow passes them by.)"""
    import shutil
    import sys

    from safetensors.torch import load_file
    from speculators.train.data import ArrowDataset

    from sglang_hs.tools.capture import CaptureConfig, capture
    from sglang_hs.tools.convert import to_speculators

    dest = str(tmp_path / "index")
    shutil.copytree(index[0], dest)
    data = str(work / "records.jsonl")
    srv = directory_server
    out = srv.export_dir
    follow = subprocess.Popen([sys.executable, "-m", "sglang_hs.tools.cli", "convert", "--to", "speculators",
                               "--follow", out, dest], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        half = ROWS // 2
        assert capture(CaptureConfig([srv.url], data, out, limit=half, progress=False)).failed == 0
        ds = ArrowDataset(max_len=4096, datapath=dest, on_missing="skip", hidden_states_dtype=torch.float32)
        hs = [os.path.join(dest, "hidden_states", f"hs_{i}.safetensors") for i in range(ROWS)]
        deadline = time.monotonic() + 120
        while not all(os.path.exists(p) for p in hs[:half]) and time.monotonic() < deadline:
            time.sleep(0.2)
        early = [ds[i] for i in range(ROWS)]
        assert capture(CaptureConfig([srv.url], data, out, progress=False)).failed == 0
        said, _ = follow.communicate(timeout=120)
    finally:
        follow.kill()
    assert follow.returncode == 0, said
    assert f"{ROWS}/{ROWS} rows" in said.splitlines()[-1], said
    assert [isinstance(x, dict) for x in early] == [True] * half + [False] * (ROWS - half), early
    to_speculators(out, str(tmp_path / "offline"))  # capture's ids first: dataset order
    for i in range(ROWS):
        got, want = load_file(hs[i]), load_file(str(tmp_path / "offline" / "hidden_states" / f"hs_{i}.safetensors"))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
        item = ds[i]
        assert item["input_ids"].tolist() == index[1][i]
        if i < half:
            assert all(torch.equal(early[i][k], item[k]) for k in item)
    assert not [n for n in os.listdir(os.path.join(dest, "hidden_states")) if not n.startswith("hs_")]


@pytest.mark.core  # the generate_request seam's spec_capture on every release of the window
def test_specforge_trains_online_from_a_live_server(trainers, tiny_path, work, index, master, specforge_server,
                                                   tmp_path):
    """SpecForge's whole disaggregated online mode, unmodified: `sglang-hs index --to
    specforge` writes its prompts, draft config, vocabulary mapping and run config; its
    producer role sends every prompt to the live server (`spec_capture`), which writes each
    sample into Mooncake; its consumer role trains on them. On CPU each role runs in its own
    process as `specforge train -c ... --role R` (its launcher's per-role form), so the CPU
    shim F1 applies in both; `fsdp_sharding=NO_SHARD` because FSDP needs an accelerator."""
    from sglang_hs.tools.online import SpecForgeOnline, specforge_index

    srv = specforge_server
    dest = str(tmp_path / "sf")
    rep = specforge_index(str(work / "records.jsonl"), tiny_path, dest, SpecForgeOnline([srv.url], master.address))
    assert rep.rows == ROWS and rep.train == f"specforge train -c {dest}/specforge.yaml"
    over = ["training.fsdp_sharding=NO_SHARD", "training.log_interval=1", "training.max_steps=3",
            "training.num_epochs=1", "data.dataloader_num_workers=0", f"data.cache_dir={tmp_path / 'cache'}"]
    procs = {}
    for role in ("producer", "consumer"):
        with open(tmp_path / f"{role}.log", "w") as log:
            procs[role] = subprocess.Popen(specforge_cmd("train", "-c", f"{dest}/specforge.yaml", "--role", role,
                                                         *over), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300  # both roles finish in about a minute on 2 cores
    try:
        for p in procs.values():
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass  # the assertion below shows both roles' logs
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    logs = {r: open(tmp_path / f"{r}.log").read() for r in procs}
    assert [p.returncode for p in procs.values()] == [0, 0], {r: t[-3000:] for r, t in logs.items()}
    assert f"produced={ROWS} prompts_failed=0" in logs["producer"], logs["producer"][-3000:]
    steps = specforge_steps(logs["consumer"])
    assert len(steps) == 3 and all(math.isfinite(s["loss"]) for s in steps), logs["consumer"][-3000:]
