"""`SchedulerConfig(...)` without `is_encoder_decoder` fails from vLLM 0.12 (a required InitVar).

speculators builds `SchedulerConfig(max_num_seqs=, max_model_len=, max_num_batched_tokens=)`. We add
`is_encoder_decoder=False` at that call site and, where it builds the VllmConfig, refuse encoder-decoder models
(speculators' generator is decoder-only).
"""
from __future__ import annotations

from ._base import GENERATOR_MODULE, PatchUnit


def _apply(patcher, module) -> None:
    from .. import engine
    from ..errors import UnsupportedModel

    def vllm_config(wrapped, instance, args, kwargs):
        mc = kwargs.get("model_config")
        if mc is not None and getattr(mc, "is_encoder_decoder", False):
            raise UnsupportedModel(f"{mc.model}: encoder-decoder models are not supported for hidden-state capture")
        return wrapped(*args, **kwargs)

    patcher.rewrite_kwargs(module, "SchedulerConfig", lambda kw: engine.keywords.with_encoder_decoder_field(kw, False))
    patcher.wrap(module, "VllmConfig", vllm_config)


UNIT = PatchUnit(
    name="scheduler_config_encoder_decoder",
    broke="SchedulerConfig requires is_encoder_decoder, which speculators does not pass (ValidationError)",
    affects=">=0.12",
    delete_when="speculators' call site passes is_encoder_decoder (speculators >= 0.4)",
    target=GENERATOR_MODULE,
    sides=("driver",),
    feature="scheduler_config_requires_is_encoder_decoder",
    apply=_apply,
)
