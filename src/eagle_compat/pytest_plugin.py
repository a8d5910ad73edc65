"""pytest plugin (entry point `pytest11`): put "extraction still equals HF on the vLLM we run" into a downstream
repo's own test suite. Inert unless a test asks for one of its fixtures; importing it imports nothing heavy.

    def test_extraction_matches_hf(eagle_compat_check):
        eagle_compat_check("deepseek_v3")                      # tiny model built locally, speculators under install()
        eagle_compat_check("llama", check="generator")         # eagle_compat's own generator, fp32
        eagle_compat_check(model="path/to/your/model", check="generator", dtype="auto")

A failure is an AssertionError naming each layer outside tolerance, its worst sequence and token, and the error.
"""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def eagle_compat_tiny_model():
    """`build(family)` -> path of a tiny random-weight checkpoint of that family, built locally (cached)."""
    def build(family: str = "llama") -> str:
        from eagle_compat import tiny_models
        return tiny_models.build_family(family)[0]
    return build


@pytest.fixture
def eagle_compat_check(monkeypatch):
    """`check(family="llama", *, check="shim"|"generator", model=None, **options)` -> CheckResult, asserting it
    equals HF (options: layer_ids, dtype, prompts, prepare, reference_model, trust_remote_code, device)."""
    import os
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:  # several small CPU engines in one test run; for this test only
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")

    def run(family: str | None = "llama", *, check: str = "shim", model: str | None = None, **options):
        from eagle_compat import check as parity
        result = parity.run(check, None if model else family, model=model, **options)
        result.raise_if_failed()
        return result
    return run
