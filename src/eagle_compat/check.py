"""Does extraction on the installed vLLM equal HF transformers? The one check behind `eagle-compat check`, the pytest
plugin (`eagle_compat.pytest_plugin`) and the compatibility matrix's cells (`compat_matrix/cell.py`).

`check="shim"` runs unmodified speculators 0.3.0 under `install()` (it passes dtype auto: bf16 on CPU for float32
checkpoints); `check="generator"` runs `eagle_compat.VllmHiddenStatesGenerator` (dtype as given); `check="extract"`
runs `eagle-compat extract` as a user does (its own process, token-id lines in, sample files out: the files are
what is judged; dtype as given). The reference is
HF `output_hidden_states` in float32 on the same weights (the final norm's input for the last layer).

The criterion (`judge`, the one implementation behind the check, the matrix, the demo and the tests):
* an fp32 engine: every token of every layer within FP32_ABS_TOL absolute, scaled by that token's own max |value|
  where it exceeds 1 (a trained model's outlier channels reach hundreds; one token's outlier, SmolLM2's first token
  at 24,800, must not widen the others' bound); NaN or inf anywhere fails. Where a token is over that bound, HF's
  own float32 error on it decides instead (HF in float64 on the same tokens, run only then): within FP32_OWN_FACTOR
  x that error, where larger. Rounding grows with depth where a model amplifies small differences (the tiny random
  Gemma 4: at its deepest layers HF's own float32 forward is further off float64 than the fixed bound on some tokens,
  and vLLM's as far off HF's), and no fp32 engine can be held closer to HF than HF is to the exact value;
* a bf16 (or fp16) engine: the error a low precision makes grows with depth (4x from layer 1 to layer 29 on
  SmolLM2's median, for the engine and for HF's own bf16 forward alike: docs/parity.md), so a fixed bound is
  wrong at depth. Per token, the relative error |engine - fp32| / |fp32| (L2 over the hidden size); per layer its
  median and its PERCENTILE-th percentile over all tokens, each within FACTOR x the same statistic of HF's own
  forward in the engine's dtype on the same tokens, plus FLOOR. Robust statistics, not the worst token alone: HF's
  own bf16 worst token is 1.9-5.5x its median on SmolLM2 (docs/parity.md). And the
  worst token against HF's worst token (the same FACTOR and FLOOR): a capture bug that hits a few tokens only (the
  last of each sequence, one sequence of many) moves neither the median nor the p95.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

FP32_ABS_TOL = 1e-4
FP32_OWN_FACTOR = 4.0  # fp32 engines: a token over FP32_ABS_TOL passes within this x HF's own fp32 error (vs float64)
FACTOR, FLOOR, PERCENTILE = 2.0, 2e-3, 95  # low-precision engines: within FACTOR x HF's own error at that dtype + FLOOR
BF16_REL_TOL = 5e-2  # only for engine-vs-engine comparisons in one dtype (batch shapes, native files): no reference
CHECKS = ("shim", "generator", "extract")


REAL_CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "user", "content": "Give me three tips for writing clear code."},
     {"role": "assistant", "content": "Name things for what they do, keep functions short, and write the test "
                                      "before the fix."}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Name a colour of the rainbow."},
     {"role": "assistant", "content": "Indigo."}],
]


def real_prompts(model: str) -> list[list[int]]:
    """Conversations through the model's own chat template: what a real model sees in training data."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    return [list(tok.apply_chat_template(c, tokenize=True, return_dict=False)) for c in REAL_CONVERSATIONS]


def default_prompts() -> list[list[int]]:
    import random
    rng = random.Random(11)
    return [[rng.randrange(7, 512) for _ in range(rng.randint(10, 120))] for _ in range(4)]


@dataclass
class LayerError:
    layer_id: int
    max_abs: float
    max_rel_to_layer_max: float
    sequence: int  # where the largest error is (fp32: the token furthest over, or nearest to, its own bound)
    token: int
    ok: bool
    over_bound: float | None = None  # fp32: that token's error / its own bound (> 1 fails)
    # fp32, where HF in float64 was run (a token over FP32_ABS_TOL): that token's HF fp32 error against float64
    reference_own_error: float | None = None
    # low-precision engines: per-token relative error statistics, the engine's and HF's own at the engine's dtype
    median: float | None = None
    high: float | None = None  # the PERCENTILE-th percentile
    reference_median: float | None = None
    reference_high: float | None = None
    worst_token: float | None = None  # the largest per-token relative error
    reference_worst_token: float | None = None

    def limits(self) -> tuple[float, float, float] | None:
        """(median, percentile, worst token) limits: FACTOR x HF's own statistic + FLOOR."""
        if self.reference_median is None:
            return None
        return tuple(FACTOR * r + FLOOR for r in (self.reference_median, self.reference_high,
                                                   self.reference_worst_token))


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
        return bool(self.layers) and all(layer.ok for layer in self.layers)  # nothing compared proves nothing

    def failures(self) -> list[str]:
        if not self.layers:
            return ["no layer was compared (empty layer_ids?)"]
        return [describe_failure(e, self.precision) for e in self.layers if not e.ok]

    def raise_if_failed(self) -> None:
        if not self.ok:
            raise AssertionError(f"{self.check} on {self.family or self.model} differs from HF transformers:\n  "
                                 + "\n  ".join(self.failures()))

    def as_dict(self) -> dict:
        return asdict(self) | {"ok": self.ok}


def describe_failure(e: LayerError, precision: str) -> str:
    head = (f"layer {e.layer_id}: max abs error {e.max_abs:.3g} ({e.max_rel_to_layer_max:.3g} of the layer's max "
            "|value|)")
    if e.reference_median is None:
        own = ("" if e.reference_own_error is None else
               f", or {FP32_OWN_FACTOR:g} x HF's own fp32 error against float64 there ({e.reference_own_error:.3g}) "
               "where larger")
        return (f"{head}; sequence {e.sequence}, token {e.token} is {e.over_bound:.3g}x its own bound (tolerance "
                f"{FP32_ABS_TOL:g} absolute, x the token's max |value| above 1{own}; {precision})")
    lim_med, lim_high, lim_worst = e.limits()
    return (f"{head} at sequence {e.sequence}, token {e.token}; per-token relative error median {e.median:.3g} "
            f"(limit {lim_med:.3g}), p{PERCENTILE} {e.high:.3g} (limit {lim_high:.3g}), worst token "
            f"{e.worst_token:.3g} (limit {lim_worst:.3g}); HF's own {precision} forward: median "
            f"{e.reference_median:.3g}, p{PERCENTILE} {e.reference_high:.3g}, worst {e.reference_worst_token:.3g} "
            f"(limit = {FACTOR:g} x HF's + {FLOOR:g})")


def _token_errors(got, want):
    """Per token: relative L2 error of `got` against `want`."""
    return (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)


def compare(results: list[dict], reference: list[list[Any]], layer_ids: list[int], precision: str,
            low_reference: list[list[Any]] | None = None,
            exact_reference: list[list[Any]] | None = None) -> list[LayerError]:
    """Per layer: the largest error over every sequence and token and where it is, judged by the criterion of the
    module docstring. `reference`: HF in fp32; `low_reference` (needed unless precision is fp32): HF in the engine's
    dtype on the same tokens; `exact_reference` (fp32 only, optional): HF in float64, whose distance to `reference`
    is HF's own fp32 error per token."""
    import torch
    if precision != "fp32" and low_reference is None:
        raise ValueError(f"a {precision} engine is judged against HF's own {precision} forward on the same tokens: "
                         "pass low_reference (judge() computes it)")
    out = []
    for j, lid in enumerate(layer_ids):
        worst, where, scale = -1.0, (0, 0), 0.0
        over_bound, over_where, own_there = -1.0, (0, 0), None
        engine_err, ref_err = [], []
        for n, (res, ref) in enumerate(zip(results, reference, strict=True)):
            got, want = res["hidden_states"][j].float(), ref[j].float()
            if got.shape != want.shape:
                raise AssertionError(f"layer {lid}, sequence {n}: shape {tuple(got.shape)}, HF has {tuple(want.shape)}")
            # NaN or inf anywhere is an infinite error (a NaN compares False with every bound and would pass)
            per_token = (got - want).abs().amax(dim=-1).nan_to_num(nan=math.inf)
            token = int(per_token.argmax())
            if per_token[token].item() > worst:
                worst, where = per_token[token].item(), (n, token)
            scale = max(scale, want.abs().max().item())
            # fp32: each token against its own largest |value| (one outlier token, e.g. a BOS of 24,800 on SmolLM2,
            # must not widen every other token's bound); the failure names the token furthest over its bound, which
            # need not be the one with the largest absolute error
            bound = FP32_ABS_TOL * want.abs().amax(dim=-1).clamp_min(1.0)
            own = None
            if exact_reference is not None:
                own = (want.double() - exact_reference[n][j].double()).abs().amax(dim=-1).float()
                bound = torch.maximum(bound, FP32_OWN_FACTOR * own)
            ratio = (per_token / bound).nan_to_num(nan=math.inf)
            token = int(ratio.argmax())
            if ratio[token].item() > over_bound:
                over_bound, over_where = ratio[token].item(), (n, token)
                own_there = None if own is None else own[token].item()
            if low_reference is not None:
                engine_err.append(_token_errors(got, want).nan_to_num(nan=math.inf))
                ref_err.append(_token_errors(low_reference[n][j].float(), want))
        rel = worst / scale if scale else worst
        if precision == "fp32":
            out.append(LayerError(lid, worst, rel, over_where[0], over_where[1], over_bound <= 1.0,
                                  over_bound=over_bound, reference_own_error=own_there))
            continue
        e, r = torch.cat(engine_err), torch.cat(ref_err)
        q = PERCENTILE / 100
        stats = dict(median=e.median().item(), high=torch.quantile(e, q).item(), reference_median=r.median().item(),
                     reference_high=torch.quantile(r, q).item(), worst_token=e.max().item(),
                     reference_worst_token=r.max().item())
        layer = LayerError(lid, worst, rel, where[0], where[1], True, **stats)
        layer.ok = all(got <= limit for got, limit in zip((layer.median, layer.high, layer.worst_token),
                                                          layer.limits()))
        out.append(layer)
    return out


def judge(results: list[dict], reference_model: str, sequences: list[list[int]], layer_ids: list[int],
          precision: str, device: str = "cpu", engine_model: str | None = None) -> list[LayerError]:
    """`results` (an engine's, in `precision`) against HF on `reference_model`: fp32, and for a low-precision engine
    also HF's own forward in that precision on the same tokens. Where `engine_model` is a W8A8 checkpoint (its
    inputs rounded to fp8 at run time), HF's own forward rounds the same inputs the same way
    (rounding.activation_rounding)."""
    from . import tiny_models
    reference = tiny_models.hf_reference(reference_model, sequences, layer_ids, device=device)
    low = None
    if precision != "fp32":
        from .rounding import activation_rounding
        rounding = activation_rounding(engine_model) if engine_model else None
        low = tiny_models.hf_reference(reference_model, sequences, layer_ids, device=device,
                                       dtype=LOW_DTYPES[precision], rounding=rounding)
    layers = compare(results, reference, layer_ids, precision, low)
    if precision == "fp32" and not all(layer.ok for layer in layers):
        # a token over the fixed bound: HF's own fp32 error on it decides (module docstring)
        exact = tiny_models.hf_reference(reference_model, sequences, layer_ids, device=device, dtype="float64")
        layers = compare(results, reference, layer_ids, precision, exact_reference=exact)
    return layers


LOW_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def precision_of(engine_dtype: str) -> str:
    text = str(engine_dtype)
    return "fp32" if "float32" in text else "fp16" if "float16" in text and "bfloat" not in text else "bf16"


def run(check: str = "shim", family: str | None = "llama", *, model: str | None = None,
        reference_model: str | None = None, layer_ids: list[int] | None = None, dtype: str = "float32",
        device: str = "cpu", prompts: list[list[int]] | None = None,
        prepare: Callable[[Any], None] | None = None, trust_remote_code: bool = False,
        max_model_len: int = 512, gpu_memory_utilization: float = 0.3) -> CheckResult:
    """Extract with `check` on a tiny model of `family` (built locally) or on `model` (a local checkpoint; its HF
    reference from `reference_model`, default the same path) and compare with HF. Engine errors propagate.
    `prepare(generator)` runs after the engine is built and before it generates (a test can poke its workers)."""
    from . import quantized_models, tiny_models
    from .errors import InvalidInput
    from .quantized_models import QUANTIZED

    if check not in CHECKS:
        raise InvalidInput(f"check {check!r}; allowed: {', '.join(CHECKS)}")
    if model is None and family in tiny_models.REAL_MODELS:  # a real pretrained model: real chat prompts
        model = tiny_models.build_real_model(family)
        prompts = prompts or real_prompts(model)
    if model is None and family in QUANTIZED:  # a quantized checkpoint; the reference: its dequantized weights
        model, reference_model, num_layers = quantized_models.build(family)
        trust_remote_code = trust_remote_code or tiny_models.needs_remote_code(family)
    elif model is None:
        if family not in tiny_models.FAMILIES + tiny_models.GPU_VARIANTS:
            allowed = tiny_models.FAMILIES + tiny_models.GPU_VARIANTS + tuple(tiny_models.REAL_MODELS) + tuple(QUANTIZED)
            raise InvalidInput(f"family {family!r}; allowed: {', '.join(allowed)}")
        model, reference_model, num_layers = tiny_models.build_family(family)
        trust_remote_code = trust_remote_code or tiny_models.needs_remote_code(family)
    else:
        from .model_facts import model_text_config
        num_layers = int(model_text_config(model, trust_remote_code).num_hidden_layers)
    reference_model = reference_model or model
    layer_ids = list(range(num_layers)) if layer_ids is None else list(layer_ids)
    batch = prompts or default_prompts()
    start = time.time()
    if check == "shim":
        results, engine_dtype, contract = _run_shim(model, layer_ids, batch, prepare, max_model_len,
                                                    gpu_memory_utilization)
    elif check == "extract":
        if prepare is not None:
            raise InvalidInput("check 'extract' runs the command line in its own process: prepare cannot reach it")
        results, engine_dtype, contract = _run_extract(model, layer_ids, batch, dtype, max_model_len,
                                                       gpu_memory_utilization, trust_remote_code)
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
    precision = precision_of(engine_dtype)
    return CheckResult(check, model, family, precision,
                       judge(results, reference_model, batch, layer_ids, precision, device=device,
                             engine_model=model),
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


def _run_extract(model, layer_ids, batch, dtype, max_model_len, gpu_memory_utilization, trust_remote_code):
    """`eagle-compat extract` in its own process on token-id lines; the sample files it writes, in line order."""
    import json
    import subprocess
    import sys
    import tempfile

    from .extract import writer

    with tempfile.TemporaryDirectory(prefix="eagle-compat-check-") as work:
        data, out = f"{work}/data.jsonl", f"{work}/out"
        with open(data, "w") as f:
            f.writelines(json.dumps({"input_ids": ids}) + "\n" for ids in batch)
        cmd = [sys.executable, "-m", "eagle_compat.cli", "extract", "--model", model, "--data", data, "--out", out,
               "--layers", ",".join(map(str, layer_ids)), "--dtype", dtype, "--max-len", str(max_model_len),
               "--gpu-memory-utilization", str(gpu_memory_utilization), "--no-progress"]
        proc = subprocess.run(cmd + ["--trust-remote-code"] * trust_remote_code, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"eagle-compat extract exited with {proc.returncode}:\n{proc.stderr[-6000:]}")
        samples = [writer.load_sample(writer.sample_path(out, i, "pt")) for i in range(len(batch))]
    return samples, str(samples[0]["hidden_states"][0].dtype), {}
