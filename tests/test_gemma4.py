"""Gemma 4: per-layer inputs (PLE) into every decoder layer, and its last `num_kv_shared_layers` layers reading the KV
cache of earlier ones. Every layer's states against HF run in tests/test_families.py (the `gemma4` family, fp32);
here: vLLM's `kv_sharing_fast_prefill`, under which those KV-shared layers run for the sampled tokens only, and
which eagle_compat refuses.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from eagle_compat import VllmHiddenStatesGenerator, engine, tiny_models
from eagle_compat.capture import families, resolver
from eagle_compat.errors import UnsupportedModel, WorkerError

from helpers import prompts

GEMMA4 = families.TINY["gemma4"][1]


@pytest.fixture(scope="module")
def gemma4():
    reason = tiny_models.unavailable("gemma4")
    if reason:
        pytest.skip(reason)
    return tiny_models.build_tiny_model("gemma4")


def test_the_resolver_refuses_fast_prefill_naming_it():
    config = SimpleNamespace(model_config=SimpleNamespace(enforce_eager=True),
                             cache_config=SimpleNamespace(kv_sharing_fast_prefill=True),
                             parallel_config=SimpleNamespace(pipeline_parallel_size=1))
    with pytest.raises(UnsupportedModel, match="kv_sharing_fast_prefill is on.*every other token"):
        resolver.check_engine_mode(config, base=None)
    config.cache_config.kv_sharing_fast_prefill = False
    resolver.check_engine_mode(config, base=None)


@pytest.mark.engine
def test_fast_prefill_would_run_the_kv_shared_layers_for_the_sampled_tokens_only(gemma4):
    """What vLLM's own engine does with `kv_sharing_fast_prefill`: the layers before the KV-shared ones see every
    prompt token, the KV-shared ones one row per request (the token it samples from). Their states for the other
    tokens would never exist: why the resolver refuses it."""
    batch = prompts(2, 20, 60, seed=4)
    run = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "data", "fast_prefill_rows.py"),
                          gemma4, json.dumps(batch)], capture_output=True, text=True, timeout=600)
    found = [line for line in run.stdout.splitlines() if line.startswith("ROWS ")]
    assert found, run.stderr[-3000:]
    seen = json.loads(found[-1][5:])
    shared = GEMMA4.config["num_kv_shared_layers"]
    n = GEMMA4.num_layers
    tokens = sum(map(len, batch))
    assert [sum(r) for r in seen[:n - shared]] == [tokens] * (n - shared), seen
    assert [sum(r) for r in seen[n - shared:]] == [len(batch)] * shared, seen


@pytest.mark.engine
def test_the_generator_refuses_an_engine_with_fast_prefill(gemma4, monkeypatch):
    """Were an engine ever built with it (a default changed, a caller's config), the states are refused, not
    written: the worker's UnsupportedModel naming the setting, before the first batch."""
    built = engine.configs.cache_config_kwargs
    monkeypatch.setattr(engine.configs, "cache_config_kwargs",
                        lambda kw: {**built(kw), "kv_sharing_fast_prefill": True})
    with pytest.raises(WorkerError, match="UnsupportedModel in a vLLM worker.*kv_sharing_fast_prefill is on"):
        with VllmHiddenStatesGenerator(gemma4, layer_ids=[0, GEMMA4.num_layers - 1], max_model_len=256,
                                       dtype="float32") as gen:
            gen.generate(prompts(2, 20, 60, seed=4))


def test_a_wrapper_whose_module_cannot_load_here_is_refused_naming_the_cause(monkeypatch):
    """Where transformers' processor cannot be imported (no torchvision beside a `+cpu` torch), a multimodal
    wrapper is refused before any worker starts, naming the module, the cause and the way out."""
    from eagle_compat.engine import configs
    from eagle_compat.errors import IncompatibleEnvironment

    if tiny_models.unavailable("gemma4_mm"):
        pytest.skip(tiny_models.unavailable("gemma4_mm"))
    path, _, _ = tiny_models.build_family("gemma4_mm")
    monkeypatch.setattr(configs, "torchvision_loads", lambda: False)
    monkeypatch.setattr(configs, "import_failure", lambda module: "ModuleNotFoundError: No module named 'torchvision'")
    with pytest.raises(IncompatibleEnvironment, match=r"Gemma4ForConditionalGeneration .*importing "
                       r"vllm\.model_executor\.models\.gemma4_mm failed: ModuleNotFoundError: No module named "
                       r"'torchvision'\. .*install the torchvision built for this torch"):
        configs.build_vllm_config(path, worker_extension_cls="", max_model_len=256, gpu_memory_utilization=0.3)


def test_import_failure_names_the_root_cause_and_none_where_the_module_loads():
    from eagle_compat.engine import configs
    assert configs.import_failure("json") is None
    assert (configs.import_failure("eagle_compat_no_such_module") ==
            "ModuleNotFoundError: No module named 'eagle_compat_no_such_module'")
