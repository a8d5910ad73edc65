"""Tensor parallel 2 on CPU: unmodified speculators 0.3.0 under install() and the stable generator equal HF on Llama and
DeepSeek-V3, with vLLM's CPU thread binding set by eagle_compat where one NUMA node must host both workers. Capture runs
on TP rank 0 only: the residual stream is replicated after each layer's all-reduce."""
from __future__ import annotations

import os

import pytest

import eagle_compat
from eagle_compat import engine, tiny_models

from helpers import assert_matches_hf, in_newest_pass_only, prompts

pytestmark = [pytest.mark.engine, in_newest_pass_only(
    "TP 2 is 4 two-worker engines (CI time); TP 1 covers every release")]


def test_thread_binding_splits_the_allowed_cores_only_where_vllm_cannot(monkeypatch):
    monkeypatch.setattr(engine.process_env, "cpu_numa_nodes", lambda: 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert engine.process_env.cpu_thread_binding(1) is None and engine.process_env.cpu_thread_binding(2) == "0|1"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert engine.process_env.cpu_thread_binding(2) == "0-7|8-15"
    monkeypatch.setattr(engine.process_env, "cpu_numa_nodes", lambda: 2)
    assert engine.process_env.cpu_thread_binding(2) is None  # vLLM binds one NUMA node per worker itself
    monkeypatch.setattr(engine.process_env, "cpu_numa_nodes", lambda: 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(eagle_compat.InvalidInput, match="tensor_parallel_size=2 on CPU needs one core per worker"):
        engine.process_env.cpu_thread_binding(2)


@pytest.fixture(autouse=True)
def no_user_binding(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("TP 2 on CPU needs two cores")


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_generator_tp2_fp32_equals_hf(family):
    path, reference_path, n = tiny_models.build_family(family)
    layer_ids = [0, n // 2, n - 1]
    batch = prompts(3, 20, 80, seed=4)
    with eagle_compat.VllmHiddenStatesGenerator(path, layer_ids=layer_ids, max_model_len=512, dtype="float32",
                                                gpu_memory_utilization=0.3, tensor_parallel_size=2) as gen:
        results = gen.generate(batch)
    assert_matches_hf(results, reference_path, batch, layer_ids, precision="fp32")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ  # restored


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_speculators_shim_tp2_equals_hf(family):
    path, reference_path, n = tiny_models.build_family(family)
    layer_ids = [0, n // 2, n - 1]
    batch = prompts(3, 20, 80, seed=4)
    eagle_compat.install()
    try:
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
        gen = VllmHiddenStatesGenerator(path, layer_ids=layer_ids, max_model_len=512, gpu_memory_utilization=0.3,
                                        tensor_parallel_size=2)
        try:
            results = gen.generate(batch)
        finally:
            gen.executor.shutdown()
    finally:
        eagle_compat.uninstall()
    assert_matches_hf(results, reference_path, batch, layer_ids, precision="bf16")


def _fail_the_next_finish_on_rank0(wrapper):
    """Runs in each worker (collective_rpc with a function): rank 0's next `eagle_compat_finish` raises, once."""
    worker = getattr(wrapper, "worker", wrapper)
    if getattr(worker, "rank", getattr(wrapper, "rpc_rank", 0)) != 0:
        return False
    original = wrapper.eagle_compat_finish

    def failing(*args, **kwargs):
        wrapper.eagle_compat_finish = original
        raise RuntimeError("injected failure on rank 0")

    wrapper.eagle_compat_finish = failing
    return True


def test_a_call_failed_by_rank0_closes_a_tp2_generator_rather_than_leave_rank1_a_reply_behind():
    """vLLM reads the ranks' replies in order and raises at rank 0's failure, leaving rank 1's reply to that call
    queued; every later call would read rank 1 one reply behind until a collective deadlocks. The generator closes (the
    failure named), and a new one works and equals HF."""
    path, reference_path, n = tiny_models.build_family("llama")
    layer_ids = [0, n - 1]
    batch = prompts(2, 20, 60, seed=5)
    gen = eagle_compat.VllmHiddenStatesGenerator(path, layer_ids=layer_ids, max_model_len=512, dtype="float32",
                                                 gpu_memory_utilization=0.3, tensor_parallel_size=2)
    try:
        assert gen.executor.collective_rpc(_fail_the_next_finish_on_rank0) == [True, False]
        with pytest.raises(eagle_compat.WorkerError, match="injected failure on rank 0"):
            gen.generate(batch)
        assert gen.executor is None  # closed: no later call can read rank 1's stale reply
        with pytest.raises(eagle_compat.InvalidInput, match="closed"):
            gen.generate(batch)
    finally:
        gen.close()
    with eagle_compat.VllmHiddenStatesGenerator(path, layer_ids=layer_ids, max_model_len=512, dtype="float32",
                                                gpu_memory_utilization=0.3, tensor_parallel_size=2) as fresh:
        assert_matches_hf(fresh.generate(batch), reference_path, batch, layer_ids, precision="fp32")
