"""set_aux_layers on stand-ins for SGLang's model families: each stand-in's forward really
captures through the state it reads (the list, per-layer flags, or both) and its setter
shifts ids and leaves flags the way the upstream family does, so a test compares what the
forward captures, not what set_aux_layers wrote. The real families are pinned by the
conformance probe (test_seams.py) and exported against HF in test/server/test_families_cpu.py."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_hs.overlay.aux_layers import AuxLayersError, find_stack, loop_reads, set_aux_layers

L = 12


class Layer:
    pass


class ListStack:
    def __init__(self, n=L):
        self.layers = [Layer() for _ in range(n)]
        self.layers_to_capture = []

    def forward(self):
        return [i for i in range(len(self.layers)) if i in self.layers_to_capture]


class FlagStack(ListStack):
    def set_eagle3_layers_to_capture(self, ids):  # Qwen2MoeModel: sets flags, never clears one
        self.layers_to_capture = ids
        for i in ids:
            setattr(self.layers[i], "_is_layer_to_capture", True)

    def forward(self):
        return [i for i, layer in enumerate(self.layers) if getattr(layer, "_is_layer_to_capture", False)]


class BothStack(ListStack):
    def forward(self):  # Bailing: the list before each layer, and the flag inside it
        out = []
        for i, layer in enumerate(self.layers):
            if i in self.layers_to_capture:
                out.append(i)
            if getattr(layer, "_is_layer_to_capture", False):
                out.append(i)
        return out


class OtherStack(ListStack):
    def forward(self):  # captures by a rule sglang-hs does not know
        return [i for i in range(len(self.layers)) if i % 3 == 0]


class ShiftingStack(ListStack):
    """A stack that stores what it is given shifted by one: what it will capture differs
    from what was written."""

    @property
    def layers_to_capture(self):
        return [i + 1 for i in self._ids]

    @layers_to_capture.setter
    def layers_to_capture(self, ids):
        self._ids = list(ids)


class LlamaLike:
    def __init__(self, stack):
        self.model = stack
        self.capture_aux_hidden_states = False

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.capture_aux_hidden_states = True
        n = len(self.model.layers)
        self.model.layers_to_capture = [2, n // 2, n - 3] if layer_ids is None else [v + 1 for v in layer_ids]


class Qwen3MoeLike(LlamaLike):
    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.capture_aux_hidden_states = True
        n = len(self.model.layers)
        self.model.set_eagle3_layers_to_capture([2, n // 2, n - 3] if layer_ids is None
                                                else [v + 1 for v in layer_ids])


class KimiLike:
    """KimiK25ForConditionalGeneration: the text model under language_model, `model` an alias."""

    def __init__(self, stack):
        self.language_model = LlamaLike(stack)

    @property
    def model(self):
        return self.language_model

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.language_model.set_eagle3_layers_to_capture(layer_ids)


FAMILIES = {
    "list": lambda: LlamaLike(ListStack()),
    "flags": lambda: Qwen3MoeLike(FlagStack()),
    "both": lambda: LlamaLike(BothStack()),
    "wrapper": lambda: KimiLike(ListStack()),
}


def stack_of(model):
    return find_stack(model)[1]


ids_strategy = st.sets(st.integers(1, L - 1), min_size=1, max_size=L - 1).map(sorted)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@settings(max_examples=60, deadline=None)
@given(ids=ids_strategy)
def test_the_forward_captures_exactly_the_requested_ids(family, ids):
    model = FAMILIES[family]()
    aux = set_aux_layers(model, ids, L, allow_untested=True)
    assert stack_of(model).forward() == ids
    assert list(aux.layer_ids) == ids


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_no_ids_gives_the_family_default_unshifted(family):
    model = FAMILIES[family]()
    aux = set_aux_layers(model, None, L, allow_untested=True)
    assert stack_of(model).forward() == [2, L // 2, L - 3] == list(aux.layer_ids)


def test_what_each_stand_in_reads():
    assert loop_reads(ListStack) == {"layers_to_capture"}
    assert loop_reads(FlagStack) == {"_is_layer_to_capture"}
    assert loop_reads(BothStack) == {"layers_to_capture", "_is_layer_to_capture"}
    assert loop_reads(OtherStack) == frozenset()


def test_the_stack_is_found_through_wrappers_under_its_canonical_path():
    assert find_stack(KimiLike(ListStack()))[0] == "language_model.model"
    assert find_stack(LlamaLike(ListStack()))[0] == "model"


def test_capture_is_switched_on_by_the_family_setter():
    model = KimiLike(ListStack())
    set_aux_layers(model, [1, 5], L, allow_untested=True)
    assert model.language_model.capture_aux_hidden_states is True


def test_a_loop_we_cannot_read_is_refused():
    with pytest.raises(AuxLayersError, match="reads neither"):
        set_aux_layers(LlamaLike(OtherStack()), [1, 2], L)


def test_a_readback_that_differs_is_refused():
    with pytest.raises(AuxLayersError, match=r"asked to capture HF layers \[1, 4\] but model will capture \[2, 5\]"):
        set_aux_layers(LlamaLike(ShiftingStack()), [1, 4], L, allow_untested=True)


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLMNextN", "LlamaForCausalLMEagle3", "EmbeddingGemmaModel",
                                  "Qwen3MoeForCausalLMMTP"])
def test_draft_and_embedding_classes_are_refused_naming_the_tested_ones(arch):
    cls = type(arch, (LlamaLike,), {})
    with pytest.raises(AuxLayersError, match="refused.*KimiK25ForConditionalGeneration"):
        set_aux_layers(cls(ListStack()), [1, 2], L)


def test_a_model_without_a_stack_or_setter_is_refused():
    class NoStack:
        def set_eagle3_layers_to_capture(self, ids=None):
            pass

    with pytest.raises(AuxLayersError, match="no decoder stack"):
        set_aux_layers(NoStack(), [1], L)
    with pytest.raises(AuxLayersError, match="no EAGLE-3 aux capture"):
        set_aux_layers(object(), [1], L)


def test_bad_ids_name_the_default():
    with pytest.raises(AuxLayersError, match=r"out of range.*default is \[2, 6, 9\]"):
        set_aux_layers(LlamaLike(ListStack()), [0, 3], L)


def test_a_stack_known_to_capture_other_values_is_refused():
    class Gemma3TextModel(ListStack):
        pass

    with pytest.raises(AuxLayersError, match="MLP output"):
        set_aux_layers(LlamaLike(Gemma3TextModel()), [1, 2], L)


def test_a_class_never_compared_with_hf_is_refused_unless_allowed():
    with pytest.raises(AuxLayersError, match="never compared.*--export-allow-untested-model"):
        set_aux_layers(LlamaLike(ListStack()), [1, 4], L)
    tested = type("Qwen3MoeForCausalLM", (Qwen3MoeLike,), {})
    assert set_aux_layers(tested(FlagStack()), [1, 4], L).tested


def test_a_flag_the_loop_does_not_read_does_not_count():
    model = LlamaLike(ListStack())
    model.model.layers[5]._is_layer_to_capture = True  # e.g. left by another feature's setter
    assert list(set_aux_layers(model, [1, 4], L, allow_untested=True).layer_ids) == [1, 4]
    assert model.model.forward() == [1, 4]
