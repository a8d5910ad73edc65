"""A step is `execute_model()` then `sample_tokens()` from vLLM 0.11.1.

speculators calls only execute_model. The first step works; the next one fails in the worker with "State error:
sample_tokens() must be called after execute_model() returns None" (the 2nd step, or the 2nd generate()). On the
executor built at speculators' call site, execute_model is followed by sample_tokens(None) when it returns None,
exactly as EngineCore does.
"""
from __future__ import annotations

from ._base import executor_method_unit


def execute_model(executor, call, args, kwargs):
    out = call(*args, **kwargs)
    if out is None:
        out = executor.sample_tokens(None)
    return out


UNIT = executor_method_unit(
    method="execute_model", hook=execute_model, feature="two_phase_step",
    name="two_phase_step",
    broke="execute_model without sample_tokens fails on the next step ('State error: sample_tokens() must be "
          "called after execute_model() returns None')",
    affects=">=0.11.1",
    delete_when="speculators calls sample_tokens (speculators >= 0.4)",
)
