"""`Request(eos_token_id=...)` is rejected from vLLM 0.17: the EOS id lives in the sampling params.

At speculators' call site the id moves into `SamplingParams.update_from_generation_config`.
"""
from __future__ import annotations

from ..engine import keywords
from ._base import keyword_rewrite_unit

UNIT = keyword_rewrite_unit(
    constructor="Request", feature="request_lacks_eos_token_id", rewrite=keywords.request_kwargs,
    name="request_eos_token_id",
    broke="Request no longer takes eos_token_id (TypeError)",
    affects=">=0.17",
    delete_when="speculators stops passing eos_token_id to Request",
)
