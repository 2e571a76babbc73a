import argparse

import pytest

from sglang_hs.overlay.presets import (PresetError, apply_preset, flag_given, get_preset, load_presets,
                                      recorded_env)

DEFAULTS = {"attention_backend": None, "num_continuous_decode_steps": 1}


def given(argv, args):
    return lambda flag: flag_given(flag, argv, args, DEFAULTS)


def ns(**kw):
    base = {"attention_backend": None, "num_continuous_decode_steps": 1}
    base.update(kw)
    return argparse.Namespace(**base)


def test_the_seeds_set_and_a_hopper_set_are_there_and_every_setting_says_why():
    presets = load_presets()
    assert {"sm120-pcie-tp8", "hopper-nvlink"} <= set(presets)
    seed = presets["sm120-pcie-tp8"]
    assert seed.env == {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring", "NCCL_P2P_LEVEL": "SYS", "NCCL_MAX_NCHANNELS": "16",
                        "NCCL_BUFFSIZE": "16777216", "NCCL_NTHREADS": "512"}
    for p in presets.values():
        assert set(p.why) == set(p.env) | set(p.flags), p.name
        assert all(isinstance(v, str) for v in p.env.values())


def test_what_the_user_set_or_gave_wins_and_the_rest_is_set_and_logged():
    env = {"NCCL_PROTO": "Simple"}
    args = ns(attention_backend="flashinfer")
    applied = apply_preset(get_preset("sm120-pcie-tp8"), env, given(["--attention-backend", "flashinfer"], args), args)
    assert env["NCCL_PROTO"] == "Simple" and env["NCCL_ALGO"] == "Ring" and env["NCCL_NTHREADS"] == "512"
    assert args.attention_backend == "flashinfer" and args.num_continuous_decode_steps == 4
    text = "\n".join(applied.lines)
    assert "NCCL_PROTO=Simple kept" in text and "--attention-backend flashinfer kept" in text
    assert "NCCL_ALGO=Ring (Ring:" in text  # with its reason
    args2 = ns()
    apply_preset(get_preset("sm120-pcie-tp8"), {}, given(["--attention-backend=flashinfer"], args2), args2)
    assert args2.attention_backend is None  # `--flag=value` counts as given (the value stays as parsed)
    args3 = ns(attention_backend="fa3")  # not on the command line, but not the default (a config file)
    apply_preset(get_preset("sm120-pcie-tp8"), {}, given([], args3), args3)
    assert args3.attention_backend == "fa3" and args3.num_continuous_decode_steps == 4


def test_an_unknown_preset_is_refused_with_the_list():
    with pytest.raises(PresetError, match="sm120-pcie-tp8.*hopper-nvlink"):
        get_preset("sm120")


def test_a_flag_this_sglang_lacks_is_refused():
    with pytest.raises(PresetError, match="no --num-continuous-decode-steps"):
        apply_preset(get_preset("sm120-pcie-tp8"), {}, lambda f: False, argparse.Namespace(attention_backend=None))


def test_recorded_env_keeps_what_the_numbers_depend_on():
    assert recorded_env({"NCCL_ALGO": "Ring", "TORCH_NCCL_BLOCKING_WAIT": "1", "HOME": "/root",
                         "CUDA_DEVICE_MAX_CONNECTIONS": "1"}) == {
        "CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_ALGO": "Ring", "TORCH_NCCL_BLOCKING_WAIT": "1"}
