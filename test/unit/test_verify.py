"""verify's HF loader on the Kimi-K2.5 layout: the wrapper checkpoint (text config under
`text_config`, weights under `language_model.`) loads as the very DeepSeek V3 text model
that the same weights give when saved plainly."""

import torch

from sglang_hs.tools.verify import hf_planes, load_hf


def test_a_wrapper_checkpoint_loads_as_its_text_model(tiny_kimi_path, tiny_deepseek_path):
    wrapped, plain = load_hf(tiny_kimi_path, torch.float32), load_hf(tiny_deepseek_path, torch.float32)
    assert type(wrapped).__name__ == "DeepseekV3ForCausalLM"
    a, b = dict(wrapped.named_parameters()), dict(plain.named_parameters())
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "a weight was not loaded from under language_model."
    tokens = torch.tensor([1, 500, 7000, 42])
    assert torch.equal(hf_planes(wrapped, tokens, [1, 4, 7]), hf_planes(plain, tokens, [1, 4, 7]))
