"""speculators' generator dies on a slow machine with a `TimeoutError` from vLLM's step deadline: vLLM gives every
`execute_model` / `sample_tokens` call `VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS` (default 300 s), and one step of 15 real
prompts of up to 400 tokens on a 270M model on a busy 2-core CPU machine ran past it (measured). A deadline that
kills a days-long extraction over one slow step costs more than it saves; eagle_compat's own generator already
runs with `engine.rpc.STEP_DEADLINE_S` (it queues several steps, each may wait behind others).

At speculators' call site, the executor it builds passes that deadline to its step calls where the user set no
`VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS` (the user's own setting always wins). Scoped to that executor: vLLM's own
engines in the same process keep their 300 s, and the environment is not touched.
"""
from __future__ import annotations

from .. import settings
from ._adapters import ExecutorHooks
from ._base import GENERATOR_MODULE, PatchUnit

ENV = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"
STEP_METHODS = ("execute_model", "sample_tokens")


def _needed() -> bool:
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    from .. import detect
    return ENV in detect.function_source(MultiprocExecutor.execute_model)


def _apply(patcher, module) -> None:
    from .. import engine

    def longer_step_deadline(executor, call, args, kwargs):
        method = kwargs.get("method", args[0] if args else None)
        if method in STEP_METHODS and not settings.is_set(ENV):
            kwargs = {**kwargs, "timeout": engine.rpc.STEP_DEADLINE_S}
        return call(*args, **kwargs)

    patcher.hook_executor(module, "MultiprocExecutor", ExecutorHooks(methods={"collective_rpc": longer_step_deadline}))


UNIT = PatchUnit(
    name="step_deadline",
    broke="one slow step (a busy machine, long prompts) past vLLM's 300 s step deadline kills speculators' run",
    affects="",
    condition="steps slower than 300 s (seen on a busy 2-core CPU machine with a 270M model)",
    delete_when="speculators passes its own step deadline",
    target=GENERATOR_MODULE,
    sides=("driver",),
    needed=_needed,
    apply=_apply,
)
