"""The workers never hear that each batch's last requests finished.

A step's finished requests reach vLLM's model runner with the next scheduler output (`finished_req_ids`).
speculators' generate() aborts each request after its step and stops at the first output that schedules nothing,
which it never sends: that output carries the batch's finished ids. The V1 model runner then keeps every request's
state (its token ids) for the engine's life, memory that grows with every sample of a long job. The V2 model runner
(CUDA's default for Llama from vLLM 0.23 and for every dense model from 0.25.1) has max_num_seqs request slots and
fails the next batch once they are used up ("AssertionError: No free indices", measured on the H200, vLLM 0.27.1).

On the Scheduler speculators builds (only that one), `schedule()` goes through `scheduling.schedule`: an output that
schedules nothing gives its finished ids back to the scheduler, and the next batch's first output delivers them.
The stable generator's loop goes through the same function.
"""
from __future__ import annotations

from ._adapters import instance_method_hook
from ._base import GENERATOR_MODULE, PatchUnit


def _schedule(scheduler, call, args, kwargs):
    from .. import engine
    return engine.scheduling.schedule(scheduler, lambda: call(*args, **kwargs))


def _apply(patcher, module) -> None:
    patcher.hook_built(module, "Scheduler", lambda scheduler: instance_method_hook(scheduler, "schedule", _schedule))


UNIT = PatchUnit(
    name="finished_requests_delivered",
    broke="each batch's finished request ids are never sent to the workers: the V1 model runner keeps every "
          "request's tokens for the engine's life (memory grows over a long job); the V2 model runner (CUDA's "
          "default for dense models from 0.25.1, Llama from 0.23) fails once max_num_seqs requests were sent "
          "('No free indices')",
    affects="",
    delete_when="speculators' generator sends every scheduler output, or no longer drives vLLM's Scheduler itself",
    target=GENERATOR_MODULE,
    sides=("driver",),
    apply=_apply,
)
