"""Calls from the driver to vLLM's workers: the executor, queued or answered calls, one engine step, deadlines.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from .. import detect, settings
from ..errors import InvalidInput

# The step deadline eagle_compat runs with where the user set no VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (vLLM: 300 s):
# the generator's queued steps wait behind others, and one slow step must not end a days-long run (speculators'
# generator gets it too: patches/step_deadline.py). A hung worker is still found: this bounds every step.
STEP_DEADLINE_S = 1500


def executor_class(in_process: bool) -> Any:
    """The executor the generator drives: vLLM's multiprocess executor (a spawned worker per rank, calls queued), or,
    `in_process`, its one-rank executor, whose worker lives in this process: no process to spawn, no second import
    of vLLM (most of a short run's start-up on the H200), calls answered as they are made."""
    if in_process:
        from vllm.v1.executor.uniproc_executor import UniProcExecutor
        return UniProcExecutor
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    return MultiprocExecutor


def worker_pids(executor: Any) -> list[int]:
    """The pids of the executor's worker processes (none for the one-rank executor: its worker is this process)."""
    procs = [getattr(w, "proc", None) for w in getattr(executor, "workers", None) or []]
    return [p.pid for p in procs if getattr(p, "pid", None)]


def can_queue_calls(executor: Any) -> bool:
    """Whether calls to the workers can be queued without waiting for their replies: MultiprocExecutor's
    `futures_queue` (vLLM 0.12+ at least) serves `non_block=True` in every scheduling mode; before it, only with
    async scheduling or pipeline parallelism, which we turn off."""
    return hasattr(executor, "futures_queue")


def call_deadline() -> float:
    """Seconds any of eagle_compat's own worker calls (setup, map, begin, finish, abandon) may take: the step
    deadline, VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS where the user set it. vLLM gives `collective_rpc` none by default,
    so a hung (not dead: e.g. stopped) worker hung the driver forever."""
    try:
        return settings.value("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS") or float(STEP_DEADLINE_S)
    except InvalidInput:  # vLLM refuses the value itself where it reads it
        return float(STEP_DEADLINE_S)


def submit(executor: Any, method: str, *args: Any) -> Future:
    """`collective_rpc` whose per-rank replies arrive in a Future. Workers run calls in the order they are sent;
    where calls cannot be queued (`can_queue_calls`), this one has completed when it returns."""
    if can_queue_calls(executor):
        return executor.collective_rpc(method, args=args, non_block=True, timeout=call_deadline())
    return _done(executor.collective_rpc(method, args=args, timeout=call_deadline()))


def submit_step(executor: Any, scheduler_output: Any) -> list[Future]:
    """One engine step. From 0.11.1 a step is execute_model() then sample_tokens() when the former returns None
    (skipping sample_tokens makes the *next* step fail with a worker state error). Queued, both are sent at once, as
    vLLM's own batch queue does: a worker whose execute_model returned its output answers sample_tokens with None."""
    if can_queue_calls(executor):
        futures = [executor.execute_model(scheduler_output, non_block=True)]
        if detect.feature("two_phase_step"):
            futures.append(executor.sample_tokens(None, non_block=True))
        return futures
    out = executor.execute_model(scheduler_output)
    if out is None and detect.feature("two_phase_step"):
        out = executor.sample_tokens(None)
    return [_done(out)]


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def rpc_all(executor: Any, method: str, *args: Any) -> list:
    """collective_rpc without unique_reply_rank: a list of per-rank replies in every release."""
    return executor.collective_rpc(method, args=args, timeout=call_deadline())


def rpc_rank0(executor: Any, method: str, *args: Any) -> Any:
    return rpc_all(executor, method, *args)[0]


def initialize_workers(executor: Any, kv_cache_config: Any, world_size: int) -> None:
    executor.initialize_from_config([kv_cache_config] * world_size)
    warm_up_if_separate(executor)


def warm_up_if_separate(executor: Any) -> None:
    # 0.27+: initialize_from_config no longer warms up; EngineCore calls this right after it.
    if detect.feature("warm_up_separate"):
        executor.compile_or_warm_up_model()
