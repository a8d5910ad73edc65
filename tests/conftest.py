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
