"""Run one matrix cell inside a release's environment and print one JSON line. Used by run.py.

usage: python cell.py CHECK FAMILY [--dtype float32|auto] [--device cpu|cuda]
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# Errors that mean "this release cannot run this model in this mode on CPU at all", or that eagle_compat refuses it
# with a reason (not a capture failure): status "unsupported". Everything else that goes wrong is "fail".
# Each entry: (exact text of one known cause, what it means, shown next to the error on the generated page; "" when
# the error says it itself). No generic words ("not supported"): a capture bug must never read as a known limit.
KNOWN_CAUSES: tuple[tuple[str, str], ...] = (
    ("are not supported for now. Supported architectures", ""),  # vLLM's registry lacks the architecture
    ("UnsupportedModel", ""),  # eagle_compat's own refusal, with its reason
    ("unexpected keyword argument 'sinks'", "this release's CPU attention has no attention sinks (gpt-oss)"),
    ("expected scalar type BFloat16 but found Float", "this release's CPU MoE kernel takes bfloat16 only"),
    ("compiled extension does not load on this machine", "the wheel needs a newer C++ runtime than this machine's"),
    ("Found no NVIDIA driver", "the model code calls CUDA unconditionally"),
    ("BlockSizeAlignment == 0 (16 vs. 0)", "this release has no CPU attention kernel for this head configuration"),
    ("CPU fused-MoE AMX grouped-gemm kernel cannot be used", "this release's CPU MoE refuses float32 layers"),
    ("'layers.0.mlp.experts.w2_weight'",
     "vLLM 0.24 moved MoE expert parameters under `routed_experts` but not gpt-oss's loader for unquantized "
     "(non-MXFP4) checkpoints; fixed in 0.25 (`remap_moe_expert_weights`)"),
)
# A broken capture invariant is a failure whatever else its message says.
CAPTURE_BUG = "CaptureInvariantError"


def classify(error_text: str) -> str:
    return "unsupported" if known_cause(error_text) is not None else "fail"


def known_cause(error_text: str) -> str | None:
    """What a recorded error means, if it is a known inability of the release ("" when the error says it)."""
    if CAPTURE_BUG in (error_text or ""):
        return None
    for marker, cause in KNOWN_CAUSES:
        if marker in (error_text or ""):
            return cause
    return None


def run(check: str, family: str, dtype: str = "float32", device: str = "cpu") -> dict:
    """One cell: eagle_compat.check on the tiny model of `family`, as a JSON-able record (failures included)."""
    from eagle_compat import check as parity
    from eagle_compat import detect

    from eagle_compat import installer
    out: dict = {"check": check, "family": family, "versions": detect.installed_versions().as_dict(),
                 "device": device, "units_needed": installer.needed_units()}
    if device != "cpu":
        import torch
        out["gpu"] = torch.cuda.get_device_name(0)
    t0 = time.time()
    try:
        result = parity.run(check, family, dtype=dtype, device=device)
        if check == "generator":
            out["contract"], out["engine_dtype"] = result.contract, result.engine_dtype
        out["engine_seconds"] = result.engine_seconds
        out.update(status="pass" if result.ok else "fail", precision=result.precision,
                   errors={str(e.layer_id): {"max_abs": e.max_abs, "max_rel_to_layer_max": e.max_rel_to_layer_max}
                           for e in result.layers},
                   error=None if result.ok else "hidden states differ from HF beyond tolerance")
    except Exception as exc:  # noqa: BLE001 - every failure is a result
        text = f"{type(exc).__name__}: {exc}"
        out.update(status=classify(text),
                   error=text[:2000], traceback=traceback.format_exc()[-4000:])
    out["seconds"] = round(time.time() - t0, 1)
    return out


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("check")
    ap.add_argument("family")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    result = run(a.check, a.family, a.dtype, a.device)
    print("EAGLE_COMPAT_CELL " + json.dumps(result, default=str), flush=True)
