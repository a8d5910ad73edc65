"""speculators trusts its workers: where vLLM did not load eagle_compat's plugin in a worker (a `VLLM_PLUGINS`
allow-list without it, a worker started another way), speculators' unpatched capture runs there, and whether that
fails loudly, and how, is luck of the release.

Driver side, at speculators' call site: the executor speculators builds is asked, before speculators uses it (and
through every other unit's hooks), which capture every worker runs (`capture/handshake.py`); an unpatched worker is refused with the cause and the fix.
"""
from __future__ import annotations

from ._adapters import ExecutorHooks
from ._base import GENERATOR_MODULE, PatchUnit


def _apply(patcher, module) -> None:
    from ..capture import handshake

    # a ready check: runs once every unit's hooks are on the executor; the adapter shuts the executor down if it raises
    patcher.hook_executor(module, "MultiprocExecutor", ExecutorHooks(
        ready=lambda executor: handshake.require_patched_workers(executor.collective_rpc, "shim")))


UNIT = PatchUnit(
    name="worker_handshake",
    broke="an unpatched worker runs speculators' own capture: wrong states or an error that names neither cause nor fix",
    affects="",
    condition="acts whenever a worker runs without the plugin",
    delete_when="never while the shim patches speculators' worker extension",
    target=GENERATOR_MODULE,
    sides=("driver",),
    apply=_apply,
)
