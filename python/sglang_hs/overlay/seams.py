"""Every place sglang-hs touches SGLang internals (SGLang 0.5.17 to 0.5.23).

One function per upstream target. Each docstring says: the target, why we hook it, what an
upstream PR would do instead, and when to remove the seam. FORK_NOTES.md is the same ledger
for readers; test/unit/test_seams.py resolves every target in the installed SGLang and proves
each hook is applied (HookRegistry only logs a hook that fails to apply). What differs
between the releases of the window is read through the adapters in releases.py, never by
testing a version here.

`register()` is the plugin entry point (group `sglang.srt.plugins`): SGLang calls it in every
process (launcher, HTTP/tokenizer process, each scheduler) before it builds anything. Each seam
says when it is registered (`Seam.when`), so a server started without our flag runs stock
SGLang on every hot path:
- LAUNCH: always; the two that add and check our flags in the launcher.
- EXPORT: only in a server started with `--export-hidden-states-dir`. The launcher registers
  them once `from_cli_args` has accepted the flag (its HTTP side runs there); the schedulers,
  spawned later, inherit the resolved config (`ENV_CONFIG`) and register them at start.
- CPU: only in CPU mode (`--device cpu`, told to the schedulers by `ENV_CPU`): the three that
  turn an upstream crash on CPU into a working server (MLA routing for torch_native, Qwen2-MoE's
  shared-expert gate, gloo process groups without PyNccl), export flag or not.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import uuid
from typing import Callable, List, NamedTuple, Optional

import torch
from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType

from sglang_hs.overlay import releases
from sglang_hs.overlay.config import ExportConfig, ExportConfigError, add_flags

logger = logging.getLogger("sglang_hs")

# The resolved config travels to every SGLang process through the environment: scheduler
# and detokenizer processes inherit it, whatever way ServerArgs reaches them.
ENV_CONFIG = "SGLANG_HS_EXPORT_CONFIG"
# Set by the launcher for a server in CPU mode: its schedulers register the CPU seams.
ENV_CPU = "SGLANG_HS_CPU_MODE"

LAUNCH, EXPORT, CPU = "launch", "export", "cpu"


class Seam(NamedTuple):
    target: str
    hook_type: HookType
    fn: Callable
    when: str  # LAUNCH, EXPORT or CPU (the module docstring)


SEAMS: List[Seam] = []


def seam(target: str, hook_type: HookType, when: str = EXPORT):
    def deco(fn):
        SEAMS.append(Seam(target, hook_type, fn, when))
        return fn

    return deco


def active(env) -> List[Seam]:
    """The seams a process with this environment registers."""
    on = {LAUNCH} | ({EXPORT} if env.get(ENV_CONFIG) else set()) | ({CPU} if env.get(ENV_CPU) else set())
    return [s for s in SEAMS if s.when in on]


def register() -> None:
    """Plugin entry point: register the seams this process needs with SGLang's HookRegistry
    (SGLang applies them once every plugin has registered)."""
    _register(active(os.environ))


def _register(seams: List[Seam]) -> None:
    for s in seams:
        HookRegistry.register(s.target, s.fn, s.hook_type, source=_SOURCE)


# What HookRegistry's log lines name as the hooks' origin (our entry point and distribution),
# also for the seams the launcher registers after plugin loading.
_SOURCE = HookSource(plugin_name="sglang_hs", dist_name="sglang-hs")


def config() -> Optional[ExportConfig]:
    raw = os.environ.get(ENV_CONFIG)
    return _parse_config(raw) if raw else None


@functools.lru_cache(maxsize=4)
def _parse_config(raw: str) -> ExportConfig:
    """Parsed once per value: the HTTP hook asks for the config on every request."""
    d = json.loads(raw)
    if d.get("aux_layer_ids") is not None:
        d["aux_layer_ids"] = tuple(d["aux_layer_ids"])
    return ExportConfig(**d)


# --------------------------------------------------------------------------------------
# Command line and start-up checks (launcher process)
# --------------------------------------------------------------------------------------


_parser_defaults: dict = {}


@seam("sglang.srt.server_args.ServerArgs.add_cli_args", HookType.AFTER, LAUNCH)
def add_cli_args(result, parser):
    """Target: ServerArgs.add_cli_args (staticmethod building the launcher's argparse parser).

    Why: our flags must appear in `python -m sglang.launch_server --help` and parse with the
    stock launcher. Upstream PR: a plugin hook for extra CLI argument groups (or the flags
    as ServerArgs fields). Remove when upstream has either.
    """
    _parser_defaults.update({a.dest: a.default for a in parser._actions})  # for a platform preset
    add_flags(parser)


@seam("sglang.srt.server_args.ServerArgs.from_cli_args", HookType.AROUND, LAUNCH)
def from_cli_args(original, cls, args):
    """Target: ServerArgs.from_cli_args (classmethod, argparse Namespace -> ServerArgs).

    Why: the one place where our parsed flags and the resolved ServerArgs meet, before any
    process is spawned or weights are read, so bad settings fail in a second with a clear
    message. Upstream PR: ServerArgs fields plus a validation hook. Remove with that PR.
    """
    from sglang_hs.overlay import startup

    try:
        if getattr(args, "platform_preset", None):
            startup.apply_platform_preset(args, _parser_defaults)
        else:  # not one inherited from another launch: export.json names only this launch's preset
            os.environ.pop(startup.ENV_PRESET, None)
    except ExportConfigError as e:
        raise SystemExit(f"sglang-hs: error: {e}") from None
    server_args = original(cls, args)
    if releases.resolved(server_args).device == "cpu":
        os.environ[ENV_CPU] = "1"
    else:
        os.environ.pop(ENV_CPU, None)
    if getattr(args, "export_hidden_states_dir", None) is None:
        os.environ.pop(ENV_CONFIG, None)
        return server_args

    def num_layers():
        from sglang.srt.configs.model_config import ModelConfig

        mc = getattr(server_args, "model_config", None) or ModelConfig.from_server_args(server_args)
        return mc.num_hidden_layers

    server = startup.Server(
        model_path=server_args.model_path, pp_size=server_args.pp_size,
        speculative_algorithm=server_args.speculative_algorithm,
        tokenizer_worker_num=server_args.tokenizer_worker_num, nnodes=server_args.nnodes,
        row_breaking=releases.row_breaking_flags(server_args))
    try:
        cfg = startup.check_startup(args, server, num_layers)
    except ExportConfigError as e:
        raise SystemExit(f"sglang-hs: error: {e}") from None
    os.environ[ENV_CONFIG] = json.dumps(dataclasses.asdict(cfg))
    # This process serves HTTP: its export seams go on now (the schedulers register theirs at start).
    _register([s for s in SEAMS if s.when == EXPORT])
    HookRegistry.apply_hooks()  # skips the targets already patched
    logger.info("sglang-hs: exporting hidden states to %s (aux layers %s)", cfg.out_dir,
                list(cfg.aux_layer_ids) if cfg.aux_layer_ids else "model default")
    return server_args


# --------------------------------------------------------------------------------------
# Scheduler processes: row planning and staging
# --------------------------------------------------------------------------------------

_runtime = None  # sglang_hs.overlay.runtime.ExportRuntime in a scheduler process with export on
_checked = None  # runtime.sync_check() once the runtime exists: where the runtime's calls run


@seam("sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backends", HookType.AFTER)
def init_attention_backends(result, self):
    """Target: ModelRunner.init_attention_backends (runs after weights load and before any
    CUDA graph capture).

    Why: turn on the model's EAGLE-3 aux capture with no draft model at our HF ids and read
    back what will be captured (sglang_hs.overlay.aux_layers: any family, wrappers included), and build the writer
    on the one rank per data-parallel group that writes. Graphs captured afterwards then
    carry the aux outputs. Upstream PR: a "capture aux hidden states" server option that
    calls set_eagle3_layers_to_capture without a draft model. Remove with it.
    """
    global _runtime, _checked
    cfg = config()
    if cfg is None or self.is_draft_worker:
        return
    from sglang_hs.overlay import build
    from sglang_hs.overlay.aux_layers import set_aux_layers
    from sglang_hs.overlay.runtime import ExportRuntime, sync_check

    model = self.model
    arch = type(model).__name__
    num_layers = self.model_config.num_hidden_layers
    aux = set_aux_layers(model, cfg.aux_layer_ids, num_layers, cfg.allow_untested_model)
    ids = aux.layer_ids
    if not aux.tested:
        logger.warning("sglang-hs: exporting %s, which sglang-hs has not compared with Hugging Face "
                       "(--export-allow-untested-model); check the first samples with `sglang-hs verify DIR`", arch)
    ranks = releases.parallel_ranks(self)
    writer = None
    if build.is_writer_rank(ranks.attn_tp_rank, ranks.attn_cp_rank, ranks.pp_rank == ranks.pp_size - 1):
        writer = build.make_writer(cfg, _served(self, arch, num_layers), ids, ranks.writer_shard)
    _checked = sync_check()
    _runtime = ExportRuntime(ids, writer, rank=f"dp{ranks.attn_dp_rank}-tp{ranks.attn_tp_rank}")
    logger.info("sglang-hs: aux capture on %s layers %s (HF convention; %s reads %s), writer rank: %s",
                arch, list(ids), aux.path, "+".join(sorted(aux.reads)), writer is not None)
    if writer is not None:
        _drain_on_signals()


# Seconds a scheduler spends writing queued samples when it is told to stop.
DRAIN_TIMEOUT_S = 20.0


def _drain_on_signals() -> None:
    """A SIGTERM or SIGINT sent to the whole process group (Ctrl-C, `kill -TERM -PGID`,
    systemd) reaches the schedulers too, which would die with their queued samples: write
    those first, then die of the signal as before."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def on_signal(signum, frame):
        if _runtime is not None:
            _runtime.drain(DRAIN_TIMEOUT_S)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)


@seam("sglang.srt.managers.scheduler.Scheduler.release_host_resources", HookType.BEFORE)
def drain_on_shutdown(self, *args, **kwargs):
    """Target: Scheduler.release_host_resources (the scheduler's graceful exit, after the
    HTTP process drained its requests on SIGTERM and sent ShutdownReq).

    Why: the writer's queued samples would die with the process (its threads are daemons
    so that a stuck disk cannot hold an exit forever): write them first, within a bounded
    wait, and say how it went. Upstream PR: a plugin shutdown hook. Remove with it.
    """
    if _runtime is not None:
        _runtime.drain(DRAIN_TIMEOUT_S)
    return None


def _served(runner, arch: str, num_layers: int):
    """What this scheduler serves: the server args as resolved (what it runs with, not only
    what was typed) and the loaded model."""
    import sglang

    from sglang_hs.overlay.build import Served

    sa = releases.resolved(runner.server_args)
    return Served(
        model_path=sa.model_path, architecture=arch, hidden_size=runner.model_config.hidden_size,
        num_layers=num_layers, dtype=str(runner.dtype).replace("torch.", ""), device=sa.device,
        attention_backend=sa.attention_backend, tp_size=sa.tp_size, dp_size=sa.dp_size,
        sglang_version=sglang.__version__, tokenizer_path=sa.tokenizer_path, trust_remote_code=sa.trust_remote_code,
        quantization=sa.quantization, kv_cache_dtype=sa.kv_cache_dtype,
        disable_custom_all_reduce=sa.disable_custom_all_reduce, enable_torch_compile=sa.enable_torch_compile,
        disable_cuda_graph=sa.disable_cuda_graph)


def _state_of(req):
    """The request's export state, created on first sight and cached on the Req object."""
    st = req.__dict__.get("_sglang_hs", False)
    if st is False:
        from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        def aborted(req=req):
            return isinstance(req.finished_reason, FINISH_ABORT) or isinstance(req.to_finish, FINISH_ABORT)

        if str(req.rid).startswith(HEALTH_CHECK_RID_PREFIX):
            st = None
        else:
            st = _runtime.new_state(req.rid, req.origin_input_ids, req.sampling_params.custom_params, aborted)
        req._sglang_hs = st
    return st


@seam("sglang.srt.managers.schedule_batch.Req._compute_max_prefix_len", HookType.AFTER)
def compute_max_prefix_len(result, self, input_len):
    """Target: Req._compute_max_prefix_len (cap on how many prompt tokens may come from the
    prefix cache).

    Why: cached tokens never pass through the forward, so their hidden states would be
    missing. An exported request may reuse only what it has exported itself (nothing at
    first: a full recompute); other requests keep the cache. Upstream PR: a per-request
    "no prefix reuse" flag. Remove with it.
    """
    if _runtime is None:
        return None
    st = _state_of(self)
    if st is None:
        return None
    with _checked:
        return _runtime.prefix_cap(st, result)


@seam("sglang.srt.managers.schedule_batch.Req.update_finish_state", HookType.AFTER)
def update_finish_state(result, self, *args, **kwargs):
    """Target: Req.update_finish_state (the scheduler's stop check after each token it
    appends, prefill or decode, on every rank).

    Why: a sample with decode rows is complete when its request finishes: this is where
    output_ids is final and finished_reason (an abort included) is set. Upstream PR: a
    request-finished callback for plugins. Remove with it.
    """
    if _runtime is None or not self.finished():
        return None
    st = _state_of(self)
    if st is not None:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        with _checked:
            _runtime.finish(st, self.output_ids, isinstance(self.finished_reason, FINISH_ABORT))
    return None


@seam("sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation", HookType.AROUND)
def forward_batch_generation(original, self, batch=None, *args, **kwargs):
    """Target: TpModelWorker.forward_batch_generation (one forward of a ScheduleBatch).

    Why: the only place where the batch's requests (rid, prompt, prefix and extend lengths;
    in decode, sequence lengths) and the forward that computes their rows meet; its result
    says whether a CUDA graph ran. Upstream PR: a forward-output callback carrying
    per-request row spans. Remove with it.
    """
    rt = _runtime
    if rt is None or batch is None:
        return original(self, batch, *args, **kwargs)
    mode = batch.forward_mode
    with _checked:
        if mode.is_extend():
            planned = rt.begin_forward([_state_of(r) for r in batch.reqs], batch.prefix_lens, batch.extend_lens)
        elif mode.is_decode():
            # seq_lens_cpu is SGLang's host copy of the lengths: .tolist() reads host memory, no sync
            planned = rt.begin_decode([_state_of(r) for r in batch.reqs], batch.seq_lens_cpu.tolist())
        else:
            planned = False
    if not planned:
        return original(self, batch, *args, **kwargs)
    try:
        out = original(self, batch, *args, **kwargs)
    except BaseException:
        rt.abort_forward()
        raise
    with _checked:
        rt.end_forward(graph_ran=bool(getattr(out, "can_run_cuda_graph", False)))
    return out


@seam("sglang.srt.layers.logits_processor.LogitsProcessor.forward", HookType.AROUND)
def logits_forward(original, self, input_ids, hidden_states, lm_head, logits_metadata,
                   aux_hidden_states=None, *args, **kwargs):
    """Target: LogitsProcessor.forward (receives every row's post-norm final hidden state and
    the model's aux hidden states, before it prunes them to the last token).

    Why: the final state is post-norm here for every token, and the aux states arrive in
    the same call. While a decode CUDA graph is captured it records a copy of the rows into
    static buffers instead, which every replay refills (no Python runs in a replay).
    Upstream PR: return full-sequence (aux, final) states from the model forward when asked.
    Remove with it.
    """
    rt = _runtime
    if rt is not None:
        if not (hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()):
            with _checked:
                rt.stage(hidden_states, aux_hidden_states)
        elif logits_metadata.forward_mode.is_decode():
            rt.capture_decode_graph(hidden_states, aux_hidden_states)
    return original(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states,
                    *args, **kwargs)


@seam("sglang.srt.models.deepseek_common.attention_backend_handler.AttentionBackendRegistry.get_handler",
      HookType.AFTER, CPU)
def mla_attention_routing(result, cls, backend_name):
    """Target: AttentionBackendRegistry.get_handler (DeepSeek-family MLA models: picks, per
    attention backend, whether a forward takes the MHA or the MLA path).

    Why: torch_native (the CPU backend) has no entry, so it gets triton's routing, which sends
    a prefill without cached prefix down the MHA path; torch_native's MHA path cannot take
    MLA's unequal q/k and v head sizes and the first prefill crashes. Routing every forward to
    MLA makes DeepSeek V3 / Kimi K2 models run in CPU mode, where their export is tested.
    Other backends are untouched. Upstream PR: register a torch_native handler that always
    returns MLA. Remove with it.
    """
    if backend_name != "torch_native":
        return None
    return _always_mla


def _always_mla(attn, forward_batch):
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    return AttnForwardMethod.MLA


@seam("sglang.srt.distributed.parallel_state.GroupCoordinator.__init__", HookType.BEFORE, CPU)
def gloo_groups_without_pynccl(self, *args, **kwargs):
    """Target: GroupCoordinator.__init__ (one process group: its torch.distributed backend
    and whether it builds a PyNccl communicator).

    Why: upstream asks for PyNccl on every group but NPU/XPU/mooncake, CPU (gloo) groups
    included, so `--tp-size 2` in CPU mode dies in PyNcclCommunicator ("Expected a cuda
    device, but got: cpu"). A gloo group cannot use NCCL; without it, CPU all-reduce and
    all-gather already go through torch.distributed on gloo (upstream's shared-memory
    kernels need sgl-kernel's AMX build). This is what lets tensor parallelism run, and be
    tested, in CPU mode; groups on any other backend, and any machine with CUDA, are
    untouched. Upstream PR: default
    use_pynccl to False for gloo groups. Remove with it.
    """
    names = ("group_ranks", "local_rank", "torch_distributed_backend", "use_pynccl")
    bound = dict(zip(names, args), **kwargs)
    if (str(bound.get("torch_distributed_backend")) != "gloo" or not bound.get("use_pynccl")
            or torch.cuda.is_available()):
        return None
    if len(args) > 3:
        args = (*args[:3], False, *args[4:])
    else:
        kwargs["use_pynccl"] = False
    return (self, *args), kwargs


@seam("sglang.srt.models.qwen2_moe.fused_gate_sigmoid_mul_add", HookType.AROUND, CPU)
def qwen2_moe_shared_expert_gate(original, hidden_states, gate_weight, shared_output, final_hidden_states):
    """Target: qwen2_moe.fused_gate_sigmoid_mul_add (Qwen2-MoE's shared-expert gate, a
    triton kernel: final += sigmoid(hidden @ w) * shared, computed in fp32).

    Why: Qwen2-MoE's block calls it on every device but Intel AMX, so on a CPU without AMX
    the first forward dies in triton ("0 active drivers") and the family cannot be exported
    or tested on CPU. On CPU tensors we compute the same sum in torch, in fp32 as the kernel
    does; every other device runs the kernel. Upstream PR: a torch fallback in
    fused_gate_sigmoid_mul_add (or the block's own unfused path) for CPU. Remove with it.
    """
    if hidden_states.device.type != "cpu":
        return original(hidden_states, gate_weight, shared_output, final_hidden_states)
    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float())
    final_hidden_states.copy_(final_hidden_states.float() + gate[:, None] * shared_output.float())


# --------------------------------------------------------------------------------------
# HTTP process: request checks and "durable before 200"
# --------------------------------------------------------------------------------------

_waiter = None


def _http_waiter(cfg: ExportConfig):
    global _waiter
    if _waiter is None:
        from sglang_hs.overlay.notify import ExportWaiter

        _waiter = ExportWaiter(cfg.notify_addr, cfg.out_dir, cfg.write_timeout_s)
    return _waiter


@seam("sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments", HookType.AFTER)
def admit_generate_request(result, self):
    """Target: GenerateReqInput.normalize_batch_and_arguments (the first thing
    TokenizerManager.generate_request does with a /generate call: every rid filled in, one
    sampling-params dict per entry, batch size and n known).

    Why: admit the call on that normalised form (sglang_hs.overlay.admission): refuse unsafe,
    already-exported or in-flight rids and bad export options with HTTP 400/409/423 before
    any work, and tag each exported entry with this call's id, which its writer echoes.
    Upstream PR: a request-validation hook for plugins. Remove with it.
    """
    cfg = config()
    if cfg is None:
        return None
    from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

    from sglang_hs.overlay.admission import Policy, admit

    waiter = _http_waiter(cfg)
    rids = [self.rid] if self.is_single else list(self.rid)
    count = len(rids) * self.parallel_sample_num
    params = [self.sampling_params] * count if isinstance(self.sampling_params, dict) else list(self.sampling_params)
    adm = admit(rids, params, self.parallel_sample_num, self.input_embeds is not None, waiter.exported,
                uuid.uuid4().hex, skip_prefix=HEALTH_CHECK_RID_PREFIX,
                need_loss_mask=cfg.final_rows == "loss", sink=cfg.sink, in_flight=waiter.in_flight,
                policy=Policy(cfg.sample_rate, cfg.mode == "live"))
    # admit tags entries in place, and gives an entry of a shared dict its own copy in `params`
    self.sampling_params = params[0] if isinstance(self.sampling_params, dict) and len(set(map(id, params))) == 1 \
        else params
    waiter.admit(adm.rids)
    self._sglang_hs = adm
    return None


@seam("sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request", HookType.AROUND)
async def generate_request(original, self, obj, request=None):
    """Target: TokenizerManager.generate_request (async generator behind /generate and the
    OpenAI endpoints).

    Why: hold each exported request's final response until its sample is durable, adding
    meta_info["hidden_states_export"], or answer with the write's error for that request
    only; free the call's rids when it ends. First move a /generate body's `spec_capture`
    entries (SpecForge's field, which SGLang's request type drops) into each entry's export
    options, where admission takes them (or refuses them on a server of another sink). Upstream PR: request and response hooks for
    plugins. Remove with it.
    """
    cfg = config()
    if cfg is None:
        async for out in original(self, obj, request):
            yield out
        return
    from sglang_hs.overlay.admission import check_input_ids, hold_until_durable, take_spec_capture

    check_input_ids(getattr(obj, "input_ids", None), self.model_config.vocab_size)
    if request is not None and getattr(request, "method", None) in ("POST", "PUT") and \
            request.url.path.endswith("/generate"):
        take_spec_capture(obj, await request.json())  # the body Starlette has already read and parsed
    waiter = _http_waiter(cfg)
    try:
        async for out in original(self, obj, request):
            adm = obj.__dict__.get("_sglang_hs")  # set by admit_generate_request (GenerateReqInput only)
            if adm is not None and adm.rids and cfg.mode == "held":
                await hold_until_durable(out, adm, waiter, cfg.out_dir)
            yield out
    finally:
        adm = obj.__dict__.get("_sglang_hs")
        if adm is not None:
            waiter.release(adm.rids, adm.call_id, adm.unclaimed, live=cfg.mode == "live")


@seam("sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion._build_completion_response",
      HookType.AROUND)
def completion_kv_transfer_params(original, self, request, ret, created):
    """Target: OpenAIServingCompletion._build_completion_response (the non-streaming
    /v1/completions answer, built from generate_request's outputs).

    Why: speculators' online trainer (hs-connectors 0.9.0) reads where its sample is from a
    top-level `kv_transfer_params` of the completion, as vLLM answers it; SGLang's
    CompletionResponse has no such field. For a one-prompt completion whose sample went to
    a trainer's sink, answer the same body plus that field. Upstream PR: a response hook
    for plugins (or a pass-through field for connector results). Remove with it.
    """
    response = original(self, request, ret, created)
    info = ret[0].get("meta_info", {}).get("hidden_states_export") if len(ret) == 1 else None
    from sglang_hs.overlay.config import SINKS

    if not info or info.get("answer") is None or SINKS[info["sink"]].answer_field != "kv_transfer_params":
        return response
    from fastapi.responses import ORJSONResponse

    return ORJSONResponse({**response.model_dump(mode="json"), "kv_transfer_params": info["answer"]})


def seam_targets() -> List[str]:
    return [s.target for s in SEAMS]

