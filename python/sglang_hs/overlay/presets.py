"""Platform presets: named sets of environment variables and server flags for one kind of
machine, from `sglang_hs/data/presets.json`, applied by the launcher (`--platform-preset`)
before any process spawns. A value the user set (environment) or gave (command line) always
wins. The numbers a drafter is trained on depend on these settings (NCCL's algorithm and
protocol fix the all-reduce order), so capture with the settings you will serve with."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from typing import Callable, Dict, List, Mapping, MutableMapping, Sequence


class PresetError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    description: str
    env: Dict[str, str]
    flags: Dict[str, object]
    why: Dict[str, str]


def load_presets() -> Dict[str, Preset]:
    raw = json.loads(resources.files("sglang_hs").joinpath("data/presets.json").read_text())
    return {name: Preset(name=name, **p) for name, p in raw.items()}


def get_preset(name: str) -> Preset:
    presets = load_presets()
    if name not in presets:
        raise PresetError(f"--platform-preset {name!r} is unknown; the presets are: "
                          + "; ".join(f"{n} ({p.description})" for n, p in presets.items()))
    return presets[name]


def flag_given(flag: str, argv: Sequence[str], namespace: object, defaults: Mapping[str, object]) -> bool:
    """On the command line (`--flag v` or `--flag=v`), or parsed to a value other than the
    parser's default (a config file, the Engine API)."""
    dest = flag.lstrip("-").replace("-", "_")
    on_line = any(a == flag or a.startswith(flag + "=") for a in argv)
    return on_line or (dest in defaults and getattr(namespace, dest, None) != defaults[dest])


@dataclasses.dataclass
class Applied:
    """What a preset did: each line says what was set (and why) or what the user's value kept."""

    lines: List[str] = dataclasses.field(default_factory=list)


def apply_preset(preset: Preset, env: MutableMapping[str, str], given: Callable[[str], bool],
                 namespace: object) -> Applied:
    """Set the preset's environment variables that `env` does not have, and its flags the
    user did not give (`given(flag)`), as attributes of the parsed `namespace`."""
    out = Applied()
    for key, value in preset.env.items():
        if key in env:
            out.lines.append(f"{key}={env[key]} kept (set by you; the preset has {value})")
        else:
            env[key] = value
            out.lines.append(f"{key}={value} ({preset.why.get(key, '')})")
    for flag, value in preset.flags.items():
        dest = flag.lstrip("-").replace("-", "_")
        if not hasattr(namespace, dest):
            raise PresetError(f"preset {preset.name}: this SGLang has no {flag}")
        if given(flag):
            out.lines.append(f"{flag} {getattr(namespace, dest)} kept (given; the preset has {value})")
        else:
            setattr(namespace, dest, value)
            out.lines.append(f"{flag} {value} ({preset.why.get(flag, '')})")
    return out


# What export.json records of the environment, as the scheduler process saw it.
RECORDED_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "CUDA_DEVICE_MAX_CONNECTIONS")


def recorded_env(env: Mapping[str, str]) -> Dict[str, str]:
    return {k: v for k, v in sorted(env.items()) if k.startswith(RECORDED_ENV_PREFIXES)}
