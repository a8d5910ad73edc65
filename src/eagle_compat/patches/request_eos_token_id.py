"""`Request(eos_token_id=...)` is rejected from vLLM 0.17: the EOS id lives in the sampling params.

At speculators' call site the id moves into `SamplingParams.update_from_generation_config`.
"""
from __future__ import annotations

from ._base import GENERATOR_MODULE, PatchUnit


def _needed() -> bool:
    from .. import detect
    return not detect.feature("request_takes_eos_token_id")


def _apply(patcher, module) -> None:
    from .. import engine

    request_cls = vars(module)["Request"]
    patcher.rewrite_kwargs(module, "Request", lambda kw: engine.request_kwargs(kw, request_cls))


UNIT = PatchUnit(
    name="request_eos_token_id",
    broke="Request no longer takes eos_token_id (TypeError)",
    affects=">=0.17",
    delete_when="speculators stops passing eos_token_id to Request",
    target=GENERATOR_MODULE,
    sides=("driver",),
    needed=_needed,
    apply=_apply,
)
