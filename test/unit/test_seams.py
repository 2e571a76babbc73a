"""Conformance of every seam with the installed SGLang release (any of the window): each
target resolves, our hook is the one applied there, and the upstream facts the hooks rely on
hold, on the side of each release difference (sglang_hs.overlay.releases) this release is on. A renamed or
re-signatured upstream function fails here instead of silently exporting nothing."""

import ast
import json
import os
import re
import subprocess
import sys

import pytest

from sglang_hs.tools.serve import cpu_env

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def probe():
    r = subprocess.run([sys.executable, os.path.join(HERE, "conformance_probe.py")], env=cpu_env(),
                       capture_output=True, text=True, timeout=600)
    line = [x for x in r.stdout.splitlines() if x.startswith("PROBE_JSON ")]
    assert r.returncode == 0 and line, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(line[0][len("PROBE_JSON "):])


EXPECTED_PARAMS = {
    "sglang.srt.server_args.ServerArgs.add_cli_args": ["parser"],
    "sglang.srt.server_args.ServerArgs.from_cli_args": ["cls", "args"],
    "sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backends": ["self"],
    "sglang.srt.managers.schedule_batch.Req._compute_max_prefix_len": ["self", "input_len"],
    "sglang.srt.managers.schedule_batch.Req.update_finish_state": ["self", "new_accepted_len"],
    "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation": ["self", "batch", "forward_batch"],
    "sglang.srt.layers.logits_processor.LogitsProcessor.forward":
        ["self", "input_ids", "hidden_states", "lm_head", "logits_metadata", "aux_hidden_states"],
    "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request": ["self", "obj", "request"],
    "sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments": ["self"],
    "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion._build_completion_response":
        ["self", "request", "ret", "created"],
    "sglang.srt.managers.scheduler.Scheduler.release_host_resources": ["self"],
    "sglang.srt.models.deepseek_common.attention_backend_handler.AttentionBackendRegistry.get_handler":
        ["cls", "backend_name"],
    "sglang.srt.models.qwen2_moe.fused_gate_sigmoid_mul_add":
        ["hidden_states", "gate_weight", "shared_output", "final_hidden_states"],
    "sglang.srt.distributed.parallel_state.GroupCoordinator.__init__":
        ["self", "group_ranks", "local_rank", "torch_distributed_backend", "use_pynccl"],
}


def test_every_seam_is_listed_here_and_in_fork_notes():
    """FORK_NOTES' seam table is the ledger: one row per registered seam, in registration
    order, naming its function, target, hook type and when it is registered."""
    from sglang_hs.overlay.seams import SEAMS

    assert sorted(s.target for s in SEAMS) == sorted(EXPECTED_PARAMS)
    notes = open(os.path.join(HERE, "..", "..", "FORK_NOTES.md")).read()
    rows = re.findall(r"^\| `(\w+)` \| `([\w.]+)` \| (\w+) \| (\w+) \| .+ \| .+ \|$", notes, re.M)
    assert rows == [(s.fn.__name__, s.target, s.hook_type.name, s.when) for s in SEAMS]


UPSTREAM_READERS = {os.path.join("overlay", "seams.py"), os.path.join("overlay", "releases.py")}


def test_only_seams_and_releases_import_sglang_internals():
    """The overlay's logic and the tools take plain values; only the hook module and the
    release adapters touch sglang.srt, so everything else is unit-tested without SGLang's
    processes."""
    pkg = os.path.join(HERE, "..", "..", "python", "sglang_hs")
    offenders = []
    for root, _, files in os.walk(pkg):
        for name in files:
            path = os.path.join(root, name)
            if not name.endswith(".py") or os.path.relpath(path, pkg) in UPSTREAM_READERS:
                continue
            for node in ast.walk(ast.parse(open(path).read())):
                mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                        else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                offenders += [f"{os.path.relpath(path, pkg)}: {m}" for m in mods if m.startswith("sglang.srt")]
    assert not offenders


def test_the_wheel_holds_the_two_sides_and_not_the_dev_harness():
    pkg = os.path.join(HERE, "..", "..", "python", "sglang_hs")
    assert sorted(n for n in os.listdir(pkg) if not n.startswith("__")) == [
        "data", "format.py", "layouts.py", "overlay", "protocol.py", "tools"]
    import harness

    assert "python" not in harness.__file__.split(os.sep)


def test_unit_test_files_mirror_the_modules_they_test():
    pkg = os.path.join(HERE, "..", "..", "python", "sglang_hs")
    modules = {os.path.splitext(n)[0] for _, _, files in os.walk(pkg) for n in files if n.endswith(".py")}
    tests = {n[len("test_"):-len(".py")] for n in os.listdir(HERE) if n.startswith("test_") and n.endswith(".py")}
    assert tests <= modules, f"unit tests named after no module: {sorted(tests - modules)}"


def test_admission_reads_sglang_normalised_requests(probe):
    """What seams.admit_generate_request hands to admission.admit: after normalisation every
    rid is filled in and sampling params are one dict per entry (a shared dict repeated)."""
    n = probe["normalised"]
    assert n["single"] == {"is_single": True, "rid": "a", "n": 1, "params": "dict", "input_embeds": None}
    b = n["batch_shared_params"]
    assert not b["is_single"] and len(b["rid"]) == 2 and all(b["rid"]) and len(set(b["params"])) == 1
    assert len(b["params"]) == 2
    assert n["batch_one_rid"]["rid"] == ["r_0", "r_1"]
    from sglang_hs.overlay.releases import BY_NAME

    n_rids = 2 if BY_NAME["single_prompt_n_rids"].applies(probe["sglang_version"]) else 1
    assert not n["n2"]["is_single"] and len(n["n2"]["rid"]) == n_rids and len(n["n2"]["params"]) == 2


@pytest.mark.parametrize("target", sorted(EXPECTED_PARAMS))
def test_seam_target_resolves_and_our_hook_is_applied(probe, target):
    s = probe["seams"][target]
    assert s["patched"], f"HookRegistry did not apply {target}"
    assert s["our_hook"], f"the function at {target} is not wrapped by sglang-hs' hook"
    want = EXPECTED_PARAMS[target]
    assert s["params"][: len(want)] == want, f"{target} signature changed upstream: {s['params']}"


def test_upstream_facts_the_hooks_rely_on(probe):
    for field in ("reqs", "prefix_lens", "extend_lens", "forward_mode", "seq_lens_cpu"):
        assert field in probe["schedule_batch_fields"]
    for attr in ("self.origin_input_ids", "self.output_ids", "self.finished_reason", "self.to_finish",
                 "self.sampling_params", "self.rid"):
        assert attr in probe["req_init_source"]
    # Decode rows: which forward replayed a CUDA graph, and the LogitsProcessor's forward mode.
    assert "can_run_cuda_graph" in probe["generation_batch_result_fields"]
    assert "forward_mode" in probe["logits_metadata_fields"]
    for attr in ("self.is_draft_worker", "self.model_config", "self.server_args", "self.dtype"):
        assert attr in probe["model_runner_init_source"]
    for field in ("rid", "sampling_params", "input_embeds"):
        assert field in probe["generate_req_fields"]
    assert probe["custom_params_round_trip"] == {"sglang_hs": {"export": False}}
    assert probe["health_prefix"] == "HEALTH_CHECK"


def test_layer_id_mapping_of_upstream_families(probe):
    """What FORK_NOTES.md documents: upstream's loop index i records the input of layer i
    (HF output_hidden_states[i]); explicit ids get +1 on Llama, and on DeepseekV2 only when
    the first id is 1; the default is [2, L//2, L-3] unshifted."""
    assert probe["llama_default"] == [2, 15, 27]
    assert probe["llama_explicit_1_14_26"] == [2, 15, 27]
    assert probe["deepseek_explicit_1_14_26"] == [2, 15, 27]
    assert probe["deepseek_explicit_2_15_27"] == [2, 15, 27]


def test_mla_routing_sends_torch_native_to_mla_and_leaves_other_backends_alone(probe):
    assert probe["mla_routing"]["torch_native"] == "MLA"
    assert probe["mla_routing"]["triton"].startswith("sglang.srt."), "triton's own routing must stay"


def test_loop_reads_of_upstream_stacks(probe):
    """Which capture state each decoder stack's loop reads (sglang_hs.overlay.aux_layers sets our ids
    there): a family switching between the list and the flags fails here."""
    flags, both, lst = ["_is_layer_to_capture"], ["_is_layer_to_capture", "layers_to_capture"], ["layers_to_capture"]
    assert probe["loop_reads"] == {
        "bailing_moe.BailingMoEModel": both, "deepseek_v2.DeepseekV2Model": lst,
        "gemma3_causal.Gemma3TextModel": lst, "glm4_moe.Glm4MoeModel": lst, "gpt_oss.GptOssModel": lst,
        "llama.LlamaModel": lst, "mellum.MellumModel": flags, "minimax_m3.MiniMaxM3Model": flags,
        "qwen2.Qwen2Model": lst, "qwen2_moe.Qwen2MoeModel": flags, "qwen3.Qwen3Model": lst,
        "qwen3_moe.Qwen3MoeModel": flags, "qwen3_next.Qwen3NextModel": flags,
    }


def readme_family_table():
    readme = open(os.path.join(HERE, "..", "..", "README.md")).read()
    body = readme.split("<!-- family-table -->")[1].split("<!-- /family-table -->")[0]
    rows, since = {}, {}
    for line in body.strip().splitlines()[2:]:
        cls, first, status, note = (c.strip() for c in line.strip("|").split("|"))
        rows[cls.strip("`")] = (status, note)
        since[cls.strip("`")] = first
    return rows, since


def test_readme_family_table_lists_every_class_with_an_eagle3_setter(probe):
    """The table covers the whole window: every class of the installed release, with the
    release it first appeared in; the classes it dates after this release are the only
    ones missing here (none is ever dropped upstream in the window)."""
    from sglang_hs.overlay.aux_layers import DRAFT_SUFFIXES, REFUSED, REFUSED_STACKS, TESTED
    from sglang_hs.overlay.releases import in_window, version_tuple

    rows, since = readme_family_table()
    assert all(in_window(v) for v in since.values())
    here = version_tuple(probe["sglang_version"])[:3]
    assert sorted(c for c, v in since.items() if version_tuple(v) <= here) == sorted(probe["eagle3_classes"])
    assert {c for c, (st, _) in rows.items() if st == "tested"} == set(TESTED)
    for c, where in TESTED.items():
        assert f"on {where}" in rows[c][1], f"{c}: the note must say where it was tested ({where})"
    assert {st for st, _ in rows.values()} <= {"tested", "refused", "untested"}
    by_name = {c for c in rows if c in REFUSED or c.endswith(DRAFT_SUFFIXES)}
    refused = {c for c, (st, _) in rows.items() if st == "refused"}
    assert by_name <= refused
    for c in refused - by_name:  # refused for their decoder stack: the note names it
        assert any(stack in rows[c][1] for stack in REFUSED_STACKS), c


def test_ranks_come_from_where_this_release_keeps_them(probe):
    """releases.parallel_ranks reads ModelRunner.ps before 0.5.21 and get_parallel() from
    it on: the installed release must have the names on the side its version says."""
    import dataclasses

    from sglang_hs.overlay.releases import BY_NAME, Ranks

    names = {f.name for f in dataclasses.fields(Ranks)}
    if BY_NAME["parallel_ranks"].applies(probe["sglang_version"]):
        assert probe["parallel_state_fields"] is None
        assert "self.ps" not in probe["model_runner_init_source"]
        assert names <= set(probe["parallel_context_fields"])
    else:
        assert names <= set(probe["parallel_state_fields"])
        assert "self.ps" in probe["model_runner_init_source"]


def test_row_breaking_flags_exist_from_the_release_their_difference_names(probe):
    """Each refused flag is a launcher flag exactly from its release on (so the refusal is
    live where the flag exists, and the table's release is right)."""
    from sglang_hs.overlay.releases import BY_NAME, ROW_BREAKING_FLAGS

    for field, (diff, _) in ROW_BREAKING_FLAGS.items():
        assert (field in probe["server_args_dests"]) == BY_NAME[diff].applies(probe["sglang_version"]), field
