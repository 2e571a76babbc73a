import contextlib
import fcntl
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(REPO, ".cache", "models")
# Every checkpoint here is local and no model hub is reachable (CI, the dev machine): without
# this, each server start spends ~2 s in hub lookups that fail (35 vs 37 s, measured).
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@contextlib.contextmanager
def one_builder():
    """`make test` runs modules in two worker processes (pytest-xdist), each with its own
    session fixtures: the first to need a cached model builds it, the other waits and reuses it."""
    os.makedirs(MODELS, exist_ok=True)
    with open(os.path.join(MODELS, ".build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def smollm2_path():
    from sglang_hs.tools import models

    with one_builder():
        return models.smollm2(os.path.join(MODELS, "smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def tiny_path(smollm2_path):
    from harness import models

    with one_builder():
        return models.tiny("llama", os.path.join(MODELS, "tiny-llama-8l"), smollm2_path)


@pytest.fixture(scope="session")
def tiny_deepseek_path(smollm2_path):
    from harness import models

    with one_builder():
        return models.tiny("deepseek_v3", os.path.join(MODELS, "tiny-deepseek-v3-8l"), smollm2_path)


@pytest.fixture(scope="session")
def tiny_kimi_path(smollm2_path):
    from harness import models

    with one_builder():
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
