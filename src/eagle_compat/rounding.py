"""How a W8A8 (FP8) engine rounds activations, for the reference to do the same: read from a checkpoint's
`quantization_config`, applied to an HF forward (`tiny_models.hf_reference`). A leaf module: it imports nothing of
eagle_compat, so the reference (tiny_models, check) and the checkpoint builder (quantized_models) both read it.

vLLM rounds each quantized layer's input to fp8 e4m3 at run time, one scale (amax / 448) per token and `group`
inputs (per token for compressed-tensors' FP8 dynamic, 128 for DeepSeek-V3's blocks): an error 5-7x HF's own bf16
error, a property of the checkpoint, not of the capture (docs/parity.md, "Quantized checkpoints").
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value

# Inputs a W8A8 engine keeps in 16 bits although their weight is fp8: vLLM's MLA dequantizes kv_b_proj and absorbs
# it into attention (vLLM 0.20.0 layers/attention/mla_attention.py, process_weights_after_loading)
UNROUNDED_INPUTS = r"\.kv_b_proj\.weight$"


@dataclass(frozen=True)
class ActivationRounding:
    """How a W8A8 engine rounds each quantized layer's input: to fp8 e4m3, one scale (amax / 448) per token and
    `group` inputs (0: the whole row, i.e. per token). `weights` names the quantized weights (checkpoint names,
    the wrapper's `language_model.` prefix dropped)."""
    group: int
    weights: frozenset = field(default_factory=frozenset)


def _fp8_round(x, group: int):
    """x rounded to fp8 e4m3 with a dynamic scale per row and `group` columns (0 = per row), back in x's dtype."""
    import torch
    shape, k = x.shape, x.shape[-1]
    g = group or k
    if k % g:
        raise ValueError(f"activation rounding: {k} inputs are not a multiple of the group {g}")
    v = x.reshape(-1, k // g, g).float()
    scale = v.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    q = (v / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
    return q.reshape(shape).to(x.dtype)


class rounded_activations:
    """Context manager for an HF reference forward (never the engine's): inputs of the quantized weights go through `_fp8_round` first. Works on
    `F.linear` (HF's nn.Linear and its eager experts loop both call it), matching weights by storage address, so
    fused expert tensors (transformers 5: `experts.gate_up_proj[e]`) are matched slice by slice."""

    def __init__(self, model, rounding: ActivationRounding):
        self.rounding = rounding
        self.addresses = _quantized_addresses(model, rounding.weights)
        if not self.addresses:
            raise ValueError("activation rounding matched no weight of the reference model")

    def __enter__(self):
        import torch.nn.functional as F
        self._original = original = F.linear
        addresses, group = self.addresses, self.rounding.group

        def linear(input, weight, bias=None):
            if weight.data_ptr() in addresses:
                input = _fp8_round(input, group)
            return original(input, weight, bias)

        F.linear = linear
        return self

    def __exit__(self, *exc):
        import torch.nn.functional as F
        F.linear = self._original


def _quantized_addresses(model, weights: frozenset) -> set[int]:
    out = set()
    expert = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
    for name, param in model.named_parameters():
        if name in weights:
            out.add(param.data_ptr())
            continue
        m = expert.match(name)  # fused experts: one slice per expert, quantized where expert 0's weight was
        if m and param.dim() == 3:
            first = "gate_proj" if m.group(2) == "gate_up_proj" else "down_proj"
            if f"{m.group(1)}.0.{first}.weight" in weights:
                out.update(param[e].data_ptr() for e in range(param.shape[0]))
    return out


def activation_rounding(model_dir: str) -> ActivationRounding | None:
    """The run-time input rounding a checkpoint's `quantization_config` asks for (None: inputs stay in the engine's
    dtype), with the names of its quantized weights. Read from the checkpoint, so it serves any checkpoint."""
    config = read_json(os.path.join(model_dir, "config.json"))
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not quant:
        return None
    group = None
    if quant.get("quant_method") == "fp8" and quant.get("activation_scheme", "dynamic") == "dynamic":
        group = (quant.get("weight_block_size") or [0, 0])[1]
    elif quant.get("quant_method") == "compressed-tensors":
        for g in (quant.get("config_groups") or {}).values():
            act = g.get("input_activations") or {}
            if act.get("type") == "float" and act.get("num_bits") == 8:
                group = int(act.get("group_size") or 0) if act.get("strategy") == "group" else 0
    if group is None:
        return None
    from safetensors import safe_open
    weights = set()
    for file in _weight_files(model_dir):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                if key.endswith((".weight_scale_inv", ".weight_scale")):
                    weight = drop_wrapper_prefix(key.rsplit(".", 1)[0] + ".weight")
                    if not re.search(UNROUNDED_INPUTS, weight):
                        weights.add(weight)
    return ActivationRounding(group, frozenset(weights))


def drop_wrapper_prefix(name: str) -> str:
    return name[len("language_model."):] if name.startswith("language_model.") else name


def _weight_files(model_dir: str) -> list[str]:
    return sorted(os.path.join(model_dir, f) for f in os.listdir(model_dir) if f.endswith(".safetensors"))


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)

