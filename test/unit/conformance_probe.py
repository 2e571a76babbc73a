"""Run in a subprocess with the CPU environment: loads plugins the way SGLang does and
reports, for every seam, whether its target resolved, whether our hook is applied, and the
upstream facts the hooks rely on. test_seams.py asserts on the JSON this prints."""

import dataclasses
import importlib
import inspect
import json
import os
import pkgutil
import types

from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry

from sglang_hs.overlay import seams

# A scheduler of a CPU server with export on registers every seam (seams.active); once
# applied, the hooks pass through here (no export configured).
os.environ[seams.ENV_CONFIG] = "{}"
os.environ[seams.ENV_CPU] = "1"
load_plugins()  # discovers sglang_hs through its entry point, like every SGLang process
del os.environ[seams.ENV_CONFIG], os.environ[seams.ENV_CPU]

out = {"seams": {}, "facts": {}}
for s in seams.SEAMS:
    obj_path, attr = s.target.rsplit(".", 1)
    obj = pkgutil.resolve_name(obj_path)
    raw = obj.__dict__.get(attr) if isinstance(obj, type) else getattr(obj, attr)
    fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    orig = getattr(fn, "__wrapped__", None)
    closure = [c.cell_contents for c in (fn.__closure__ or [])]
    out["seams"][s.target] = {
        "patched": s.target in HookRegistry._patched,
        "our_hook": s.fn in closure,
        "params": list(inspect.signature(orig or fn).parameters),
    }

from sglang.srt.managers.io_struct import GenerateReqInput  # noqa: E402
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402
from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM  # noqa: E402
from sglang.srt.models.llama import LlamaForCausalLM  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
import sglang.srt.constants as constants  # noqa: E402


def eagle3_ids(cls, ids, layers=30):
    me = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=True),
                               config=types.SimpleNamespace(num_hidden_layers=layers),
                               model=types.SimpleNamespace())
    cls.set_eagle3_layers_to_capture(me, ids)
    return me.model.layers_to_capture


f = out["facts"]
f["schedule_batch_fields"] = [x.name for x in dataclasses.fields(ScheduleBatch)]
# Where ranks come from (sglang_hs.overlay.releases.parallel_ranks): ModelRunner.ps up to
# 0.5.20, runtime_context.get_parallel() after.
try:
    from sglang.srt.distributed.parallel_state_wrapper import ParallelState

    f["parallel_state_fields"] = [x.name for x in dataclasses.fields(ParallelState)]
except ImportError:
    f["parallel_state_fields"] = None
import sglang.srt.runtime_context as runtime_context  # noqa: E402

f["parallel_context_fields"] = sorted(runtime_context._parallel_fields() if hasattr(runtime_context, "_parallel_fields")
                                      else runtime_context._PARALLEL_FIELDS)
# Every launcher flag's ServerArgs field (the row-breaking flags exist from their release on).
import argparse  # noqa: E402

from sglang.srt.server_args import ServerArgs  # noqa: E402

_parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(_parser)
f["server_args_dests"] = sorted({a.dest for a in _parser._actions})
from sglang.srt.arg_groups.overrides import resolved_view  # noqa: E402,F401  (releases.resolved)

f["sglang_version"] = __import__("sglang").__version__
f["req_init_source"] = inspect.getsource(Req.__init__)
f["model_runner_init_source"] = inspect.getsource(ModelRunner.__init__) + inspect.getsource(ModelRunner)
f["generate_req_fields"] = [x.name for x in dataclasses.fields(GenerateReqInput)]
from sglang.srt.managers.utils import GenerationBatchResult  # noqa: E402

f["generation_batch_result_fields"] = [x.name for x in dataclasses.fields(GenerationBatchResult)]
f["logits_metadata_fields"] = [x.name for x in dataclasses.fields(
    __import__("sglang.srt.layers.logits_processor", fromlist=["LogitsMetadata"]).LogitsMetadata)]
# Our request options ride in SamplingParams.custom_params: it must accept and keep a dict.
f["custom_params_round_trip"] = SamplingParams(custom_params={"sglang_hs": {"export": False}}).custom_params
f["health_prefix"] = constants.HEALTH_CHECK_RID_PREFIX


def normalised(**kw):
    """What admission reads after SGLang's own normalisation of a /generate call."""
    g = GenerateReqInput(**kw)
    g.normalize_batch_and_arguments()
    return {"is_single": g.is_single, "rid": g.rid if g.is_single else list(g.rid), "n": g.parallel_sample_num,
            "params": [id(p) for p in g.sampling_params] if isinstance(g.sampling_params, list) else "dict",
            "input_embeds": g.input_embeds}


f["normalised"] = {
    "single": normalised(input_ids=[1, 2], rid="a"),
    "batch_shared_params": normalised(input_ids=[[1, 2], [3, 4]], sampling_params={"max_new_tokens": 1}),
    "batch_one_rid": normalised(text=["x", "y"], rid="r"),
    "n2": normalised(input_ids=[1, 2], sampling_params={"n": 2}),
}
f["llama_default"] = eagle3_ids(LlamaForCausalLM, None)
f["llama_explicit_1_14_26"] = eagle3_ids(LlamaForCausalLM, [1, 14, 26])
f["deepseek_explicit_1_14_26"] = eagle3_ids(DeepseekV2ForCausalLM, [1, 14, 26])
f["deepseek_explicit_2_15_27"] = eagle3_ids(DeepseekV2ForCausalLM, [2, 15, 27])
from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry  # noqa: E402

f["mla_routing"] = {b: AttentionBackendRegistry.get_handler(b)(None, None).name if b == "torch_native"
                    else AttentionBackendRegistry.get_handler(b).__module__ for b in ("torch_native", "triton")}

# What each family's decoder-stack loop reads (sglang_hs.overlay.aux_layers.loop_reads), for the
# stacks of the families the README lists as tested.
from sglang_hs.overlay.aux_layers import loop_reads  # noqa: E402

STACKS = {
    "llama.LlamaModel", "qwen2.Qwen2Model", "qwen3.Qwen3Model", "qwen2_moe.Qwen2MoeModel",
    "qwen3_moe.Qwen3MoeModel", "deepseek_v2.DeepseekV2Model", "gemma3_causal.Gemma3TextModel",
    "bailing_moe.BailingMoEModel", "gpt_oss.GptOssModel",
    "qwen3_next.Qwen3NextModel", "glm4_moe.Glm4MoeModel", "mellum.MellumModel", "minimax_m3.MiniMaxM3Model",
}
f["loop_reads"] = {}
for name in sorted(STACKS):
    mod, cls = name.split(".")
    try:
        f["loop_reads"][name] = sorted(loop_reads(getattr(importlib.import_module(f"sglang.srt.models.{mod}"), cls)))
    except (ImportError, AttributeError) as e:
        f["loop_reads"][name] = f"error: {e}"

# Every model class of this release with an EAGLE-3 setter: from the registry, plus (by
# reading the source) the modules that cannot be imported in CPU mode.
import ast  # noqa: E402
import os  # noqa: E402

from sglang.srt.models.registry import ModelRegistry  # noqa: E402

families = {n for n, c in ModelRegistry.models.items() if hasattr(c, "set_eagle3_layers_to_capture")}
import sglang.srt.models as models_pkg  # noqa: E402

models_dir = list(models_pkg.__path__)[0]  # a namespace package: no __file__

defs = {}  # class name -> (base names, defines the setter), over every model module
entry = set()
for fn in sorted(os.listdir(models_dir)):
    if not fn.endswith(".py"):
        continue
    tree = ast.parse(open(os.path.join(models_dir, fn), encoding="utf-8-sig").read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
            has = any(isinstance(x, ast.FunctionDef) and x.name == "set_eagle3_layers_to_capture" for x in node.body)
            defs.setdefault(node.name, (bases, has))
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "EntryClass" for t in node.targets):
            vals = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            entry |= {v.id for v in vals if isinstance(v, ast.Name)}


def has_setter(name, depth=0):
    bases, has = defs.get(name, ([], False))
    return has or (depth < 10 and any(has_setter(b, depth + 1) for b in bases))


f["eagle3_classes"] = sorted(families | {c for c in entry if c not in ModelRegistry.models and has_setter(c)})
print("PROBE_JSON " + json.dumps(f | {"seams": out["seams"]}))
