"""`collective_rpc(..., unique_reply_rank=0)` returns the reply itself from vLLM 0.11.1, not `[reply]`.

speculators indexes the result with `[0]`: it then takes layer 0's tensor for the list of layers, and slices
rows of the wrong object. Silent. At speculators' call site the single reply is put back in a one-element list.
"""
from __future__ import annotations

from ._base import GENERATOR_MODULE, WORKER_MODULE, PatchUnit


def _needed() -> bool:
    from .. import detect
    return detect.feature("unique_reply_returns_single")


def _speculators_rpc_names() -> frozenset[str]:
    import importlib

    ext = importlib.import_module(WORKER_MODULE).HiddenStatesWorkerExtension
    return frozenset(n for n in vars(ext) if not n.startswith("__"))


def _apply(patcher, module) -> None:
    speculators_rpcs = _speculators_rpc_names()

    def collective_rpc(executor, call, args, kwargs):
        out = call(*args, **kwargs)
        method = args[0] if args else kwargs.get("method")
        # only speculators' own RPCs: the executor's internal calls (execute_model …) expect the new shape
        if (method in speculators_rpcs and kwargs.get("unique_reply_rank") is not None
                and not kwargs.get("non_block")):
            return [out]
        return out

    patcher.wrap_instances(module, "MultiprocExecutor", {"collective_rpc": collective_rpc})


UNIT = PatchUnit(
    name="unique_reply_shape",
    broke="collective_rpc(unique_reply_rank=) returns one reply instead of a list: speculators' [0] takes the "
          "wrong object",
    affects=">=0.11.1",
    delete_when="speculators stops indexing the unique reply (speculators >= 0.4)",
    target=GENERATOR_MODULE,
    sides=("driver",),
    silent=True,
    needed=_needed,
    apply=_apply,
)
