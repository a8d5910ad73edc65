"""Unmodified speculators 0.3.0 under eagle_compat.install(), on real CPU vLLM, against HF transformers.

speculators passes dtype="auto", which runs our float32 checkpoints in bf16 on CPU: judged at bf16 tolerance.
"""
from __future__ import annotations

import pytest
import torch

import eagle_compat
from eagle_compat import tiny_models

from helpers import assert_matches_hf, assert_workers_hold_only_the_last_batch, prompts

pytestmark = pytest.mark.engine


def _generator_class():
    eagle_compat.install()
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
    return VllmHiddenStatesGenerator


# gemma3: sliding-window and full layers, its KV cache planned as vLLM's engine plans it (kv_cache_groups_as_vllm)
@pytest.fixture(scope="module", params=["llama", "deepseek_v3", "kimi_k25", "gemma3"])
def shim(request):
    path, reference_path, num_layers = tiny_models.build_family(request.param)
    layer_ids = [0, (num_layers - 1) // 2, num_layers - 2, num_layers - 1]  # first, middle, N-2, N-1
    gen = _generator_class()(path, layer_ids=layer_ids, max_model_len=512, gpu_memory_utilization=0.3)
    yield request.param, reference_path, layer_ids, gen
    gen.executor.shutdown()
    eagle_compat.uninstall()


def test_parity_layers_first_middle_penultimate_last(shim):
    family, path, layer_ids, gen = shim
    batch = prompts(3, 20, 60, seed=1)
    results = gen.generate(batch)
    worst = assert_matches_hf(results, path, batch, layer_ids, precision="bf16")
    print(f"\n{family} speculators-shim bf16 worst relative error per layer: {worst}")
    for res, ids in zip(results, batch):
        assert res["input_ids"].tolist() == ids
        assert len(res["hidden_states"]) == len(layer_ids)


def test_failure_inside_vllms_worker_code_reaches_speculators_caller_with_traceback(shim):
    _, _, _, gen = shim
    with pytest.raises(eagle_compat.WorkerError, match="no_such_worker_method") as info:
        gen.executor.collective_rpc("no_such_worker_method")
    assert info.value.exc_type == "AttributeError" and "Traceback" in info.value.remote_traceback


def test_big_mixed_batch_two_calls_and_alone(shim):
    """> max_num_seqs (32) sequences, > one step's tokens (8192), shared 16+ token prefix, called twice; each
    sequence equals its result when generated alone."""
    family, path, layer_ids, gen = shim
    shared = prompts(1, 24, 24, seed=7)[0]
    batch = prompts(30, 150, 330, seed=2) + prompts(10, 40, 120, seed=3, prefix=shared)
    assert len(batch) > 32 and sum(map(len, batch)) > 8192
    first = gen.generate(batch)
    second = gen.generate(batch)
    assert_matches_hf(first, path, batch, layer_ids, precision="bf16")
    for a, b in zip(first, second):
        for x, y in zip(a["hidden_states"], b["hidden_states"]):
            assert torch.equal(x, y)
    for i in (0, 17, 31, 35, 39):
        alone = gen.generate([batch[i]])[0]
        for x, y in zip(alone["hidden_states"], first[i]["hidden_states"]):
            # batched and single runs may round differently in bf16; misassigned rows would differ entirely
            assert (x.float() - y.float()).abs().max() <= 2e-2 * y.float().abs().max()


def test_the_workers_hear_that_each_of_speculators_batches_finished(shim):
    """speculators stops at the output that schedules nothing and never sends it, with the batch's finished ids in
    it (patch unit finished_requests_delivered): the model runner must hold no more than the last batch."""
    assert_workers_hold_only_the_last_batch(shim[3])


def test_speculators_steps_run_with_eagle_compats_step_deadline(monkeypatch):
    """vLLM's 300 s step deadline ended a real run of speculators' generator on a busy 2-core machine: under install()
    its steps get the stable generator's deadline, where the user set none."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    from eagle_compat import engine
    seen = []
    original = MultiprocExecutor.collective_rpc

    def spy(self, method, *args, **kwargs):  # below eagle_compat's hook: what vLLM's call finally gets
        if method in ("execute_model", "sample_tokens"):
            seen.append(kwargs.get("timeout"))
        return original(self, method, *args, **kwargs)
    generator_class = _generator_class()  # install() first: its probes read vLLM's own collective_rpc
    monkeypatch.setattr(MultiprocExecutor, "collective_rpc", spy)
    monkeypatch.delenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", raising=False)
    path, _, num_layers = tiny_models.build_family("llama")
    gen = generator_class(path, layer_ids=[0, num_layers - 1], max_model_len=512, gpu_memory_utilization=0.3)
    try:
        gen.generate(prompts(2, 5, 20, seed=3))
    finally:
        gen.executor.shutdown()
        eagle_compat.uninstall()
    assert seen and set(seen) == {engine.rpc.STEP_DEADLINE_S}, seen
