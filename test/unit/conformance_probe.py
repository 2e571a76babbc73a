"""Run in a subprocess with the CPU environment: loads plugins the way SGLang does and
reports, for every seam, whether its target resolved, whether our hook is applied, and the
upstream facts the hooks rely on. test_seams.py asserts on the JSON this prints."""

import dataclasses
import inspect
import json
import pkgutil
import types

from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry

load_plugins()  # discovers sglang_hs through its entry point, like every SGLang process

from sglang_hs import seams  # noqa: E402

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

from sglang.srt.distributed.parallel_state_wrapper import ParallelState  # noqa: E402
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
f["parallel_state_fields"] = [x.name for x in dataclasses.fields(ParallelState)]
f["req_init_source"] = inspect.getsource(Req.__init__)
f["model_runner_init_source"] = inspect.getsource(ModelRunner.__init__) + inspect.getsource(ModelRunner)
f["generate_req_fields"] = [x.name for x in dataclasses.fields(GenerateReqInput)]
# Our request options ride in SamplingParams.custom_params: it must accept and keep a dict.
f["custom_params_round_trip"] = SamplingParams(custom_params={"sglang_hs": {"export": False}}).custom_params
f["health_prefix"] = constants.HEALTH_CHECK_RID_PREFIX
f["llama_default"] = eagle3_ids(LlamaForCausalLM, None)
f["llama_explicit_1_14_26"] = eagle3_ids(LlamaForCausalLM, [1, 14, 26])
f["deepseek_explicit_1_14_26"] = eagle3_ids(DeepseekV2ForCausalLM, [1, 14, 26])
f["deepseek_explicit_2_15_27"] = eagle3_ids(DeepseekV2ForCausalLM, [2, 15, 27])
from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry  # noqa: E402

f["mla_routing"] = {b: AttentionBackendRegistry.get_handler(b)(None, None).name if b == "torch_native"
                    else AttentionBackendRegistry.get_handler(b).__module__ for b in ("torch_native", "triton")}
print("PROBE_JSON " + json.dumps(f | {"seams": out["seams"]}))
