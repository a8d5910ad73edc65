"""speculators 0.3.0 cannot be imported with transformers 5.

Its pydantic models evaluate `PreTrainedConfig`'s annotation `dtype: str | torch.dtype | None`, whose `torch` is
imported in `transformers.configuration_utils` only under TYPE_CHECKING → `PydanticUndefinedAnnotation: name
'torch' is not defined`. Making `torch` resolvable in that module's namespace fixes the import. Applied when
transformers.configuration_utils is imported, i.e. before speculators finishes importing it.
"""
from __future__ import annotations

from ._base import PatchUnit


def _apply(patcher, module) -> None:
    if "torch" not in vars(module):
        import torch
        patcher.set(module, "torch", torch)


UNIT = PatchUnit(
    name="transformers5_pydantic_torch",
    needs_vllm=False,
    broke="speculators 0.3.0 fails at import under transformers 5 (pydantic cannot resolve `torch`)",
    affects="",
    condition="transformers >= 5 (vLLM >= 0.24 requires it; 0.20-0.23 allow it)",
    delete_when="the speculators floor supports transformers 5",
    target="transformers.configuration_utils",
    at_startup=True,
    feature="transformers_config_annotates_unimported_torch",
    apply=_apply,
)
