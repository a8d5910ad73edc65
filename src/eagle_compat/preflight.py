"""`eagle-compat check --model PATH --preflight` / `extract --preflight`: will this checkpoint run, in seconds, before
anyone waits for its weights to load (a user waited 18 minutes for a load that then failed on a layer signature).

The checkpoint's own config (quantization, remote code, chat template and tokenizer included) with its decoder cut
to a few layers goes into a temporary directory, without weights; vLLM builds it with dummy weights
(`load_format="dummy"`), eagle_compat resolves the decoder contract on it exactly as for the real run, and one short
capture runs through every kept layer. What preflight does not check: the values (dummy weights), and layers past
the kept ones (the same classes as the kept ones: each distinct layer type is kept, and DeepSeek-style dense-first
layers are kept with the first MoE layer).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any

from . import detect
from .errors import InvalidInput

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# where multimodal wrappers keep their language model's config (Kimi-K2.5: text_config)
TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")
PROMPT_TOKENS = 16
# The preflight engine's limits: one short prompt. The real run's defaults (8192 batched tokens, 32 sequences) size
# the memory profile and the warm-up runs, which took most of a CPU preflight's engine time (measured: 11 s of 24).
PREFLIGHT_MAX_MODEL_LEN = 256
PREFLIGHT_MAX_SEQS = 1
# KV cache for that prompt, with room to spare (DeepSeek-V3's 4 kept layers without MLA: ~80 MB). Without it a CPU
# worker reserves a share of the node's memory after load and refused an 8B-shaped config on a 24 GiB machine.
PREFLIGHT_KV_BYTES = 1 << 30


# config keys that make every k-th layer another kind (the first of each kind must be kept): Gemma-3's global
# attention, Qwen-MoE's sparse layers, Llama-4's MoE and NoPE layers, DeepSeek-V2's MoE frequency
PERIOD_KEYS = ("sliding_window_pattern", "decoder_sparse_step", "interleave_moe_layer_step", "nope_layer_interval",
               "moe_layer_freq")


def layers_to_keep(text_config: dict) -> int:
    """Enough layers to build every kind the model has: 2, the dense-first layers of DeepSeek/Kimi plus one MoE layer,
    the first layer of each distinct `layer_types` entry (sliding / full attention), one period of the layer kinds
    that repeat every k layers (PERIOD_KEYS), and up to the first layer not in `mlp_only_layers`."""
    n = int(text_config["num_hidden_layers"])
    keep = 2
    dense_first = text_config.get("first_k_dense_replace")
    dense_first = dense_first if isinstance(dense_first, int) else 0
    keep = max(keep, dense_first + 1)
    kinds = text_config.get("layer_types")
    if isinstance(kinds, list) and kinds:
        keep = max(keep, max(kinds.index(k) for k in set(kinds)) + 1)
    for key in PERIOD_KEYS:
        period = text_config.get(key)
        if isinstance(period, int) and not isinstance(period, bool) and period > 1:
            keep = max(keep, dense_first + period)
    mlp_only = text_config.get("mlp_only_layers")
    if isinstance(mlp_only, list) and mlp_only:
        keep = max(keep, next((i for i in range(n) if i not in mlp_only), n - 1) + 1)
    return min(n, keep)


def cut_config(config: dict, keep: int) -> tuple[dict, int]:
    """The config with its (text) decoder cut to `keep` layers, every per-layer list cut with it; returns it and the
    layer count it had."""
    config = json.loads(json.dumps(config))
    text = next((config[k] for k in TEXT_CONFIG_KEYS if isinstance(config.get(k), dict)
                 and "num_hidden_layers" in config[k]), config)
    if "num_hidden_layers" not in text:
        raise InvalidInput("config.json has no num_hidden_layers (nor in text_config): not a decoder checkpoint")
    n = int(text["num_hidden_layers"])
    for key, value in list(text.items()):
        if isinstance(value, list) and len(value) == n and n != keep:
            text[key] = value[:keep]
    text["num_hidden_layers"] = keep
    return config, n


def config_only_copy(model: str, dest: str, keep: int | None = None) -> dict:
    """`model`'s files except its weights, into `dest`, with the decoder cut; returns what was done."""
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise InvalidInput(f"{model}: no config.json (a preflight needs the checkpoint's config)")
    with open(path) as f:
        config = json.load(f)
    text = next((config[k] for k in TEXT_CONFIG_KEYS if isinstance(config.get(k), dict)
                 and "num_hidden_layers" in config[k]), config)
    if "num_hidden_layers" not in text:
        raise InvalidInput(f"{path} has no num_hidden_layers (nor in text_config): not a decoder checkpoint")
    keep = keep or layers_to_keep(text)
    cut, n = cut_config(config, keep)
    os.makedirs(dest, exist_ok=True)
    for name in os.listdir(model):
        src = os.path.join(model, name)
        if name == "config.json" or name in WEIGHT_INDEXES or name.endswith(WEIGHT_SUFFIXES) or not os.path.isfile(src):
            continue
        shutil.copy2(src, os.path.join(dest, name))  # tokenizer, chat template, remote code, generation config
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(cut, f, indent=1)
    quant = config.get("quantization_config") or text.get("quantization_config") or {}
    return {"num_layers": n, "kept_layers": keep, "quantization": quant.get("quant_method") or quant.get("format")}


def run(model: str, *, trust_remote_code: bool = False, dtype: str = "auto", gpu_memory_utilization: float = 0.3,
        keep: int | None = None, tensor_parallel_size: int = 1, in_process: bool | None = None) -> dict:
    """The preflight of one checkpoint: the decoder contract resolved on the cut copy and one short capture.
    Returns a record with "ok"; an engine or capture failure is its "error" (type and message).

    With one rank the worker runs in this process (`in_process`, default for tensor_parallel_size 1): a spawned
    worker imports vLLM a second time, which was most of a preflight's time on the H200. The model code, its
    quantization kernels and the capture are the same either way; tensor parallel keeps one process per rank, and
    so does a CPU vLLM whose starting worker scans every module the driver loaded (detect.py:
    cpu_worker_scans_loaded_modules)."""
    import torch

    from .generator import VllmHiddenStatesGenerator
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="eagle-compat-preflight-") as tmp:
        if in_process is None:
            in_process = tensor_parallel_size == 1 and not detect.feature("cpu_worker_scans_loaded_modules")
        record: dict[str, Any] = {"model": os.path.abspath(model), **config_only_copy(model, tmp, keep),
                                  "dtype": dtype, "tensor_parallel_size": tensor_parallel_size,
                                  "worker": "in-process" if in_process else "spawned"}
        try:
            with VllmHiddenStatesGenerator(tmp, layer_ids=list(range(record["kept_layers"])),
                                           max_model_len=PREFLIGHT_MAX_MODEL_LEN,
                                           max_num_batched_tokens=PREFLIGHT_MAX_MODEL_LEN,
                                           max_num_seqs=PREFLIGHT_MAX_SEQS,
                                           kv_cache_memory_bytes=PREFLIGHT_KV_BYTES,
                                           gpu_memory_utilization=gpu_memory_utilization, dtype=dtype,
                                           trust_remote_code=trust_remote_code, load_format="dummy",
                                           tensor_parallel_size=tensor_parallel_size, in_process=in_process,
                                           show_load_progress=False) as gen:
                record["engine_seconds"] = round(time.time() - started, 1)
                record["pids"] = {"driver": os.getpid(), "workers": gen.worker_pids}
                record["contract"] = gen.describe()
                vocab = max(8, min(int(gen.vocab_size or 512), 512))
                result = gen.generate([list(range(7, 7 + PROMPT_TOKENS)) if vocab > 7 + PROMPT_TOKENS
                                       else [1] * PROMPT_TOKENS])[0]
                shapes = [tuple(h.shape) for h in result["hidden_states"]]
                record["capture"] = {"tokens": PROMPT_TOKENS, "shapes": shapes,
                                     # dummy weights: values mean nothing, but the shapes and the rows must be there
                                     "finite": all(bool(torch.isfinite(h.float()).all())
                                                   for h in result["hidden_states"])}
                record["ok"] = all(s[0] == PROMPT_TOKENS for s in shapes) and len(shapes) == record["kept_layers"]
        except Exception as exc:  # noqa: BLE001 - a preflight reports what the real run would meet
            record.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:2000]}")
    record["seconds"] = round(time.time() - started, 1)
    return record


def text(record: dict) -> str:
    head = (f"preflight {record['model']}: {'OK' if record.get('ok') else 'FAILED'} in {record['seconds']:.1f} s "
            f"({record['kept_layers']} of {record['num_layers']} layers, dummy weights"
            f"{', quantization ' + str(record['quantization']) if record.get('quantization') else ''})")
    lines = [head]
    if record.get("contract"):
        c = record["contract"]
        lines.append(f"  decoder contract: {c.get('family')} family, {c.get('layer_class')} via {c.get('base_path')}, "
                     f"output {c.get('output_kind')}, signature {c.get('layer_signature')}")
        for w in c.get("workarounds", []):
            lines.append(f"  workaround: {w}")
    if record.get("capture"):
        cap = record["capture"]
        lines.append(f"  capture of {cap['tokens']} tokens: {len(cap['shapes'])} layers, shapes {cap['shapes'][:2]}"
                     f"{' ...' if len(cap['shapes']) > 2 else ''}")
    if record.get("error"):
        lines.append(f"  error: {record['error']}")
    return "\n".join(lines)
