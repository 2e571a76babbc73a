"""Turn on a model's aux hidden-state capture at exact HF layer ids, for any SGLang family,
and prove what will be captured before the server serves.

SGLang's model families capture EAGLE-3 aux states in two ways. Most decoder stacks test
`i in self.layers_to_capture` in their layer loop; the Qwen2/Qwen3-MoE, Qwen3-Next,
Qwen3.5 and MiniMax-M3 stacks instead pass a list to each layer whose `_is_layer_to_capture`
flag is set, and the layer's communicator appends its input residual. Bailing reads both. In
both ways the index is the one Hugging Face `output_hidden_states` uses (i = the input of
decoder layer i), but each family's `set_eagle3_layers_to_capture(ids)` shifts explicit ids
its own way, and the flag-setting families never clear a flag. So we let the family's own
setter turn capture on (with its default ids), then set our ids on exactly what the stack's
loop reads, and read that back. Plain Python: the seam passes SGLang's model object in.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from typing import Any, FrozenSet, List, Optional, Sequence, Tuple

from sglang_hs.overlay.config import ExportConfigError
from sglang_hs.overlay.startup import check_aux_layer_ids

# Attribute names under which multimodal and wrapper classes keep the text model, tried in
# this order (KimiK25ForConditionalGeneration: language_model.model; Gemma3 and Llama4
# ForConditionalGeneration: language_model.model; Gemma4: language_model; others: model).
WRAPPER_ATTRS = ("language_model", "model")
MAX_DEPTH = 3

LIST, FLAGS = "layers_to_capture", "_is_layer_to_capture"

# Classes that have the EAGLE-3 setter but are not target models one exports from.
REFUSED = {
    "EmbeddingGemmaModel": "an embedding model; it serves no generation requests",
    "MindSporeForCausalLM": "its layers are a MindSpore model (sgl_mindspore, Ascend NPUs), not a torch "
                            "decoder stack whose capture sglang-hs can read back",
}
DRAFT_SUFFIXES = ("NextN", "MTP", "Eagle", "Eagle3", "AssistantForCausalLM")
# Decoder stacks whose loop captures something other than HF's hidden state (the residual
# stream), measured against transformers on CPU.
REFUSED_STACKS = {
    "Gemma3TextModel": "SGLang 0.5.17's Gemma3 loop captures each layer's MLP output, not the residual "
                       "stream that HF output_hidden_states holds (cosine to HF 0.64, 0.40, 0.28 at ids "
                       "1 3 7 of a miniature Gemma3, measured on CPU)",
}


class AuxLayersError(ExportConfigError):
    """The model's aux capture cannot be set to, or proven at, the requested ids."""


@dataclasses.dataclass(frozen=True)
class AuxLayers:
    """What will be captured: `layer_ids` (HF convention) in the decoder stack at `path`."""

    architecture: str
    path: str  # attribute path from the model to its decoder stack, e.g. "language_model.model"
    reads: FrozenSet[str]  # what the stack's layer loop reads: LIST, FLAGS or both
    layer_ids: Tuple[int, ...]

    @property
    def tested(self) -> bool:
        """Exported and compared with HF by sglang-hs' own tests (CPU or H200)."""
        return self.architecture in TESTED


def find_stack(model: Any) -> Tuple[str, Any]:
    """The decoder stack: the first object, breadth first through WRAPPER_ATTRS, holding
    both `layers` and `layers_to_capture`. Aliases (Kimi's `model` is its `language_model`)
    are visited once, under the first path found."""
    seen, frontier = {id(model)}, [("", model)]
    for _ in range(MAX_DEPTH):
        nxt = []
        for path, obj in frontier:
            for name in WRAPPER_ATTRS:
                child = getattr(obj, name, None)
                if child is None or id(child) in seen:
                    continue
                seen.add(id(child))
                p = f"{path}.{name}" if path else name
                if hasattr(child, "layers") and hasattr(child, LIST):
                    return p, child
                nxt.append((p, child))
        frontier = nxt
    raise AuxLayersError(f"{type(model).__name__}: no decoder stack with `layers` and `{LIST}` under "
                         f"{' / '.join(WRAPPER_ATTRS)}; it has no EAGLE-3 aux capture sglang-hs can set. "
                         f"{supported_hint()}")


# `X in self.layers_to_capture` where X is the end of the stack: a read for the last layer's
# output only (MiniMax-M3 from SGLang 0.5.23, GptOss, Laguna, Lfm2, MiMo-V2, NemotronH), which
# sglang-hs never asks for (ids are 1..L-1); the loop's per-layer reads decide what it reads.
END_OF_STACK = {"self.end_layer", "len(self.layers)", "num_layers", "self.config.num_hidden_layers"}


@functools.lru_cache(maxsize=None)
def loop_reads(stack_cls: type) -> FrozenSet[str]:
    """Which capture state the stack's forward reads: `in self.layers_to_capture` (the list)
    and/or `_is_layer_to_capture` (per-layer flags). Read from the source of the pinned
    release; the conformance test pins the answer for every family."""
    try:
        src = inspect.getsource(stack_cls.forward)
    except (OSError, TypeError, AttributeError):
        return frozenset()
    reads = set()
    if any(subject not in END_OF_STACK for subject in re.findall(r"(\S+)\s+in\s+self\.layers_to_capture\b", src)):
        reads.add(LIST)
    if FLAGS in src:
        reads.add(FLAGS)
    return frozenset(reads)


def captured_ids(stack: Any, reads: FrozenSet[str]) -> List[int]:
    """Read back the ids the stack's loop will capture, from the state it reads."""
    flagged = [i for i, layer in enumerate(stack.layers) if getattr(layer, FLAGS, False)] if FLAGS in reads else []
    listed = [int(i) for i in getattr(stack, LIST)] if LIST in reads else []
    return sorted(listed + flagged)  # a loop reading both captures a listed and flagged id twice


def set_aux_layers(model: Any, layer_ids: Optional[Sequence[int]], num_layers: int,
                   allow_untested: bool = False) -> AuxLayers:
    """Turn capture on at `layer_ids` (None: the family's own default) and prove it.

    Raises AuxLayersError, before anything is served, when the class is not a target model,
    its stack cannot be found, its loop reads no capture state we know, the state read back
    differs from the request, or (unless `allow_untested`) sglang-hs has never compared the
    class's export with Hugging Face: the read-back proves the layer ids, not the values
    (SGLang's Gemma3 loop captures the right ids and the wrong tensors).
    """
    arch = type(model).__name__
    if arch in REFUSED or arch.endswith(DRAFT_SUFFIXES):
        why = REFUSED.get(arch, "a draft model (EAGLE / MTP / NextN head), not a target model")
        raise AuxLayersError(f"{arch}: hidden-state export is refused: {why}. {supported_hint()}")
    if not callable(getattr(model, "set_eagle3_layers_to_capture", None)):
        raise AuxLayersError(f"{arch} has no EAGLE-3 aux capture in SGLang; it cannot be exported. "
                             f"{supported_hint()}")
    path, stack = find_stack(model)
    if type(stack).__name__ in REFUSED_STACKS:
        raise AuxLayersError(f"{arch}: hidden-state export is refused: {REFUSED_STACKS[type(stack).__name__]}. "
                             f"{supported_hint()}")
    reads = loop_reads(type(stack))
    if not reads:
        raise AuxLayersError(f"{arch}: the layer loop of {type(stack).__name__} reads neither `{LIST}` "
                             f"nor `{FLAGS}`; sglang-hs cannot prove what it captures. {supported_hint()}")
    # The family's own setter turns capture on wherever the family keeps its switch
    # (`capture_aux_hidden_states` on the outer model, the wrapper, or the stack).
    model.set_eagle3_layers_to_capture(None)
    default = sorted(getattr(stack, LIST))  # every family's setter fills the list, flags or not
    try:
        ids = check_aux_layer_ids(layer_ids if layer_ids is not None else default, num_layers)
    except ExportConfigError as e:
        raise AuxLayersError(f"{e} (the model's default is {list(default)}; pass --export-aux-layer-ids)") from None
    if FLAGS in reads:
        # Flags are the ids where the loop reads only flags; all off where it also reads the
        # list (Bailing), which would capture a flagged layer twice.
        only_flags = reads == {FLAGS}
        for i, layer in enumerate(stack.layers):
            setattr(layer, FLAGS, only_flags and i in ids)
    setattr(stack, LIST, list(ids))
    got = captured_ids(stack, reads)
    if got != list(ids):
        raise AuxLayersError(f"{arch}: asked to capture HF layers {list(ids)} but {path} will capture {got}; "
                             "refusing to export layers other than the ones the files claim.")
    aux = AuxLayers(arch, path, reads, tuple(ids))
    if not aux.tested and not allow_untested:
        raise AuxLayersError(
            f"{arch}: its loop will capture HF layers {list(ids)} (read back from {path}), but sglang-hs has "
            f"never compared this class's export with Hugging Face. {supported_hint()} To export it anyway, "
            "pass --export-allow-untested-model and check the first samples with `sglang-hs verify DIR`.")
    return aux


# Where sglang-hs exported each class and compared it with HF: the CPU server tests
# (test/server/test_families_cpu.py, test_deepseek_cpu.py) or the H200 GPU tests
# (test/gpu/test_families_gpu.py, for families whose kernels need a GPU). Checked against the
# README's family table by test/unit/test_seams.py.
TESTED = {
    "LlamaForCausalLM": "CPU", "MistralForCausalLM": "CPU", "Phi3ForCausalLM": "CPU", "Qwen2ForCausalLM": "CPU",
    "Qwen3ForCausalLM": "CPU", "Qwen2MoeForCausalLM": "CPU", "Qwen3MoeForCausalLM": "CPU and H200",
    "Glm4MoeForCausalLM": "CPU", "DeepseekV3ForCausalLM": "CPU", "KimiK25ForConditionalGeneration": "CPU and H200",
    "GptOssForCausalLM": "H200", "Qwen3NextForCausalLM": "H200",
}


def supported_hint() -> str:
    return ("Exported and checked against Hugging Face by sglang-hs: " + ", ".join(TESTED)
            + "; the README's family table lists every SGLang class and its status.")
