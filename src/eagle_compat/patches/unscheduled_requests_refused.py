"""speculators 0.3.0 slices each prompt's states out of what was captured, whether or not the prompt ran.

Its `generate()` schedules until a step schedules no token, then reads the captured rows and cuts them by prompt
length. A prompt the scheduler never ran (a KV cache too small for it: `kv_cache_room_checked`, or any cause not yet
seen) gets empty states, so does every later prompt of its batch, and the prompt stays queued, to be captured into
the next call's rows. Silent, on every vLLM release. Before speculators reads the rows we ask its scheduler: a
request still waiting or running means the rows cannot be those of this batch, and the call is refused (the batch's
requests aborted, so that the generator can go on).
"""
from __future__ import annotations

import weakref

from ._adapters import ExecutorHooks
from ._base import GENERATOR_MODULE, PatchUnit


def _apply(patcher, module) -> None:
    schedulers: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()  # by vllm_config

    def built(scheduler) -> None:
        schedulers[id(scheduler.vllm_config)] = scheduler

    def collective_rpc(executor, call, args, kwargs):
        method = args[0] if args else kwargs.get("method")
        scheduler = schedulers.get(id(getattr(executor, "vllm_config", None)))
        if method == "_get_captured_states" and scheduler is not None:
            left = scheduler.get_num_unfinished_requests()
            if left:
                from vllm.v1.request import RequestStatus

                from ..errors import CaptureInvariantError
                # aborted, so that a caller who goes on with this generator does not get them captured into the
                # next call's rows (speculators resets the workers' capture at its next call)
                stuck = [rid for rid, request in scheduler.requests.items() if not request.is_finished()]
                scheduler.finish_requests(stuck, RequestStatus.FINISHED_ABORTED)
                raise CaptureInvariantError(
                    f"{left} request(s) of this generate() call were never run to the end by vLLM's scheduler (a "
                    "prompt that cannot be scheduled: a KV cache or step budget too small for it), so the captured "
                    "rows are not this batch's: speculators would return empty or shifted hidden states for them. "
                    "Nothing of this batch is returned; its requests were aborted")
        return call(*args, **kwargs)

    patcher.hook_built(module, "Scheduler", built)
    patcher.hook_executor(module, "MultiprocExecutor", ExecutorHooks(methods={"collective_rpc": collective_rpc}))


UNIT = PatchUnit(
    name="unscheduled_requests_refused",
    broke="prompts the scheduler never ran get empty states, and shift the next call's rows",
    affects="",
    delete_when="speculators checks that every request of a batch finished before it reads the captured rows",
    target=GENERATOR_MODULE,
    sides=("driver",),
    condition="speculators 0.3.0's own omission: every vLLM release",
    silent=True,
    apply=_apply,
)
