import os

# Keep each CPU engine's KV cache small (GiB): several engines live in one test run on a 24 GiB machine.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from eagle_compat import tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny_models.build_tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_deepseek():
    return tiny_models.build_tiny_model("deepseek_v3")


@pytest.fixture
def fake_engine(monkeypatch):
    """extract's engine replaced by a stand-in whose states are a function of (token, position, layer): the job's
    own logic (manifest, resume, formats) without an engine start."""
    import eagle_compat.generator
    from helpers import FakeEngine

    FakeEngine.started, FakeEngine.block = 0, None
    monkeypatch.setattr(eagle_compat.generator, "VllmHiddenStatesGenerator", FakeEngine)
    return FakeEngine


class NoEngine:
    def __init__(self, *args, **kwargs):
        raise AssertionError("an engine was started")


@pytest.fixture
def no_engine(monkeypatch):
    """A test that must be decided before any engine starts."""
    import eagle_compat.generator

    monkeypatch.setattr(eagle_compat.generator, "VllmHiddenStatesGenerator", NoEngine)
