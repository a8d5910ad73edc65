"""Chunked prefill on by default (vLLM 0.11.1+) silently truncates captured states.

speculators aborts every scheduled request after one step. With chunked prefill a batch larger than one step's
token budget is split: the chunked request is aborted after its first chunk, and its states come out short and
every later offset misaligned, with no error. 0.11.0 had it off; we pass `enable_chunked_prefill=False` wherever
the default is not False: a default of None ("vLLM decides") in a later release could mean on, and nothing after
the fact would see it (speculators aborts the half-prefilled request itself).
"""
from __future__ import annotations

from ..engine import keywords
from ._base import keyword_rewrite_unit

UNIT = keyword_rewrite_unit(
    constructor="SchedulerConfig", feature="chunked_prefill_not_off_by_default",
    rewrite=keywords.without_chunked_prefill,
    name="chunked_prefill_off",
    broke="chunked prefill is on by default: oversize batches give truncated, misaligned states with no error",
    affects=">=0.11",  # broke in 0.11.1; on 0.11.0 (default None = off) passing False changes nothing
    delete_when="speculators' call site passes enable_chunked_prefill=False (speculators >= 0.4)",
    silent=True,
)
