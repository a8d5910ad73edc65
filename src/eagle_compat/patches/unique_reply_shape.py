"""`collective_rpc(..., unique_reply_rank=0)` returns the reply itself from vLLM 0.11.1, not `[reply]`.

speculators indexes the result with `[0]`: it then takes layer 0's tensor for the list of layers, and slices
rows of the wrong object. Silent. At speculators' call site the single reply is put back in a one-element list.
"""
from __future__ import annotations

from ._base import WORKER_MODULE, executor_method_unit


def _is_speculators_rpc(method) -> bool:
    """A method of speculators' worker extension (eagle_compat's own `eagle_compat_*` RPCs expect vLLM's shape)."""
    import importlib

    ext = importlib.import_module(WORKER_MODULE).HiddenStatesWorkerExtension
    return (isinstance(method, str) and method in vars(ext) and not method.startswith("__")
            and not method.startswith("eagle_compat_"))


def collective_rpc(executor, call, args, kwargs):
    out = call(*args, **kwargs)
    method = args[0] if args else kwargs.get("method")
    # only speculators' own RPCs: the executor's internal calls (execute_model …) expect the new shape
    if kwargs.get("unique_reply_rank") is not None and not kwargs.get("non_block") and _is_speculators_rpc(method):
        return [out]
    return out


UNIT = executor_method_unit(
    method="collective_rpc", hook=collective_rpc, feature="unique_reply_returns_single",
    name="unique_reply_shape",
    broke="collective_rpc(unique_reply_rank=) returns one reply instead of a list: speculators' [0] takes the "
          "wrong object",
    affects=">=0.11.1",
    delete_when="speculators stops indexing the unique reply (speculators >= 0.4)",
    silent=True,
)
