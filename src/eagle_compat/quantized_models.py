"""Tiny quantized checkpoints in the formats the large targets ship, and their independent reference.

Schemes (each written by hand in its published format, from a tiny float32 checkpoint of `tiny_models`):
  fp8_block    DeepSeek-V3/R1's own format: float8_e4m3fn weights with a float32 `weight_scale_inv` per 128 x 128
               block (`quant_method: fp8`). vLLM runs it W8A8: each layer's input rounded to fp8 at run time, one
               scale per token and 128 inputs.
  fp8_dynamic  compressed-tensors `float-quantized` (llm-compressor's FP8_DYNAMIC): fp8 weights with one scale per
               output channel; inputs rounded to fp8 at run time, one scale per token.
  w4a16        compressed-tensors `pack-quantized`, int4 symmetric, one scale per 32 inputs, eight values an int32
               (Kimi-K2-Thinking / Kimi-K2.5 ship their routed experts so); inputs stay bf16.

The reference (`build` returns its path) is a plain float32 checkpoint of the same model with the dequantized
weights: what the quantized model computes, without any rounding of activations. A W8A8 engine is then judged, like
any low-precision engine (check.py), against HF's own error at the engine's arithmetic: HF in bf16 with each
quantized layer's input rounded to fp8 the same way (`rounding.ActivationRounding`, applied by
`tiny_models.hf_reference`).
"""
from __future__ import annotations

import json
import math
import os
import re

# The quantized tiny models are rows of the family table (capture/families.py: QUANTIZED), read here.
from .capture.families import QUANTIZED, QuantizedTiny
from .rounding import FP8_MAX, drop_wrapper_prefix, read_json

BLOCK = 128  # DeepSeek-V3's weight blocks and activation groups
W4_GROUP = 32
BUILD_REVISION = 2  # bump when the way quantized checkpoints are written changes (part of the cache key)

# ---- the formats: each returns (tensors to write under the weight's module name, the dequantized weight)

def quantize_fp8_block(w):
    """DeepSeek-V3's format: `weight` (fp8) and `weight_scale_inv` (float32, one per 128 x 128 block; the last row
    and column of blocks may be partial)."""
    import torch
    out, k = w.shape
    rows, cols = math.ceil(out / BLOCK), math.ceil(k / BLOCK)
    padded = torch.zeros(rows * BLOCK, cols * BLOCK, dtype=torch.float32)
    padded[:out, :k] = w.float()
    blocks = padded.reshape(rows, BLOCK, cols, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    deq = (q.float() * scale[:, None, :, None]).reshape(rows * BLOCK, cols * BLOCK)[:out, :k]
    q = q.reshape(rows * BLOCK, cols * BLOCK)[:out, :k].contiguous()
    return {"weight": q, "weight_scale_inv": scale.contiguous()}, deq


def quantize_fp8_channel(w):
    """compressed-tensors `float-quantized`, channel strategy: `weight` (fp8) and `weight_scale` [out, 1] float32."""
    import torch
    scale = w.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    q = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def pack_int4(q):
    """int8 values in [-8, 7] -> int32, eight per word along the inputs: element 8j+i in bits 4i..4i+3, offset by 8
    (compressed-tensors' `pack_to_int32`)."""
    import torch
    rows, cols = q.shape
    if cols % 8:
        raise ValueError(f"int4 packing needs a multiple of 8 inputs, got {cols}")
    u = (q.to(torch.int32) + 8).reshape(rows, cols // 8, 8)
    shifts = torch.arange(8, dtype=torch.int32) * 4
    words = (u.to(torch.int64) << shifts.to(torch.int64)).sum(dim=2)  # unsigned 32-bit values
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def quantize_w4_group(w, group: int = W4_GROUP):
    """compressed-tensors `pack-quantized`, int4 symmetric, group strategy: `weight_packed` (int32 [out, in/8]),
    `weight_scale` (bf16 [out, in/group]), `weight_shape` (int64 [2]). Scales are stored in bf16 as the format
    does; the dequantized weight uses those stored scales."""
    import torch
    out, k = w.shape
    if k % group:
        raise ValueError(f"int4 groups of {group} need a multiple of {group} inputs, got {k}")
    g = w.float().reshape(out, k // group, group)
    scale = (g.abs().amax(dim=-1) / 7.0).clamp_min(1e-12).to(torch.bfloat16)
    q = torch.round(g / scale.float()[..., None]).clamp(-8, 7).to(torch.int8)
    deq = (q.float() * scale.float()[..., None]).reshape(out, k)
    return {"weight_packed": pack_int4(q.reshape(out, k)), "weight_scale": scale.contiguous(),
            "weight_shape": torch.tensor([out, k], dtype=torch.int64)}, deq


_QUANTIZERS = {"fp8_block": quantize_fp8_block, "fp8_dynamic": quantize_fp8_channel, "w4a16": quantize_w4_group}


def quantization_config(q: QuantizedTiny) -> dict:
    if q.scheme == "fp8_block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK]}
    if q.scheme == "fp8_dynamic":
        scheme = {"weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                              "dynamic": False, "group_size": None, "block_structure": None, "actorder": None,
                              "observer": "minmax"},
                  "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                        "dynamic": True, "group_size": None, "block_structure": None,
                                        "actorder": None, "observer": None},
                  "output_activations": None, "targets": ["Linear"], "format": "float-quantized"}
        fmt = "float-quantized"
    else:
        scheme = {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                              "group_size": W4_GROUP, "dynamic": False, "block_structure": None, "actorder": None,
                              "observer": "minmax"},
                  "input_activations": None, "output_activations": None, "targets": ["Linear"],
                  "format": "pack-quantized"}
        fmt = "pack-quantized"
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": scheme}, "ignore": list(q.ignore), "kv_cache_scheme": None,
            "global_compression_ratio": None, "sparsity_config": {}}


def cache_key(q: QuantizedTiny) -> str:
    import hashlib
    return hashlib.sha256(json.dumps([q.name, q.base, q.scheme, q.quantize, list(q.ignore), BUILD_REVISION])
                          .encode()).hexdigest()[:10]


def build(name: str) -> tuple[str, str, int]:
    """(quantized checkpoint for the engine, float32 checkpoint with its dequantized weights for the HF reference,
    number of decoder layers). Built once, cached beside the tiny models."""
    import torch
    from safetensors.torch import load_file, save_file

    from . import tiny_models
    if name not in QUANTIZED:
        raise ValueError(f"unknown quantized tiny model {name!r}; known: {sorted(QUANTIZED)}")
    q = QUANTIZED[name]
    engine_src, reference_src, n = tiny_models.build_family(q.base)
    out = os.path.join(os.path.dirname(engine_src), f"{os.path.basename(engine_src)}-{name}-{cache_key(q)}")
    ref_out = out + "-reference"
    if tiny_models.is_built(out) and tiny_models.is_built(ref_out):
        return out, ref_out, n
    pattern = re.compile(q.quantize)
    tensors = load_file(os.path.join(engine_src, "model.safetensors"))
    quantized, dequantized = {}, {}
    for key, value in tensors.items():
        if pattern.search(key) and value.dim() == 2:
            parts, deq = _QUANTIZERS[q.scheme](value)
            module = key[: -len(".weight")]
            quantized.update({f"{module}.{suffix}": t for suffix, t in parts.items()})
            dequantized[drop_wrapper_prefix(key)] = deq
        else:
            quantized[key] = value.to(torch.bfloat16) if value.is_floating_point() and value.dim() >= 2 else value
    if not dequantized:
        raise ValueError(f"{name}: the pattern {q.quantize!r} matched no weight of {engine_src}")
    reference = load_file(os.path.join(reference_src, "model.safetensors"))
    missing = set(dequantized) - set(reference)
    if missing:
        raise ValueError(f"{name}: dequantized weights missing from the reference checkpoint: {sorted(missing)[:3]}")
    reference.update(dequantized)
    # each folder published whole (tiny_models.publishing): concurrent builders never read a half-written one
    with tiny_models.publishing(ref_out, replace_incomplete=True) as building:
        tiny_models.copy_without_weights(reference_src, building)
        save_file(reference, os.path.join(building, "model.safetensors"), metadata={"format": "pt"})
    with tiny_models.publishing(out, replace_incomplete=True) as building:
        tiny_models.copy_without_weights(engine_src, building)
        save_file({k: v.contiguous() for k, v in quantized.items()}, os.path.join(building, "model.safetensors"),
                  metadata={"format": "pt"})
        config_path = os.path.join(building, "config.json")
        config = read_json(config_path)
        # where the real checkpoints keep it: Kimi-K2.5 in its text_config, the others at the top
        (config.get("text_config") or config)["quantization_config"] = quantization_config(q)
        for holder in (config, config.get("text_config") or {}):  # the checkpoint's dtype: bf16, as quantized ones ship
            for key in ("dtype", "torch_dtype"):
                if key in holder:
                    holder[key] = "bfloat16"
        with open(config_path, "w") as f:
            json.dump(config, f, indent=1)
    return out, ref_out, n
