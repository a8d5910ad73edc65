"""Several engines starting at once on one host (extraction shards, one per GPU) can be handed the same
torch.distributed port: vLLM's `get_open_port()` binds port 0, reads the number and releases it, and the worker binds
it only after it is spawned. The loser's start-up fails with EADDRINUSE (vllm#39015, vllm#43206; seen in our CI on
0.16.0, two test processes starting engines at once). From 0.28 the workers meet at a file store instead (vllm#50999).

At speculators' call site, a start of the executor it builds that lost this race is run again, on a new port (at
most `remote_errors.START_ATTEMPTS` starts). Nothing has reached the engine yet, and vLLM has ended the failed start's
workers. The same retry is in eagle_compat's own generator.
"""
from __future__ import annotations

from ._adapters import ExecutorHooks
from ._base import GENERATOR_MODULE, PatchUnit


def _apply(patcher, module) -> None:
    from .. import remote_errors

    patcher.hook_executor(module, "MultiprocExecutor", ExecutorHooks(start=remote_errors.retrying_lost_port_race))


UNIT = PatchUnit(
    name="startup_port_race",
    broke="an engine start fails with EADDRINUSE when another process on the host takes the port vLLM chose first",
    affects="<0.28",
    feature="workers_meet_at_released_port",
    delete_when="the vLLM floor is 0.28 (its workers meet at a file store)",
    target=GENERATOR_MODULE,
    sides=("driver",),
    apply=_apply,
)
