"""Does extraction on the installed vLLM equal HF transformers? The one check behind `eagle-compat check`, the pytest
plugin (`eagle_compat.pytest_plugin`) and the compatibility matrix's cells (`compat_matrix/cell.py`).

`check="shim"` runs unmodified speculators 0.3.0 under `install()` (it passes dtype auto: bf16 on CPU for float32
checkpoints); `check="generator"` runs `eagle_compat.VllmHiddenStatesGenerator` (dtype as given). The reference is
HF `output_hidden_states` in float32 on the same weights (the final norm's input for the last layer). A layer
passes within 1e-4 absolute in fp32, or within 5e-2 of the layer's largest |value| in bf16.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

BF16_REL_TOL, FP32_ABS_TOL = 5e-2, 1e-4
CHECKS = ("shim", "generator")


def default_prompts() -> list[list[int]]:
    import random
    rng = random.Random(11)
    return [[rng.randrange(7, 512) for _ in range(rng.randint(10, 120))] for _ in range(4)]


@dataclass
class LayerError:
    layer_id: int
    max_abs: float
    max_rel_to_layer_max: float
    sequence: int  # where the largest error is
    token: int
    ok: bool


@dataclass
class CheckResult:
    check: str
    model: str
    family: str | None
    precision: str
    layers: list[LayerError]
    engine_dtype: str = ""
    contract: dict = field(default_factory=dict)
    engine_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(layer.ok for layer in self.layers)

    def failures(self) -> list[str]:
        tol = f"{FP32_ABS_TOL:g} absolute" if self.precision == "fp32" else f"{BF16_REL_TOL:g} of the layer's max"
        return [f"layer {e.layer_id}: max abs error {e.max_abs:.3g} ({e.max_rel_to_layer_max:.3g} of the layer's max "
                f"|value|) at sequence {e.sequence}, token {e.token}; tolerance {tol} ({self.precision})"
                for e in self.layers if not e.ok]

    def raise_if_failed(self) -> None:
        if not self.ok:
            raise AssertionError(f"{self.check} on {self.family or self.model} differs from HF transformers:\n  "
                                 + "\n  ".join(self.failures()))

    def as_dict(self) -> dict:
        return asdict(self) | {"ok": self.ok}


def compare(results: list[dict], reference: list[list[Any]], layer_ids: list[int], precision: str) -> list[LayerError]:
    """Per layer: the largest error over every sequence and token, and where it is."""
    out = []
    for j, lid in enumerate(layer_ids):
        worst, where, scale = -1.0, (0, 0), 0.0
        for n, (res, ref) in enumerate(zip(results, reference, strict=True)):
            got, want = res["hidden_states"][j].float(), ref[j].float()
            if got.shape != want.shape:
                raise AssertionError(f"layer {lid}, sequence {n}: shape {tuple(got.shape)}, HF has {tuple(want.shape)}")
            per_token = (got - want).abs().amax(dim=-1)
            token = int(per_token.argmax())
            if per_token[token].item() > worst:
                worst, where = per_token[token].item(), (n, token)
            scale = max(scale, want.abs().max().item())
        rel = worst / scale if scale else worst
        ok = worst <= FP32_ABS_TOL if precision == "fp32" else rel <= BF16_REL_TOL
        out.append(LayerError(lid, worst, rel, where[0], where[1], ok))
    return out


def run(check: str = "shim", family: str | None = "llama", *, model: str | None = None,
        reference_model: str | None = None, layer_ids: list[int] | None = None, dtype: str = "float32",
        device: str = "cpu", prompts: list[list[int]] | None = None,
        prepare: Callable[[Any], None] | None = None, trust_remote_code: bool = False,
        max_model_len: int = 512, gpu_memory_utilization: float = 0.3) -> CheckResult:
    """Extract with `check` on a tiny model of `family` (built locally) or on `model` (a local checkpoint; its HF
    reference from `reference_model`, default the same path) and compare with HF. Engine errors propagate.
    `prepare(generator)` runs after the engine is built and before it generates (a test can poke its workers)."""
    from . import tiny_models
    from .errors import InvalidInput

    if check not in CHECKS:
        raise InvalidInput(f"check {check!r}; allowed: {', '.join(CHECKS)}")
    if model is None:
        if family not in tiny_models.FAMILIES:
            raise InvalidInput(f"family {family!r}; allowed: {', '.join(tiny_models.FAMILIES)}")
        model, reference_model, num_layers = tiny_models.build_family(family)
        trust_remote_code = trust_remote_code or family == "kimi_k25"
    else:
        from .generator import model_text_config
        num_layers = int(model_text_config(model, trust_remote_code).num_hidden_layers)
    reference_model = reference_model or model
    layer_ids = list(range(num_layers)) if layer_ids is None else list(layer_ids)
    batch = prompts or default_prompts()
    start = time.time()
    if check == "shim":
        results, engine_dtype, contract = _run_shim(model, layer_ids, batch, prepare, max_model_len,
                                                    gpu_memory_utilization)
    else:
        from .generator import VllmHiddenStatesGenerator
        with VllmHiddenStatesGenerator(model, layer_ids=layer_ids, max_model_len=max_model_len, dtype=dtype,
                                       gpu_memory_utilization=gpu_memory_utilization,
                                       trust_remote_code=trust_remote_code) as gen:
            if prepare is not None:
                prepare(gen)
            results = gen.generate(batch)
            engine_dtype, contract = str(gen.vllm_config.model_config.dtype), gen.describe()
    engine_seconds = round(time.time() - start, 1)
    precision = "fp32" if "float32" in engine_dtype else "bf16"
    reference = tiny_models.hf_reference(reference_model, batch, layer_ids, device=device)
    return CheckResult(check, model, family, precision, compare(results, reference, layer_ids, precision),
                       engine_dtype, contract, engine_seconds)


def _run_shim(model, layer_ids, batch, prepare, max_model_len, gpu_memory_utilization):
    from .installer import install, is_installed, uninstall

    installed_here = not is_installed()
    install()
    try:
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
        gen = VllmHiddenStatesGenerator(model, layer_ids=layer_ids, max_model_len=max_model_len,
                                        gpu_memory_utilization=gpu_memory_utilization)
        try:
            if prepare is not None:
                prepare(gen)
            results = gen.generate(batch)
            return results, str(gen.vllm_config.model_config.dtype), {}
        finally:
            gen.executor.shutdown()
    finally:
        if installed_here:
            uninstall()
