import os

# Keep each CPU engine's KV cache small (GiB): several engines live in one test run on a 24 GiB machine.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from eagle_compat import tiny_models  # noqa: E402


@pytest.fixture(autouse=True)
def every_record_written_is_declared(monkeypatch):
    """Each manifest.json a test's run writes holds only keys extract/record.py declares, of their declared types
    (the record's schema, checked wherever the suite writes one: local and Ray runs, shards, resumes, conversions)."""
    from eagle_compat.extract import atomic_io, record, writer
    real = atomic_io.atomic_write_json

    def checked(path, obj):
        if os.path.basename(path) == writer.MANIFEST and isinstance(obj, dict):
            wrong = record.problems(obj)
            assert not wrong, "\n".join(wrong)
        return real(path, obj)
    monkeypatch.setattr(atomic_io, "atomic_write_json", checked)


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


# Seconds each test file took in the vllm-cpu 0.32.0 pass (from its JUnit XML, pytest --junitxml; files under 40 s
# count 0; test_cli.py raised by an estimate for the demo test; per-file times of such passes:
# benchmarks/results/cpu-test-pass-workers.md).
# scripts/test.sh runs the files on two pytest-xdist workers (--dist loadfile --no-loadscope-reorder), which hand
# them out in collection order: heaviest first, so that no heavy file is left to run alone on one core at the end.
# xdist's own order (most tests first) put test_ray.py, 409 s in 6 tests, among the last. A stale weight only costs
# time; correctness does not depend on the order.
FILE_SECONDS = {
    "test_extract.py": 476, "test_families.py": 600, "test_ray.py": 409, "test_e2e_generator.py": 318,
    "test_e2e_speculators_shim.py": 270, "test_launcher.py": 236, "test_real_model.py": 206, "test_preflight.py": 157,
    "test_quantized.py": 147, "test_tensor_parallel.py": 114, "test_cli.py": 140, "test_compat_matrix.py": 93,
    "test_integrity.py": 88, "test_patch_contract.py": 85, "test_arrow.py": 71, "test_extract_integrity.py": 41,
    "test_downstream_plugin.py": 40, "test_gemma4.py": 90, "test_online.py": 200, "test_leftovers.py": 150,
    "test_online_trainer.py": 40,
    "test_benchmark_smoke.py": 125,  # an estimate: 122 s of CPU alone (176 s on a machine busy with another pass)
}


def pytest_collection_modifyitems(items):
    # a stable sort: each file's tests keep their order, and files of equal weight theirs
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))
