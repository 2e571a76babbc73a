import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(REPO, ".cache", "models")


@pytest.fixture(scope="session")
def smollm2_path():
    from sglang_hs.tools import models

    return models.smollm2(os.path.join(MODELS, "smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def tiny_path(smollm2_path):
    from harness import models

    return models.tiny("llama", os.path.join(MODELS, "tiny-llama-8l"), smollm2_path)


@pytest.fixture(scope="session")
def tiny_deepseek_path(smollm2_path):
    from harness import models

    return models.tiny("deepseek_v3", os.path.join(MODELS, "tiny-deepseek-v3-8l"), smollm2_path)


@pytest.fixture(scope="session")
def tiny_kimi_path(smollm2_path):
    from harness import models

    return models.tiny_kimi_k25(os.path.join(MODELS, "tiny-kimi_k25-8l"), smollm2_path)


TRAINERS = os.path.join(REPO, ".cache", "trainers")


@pytest.fixture(scope="session")
def trainers():
    """SpecForge 0.2.0 and speculators 0.9.0 importable: the Makefile installs them apart
    (--no-deps into .cache/trainers), since they pin other sglang/transformers versions."""
    import sys

    if not os.path.exists(os.path.join(TRAINERS, ".installed")):
        pytest.fail("the trainers are not installed: run `make test` (or `make venv`)")
    if TRAINERS not in sys.path:
        sys.path.append(TRAINERS)  # after the venv, so they never shadow the runtime's packages
    return TRAINERS
