"""`eagle-compat extract`: run the stable generator over a dataset and write training files."""
from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from .. import detect
from ..errors import InvalidInput
from . import inputs, pipeline, writer

FORMATS = ("pt", "safetensors")


@dataclass
class ExtractOptions:
    model: str
    data: str
    out: str
    layers: list[int] | None = None
    batch_size: int = 8
    max_len: int = 2048
    resume: bool = False
    shard: tuple[int, int] = (0, 1)
    validate: bool = False
    format: str = "pt"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.8
    kv_cache_memory_bytes: int | None = None
    dtype: str = "auto"
    trust_remote_code: bool = False
    progress: bool = True
    writer_threads: int = pipeline.DEFAULT_THREADS


def parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise InvalidInput(f"--shard {text!r}: expected I/N with integers, e.g. 0/2") from None
    if n < 1 or not 0 <= i < n:
        raise InvalidInput(f"--shard {text!r}: need 0 <= I < N")
    return i, n


def parse_layers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidInput(f"--layers {text!r}: expected comma-separated ints, e.g. 2,16,29,31") from None


def _check(opts: ExtractOptions) -> None:
    if opts.format not in FORMATS:
        raise InvalidInput(f"--format {opts.format!r}; allowed: {', '.join(FORMATS)}")
    if opts.batch_size < 1:
        raise InvalidInput(f"--batch-size {opts.batch_size}; must be >= 1")
    if opts.max_len < 1:
        raise InvalidInput(f"--max-len {opts.max_len}; must be >= 1")
    if not os.path.isfile(opts.data):
        raise InvalidInput(f"--data {opts.data!r}: no such file")
    if not os.path.exists(opts.model):
        raise InvalidInput(f"--model {opts.model!r}: no such directory")


def _sha256(path: str) -> str:
    return writer.file_sha256(path)


def settings_of(opts: ExtractOptions, layer_ids: list[int]) -> dict[str, Any]:
    """What must be equal for a resumed run to continue the same extraction."""
    return {"model": os.path.abspath(opts.model), "model_checksums": writer.model_checksums(opts.model),
            "data": os.path.abspath(opts.data), "data_sha256": _sha256(opts.data), "layer_ids": layer_ids,
            "max_len": opts.max_len, "batch_size": opts.batch_size, "format": opts.format, "dtype": opts.dtype,
            "shard": list(opts.shard), "tensor_parallel_size": opts.tensor_parallel_size}


def validate_sample(sample: dict, vocab_size: int, layer_count: int, hidden_size: int | None) -> None:
    import torch

    ids, mask, hs = sample["input_ids"], sample["loss_mask"], sample["hidden_states"]
    t = ids.shape[0]
    problems = []
    if ids.dtype != torch.long or ids.min() < 0 or (vocab_size and ids.max() >= vocab_size):
        problems.append("token ids outside the vocabulary")
    if mask.shape[0] != t or not bool(((mask == 0) | (mask == 1)).all()):
        problems.append("loss mask is not 0/1 of the sequence length")
    if len(hs) != layer_count:
        problems.append(f"{len(hs)} hidden-state tensors for {layer_count} layers")
    for k, h in enumerate(hs):
        if h.shape[0] != t or (hidden_size and h.shape[-1] != hidden_size):
            problems.append(f"hidden_states[{k}] has shape {tuple(h.shape)}, expected [{t}, {hidden_size}]")
        if not bool(torch.isfinite(h).all()):
            problems.append(f"hidden_states[{k}] has NaN or Inf")
    if problems:
        raise RuntimeError("validation failed: " + "; ".join(problems))


def speculators_data_config(opts: ExtractOptions, layer_ids: list[int], hidden_size: int, num_samples: int,
                            versions: dict) -> dict:
    """data_config.json in the shape speculators 0.3.0's data-generation script writes it (version 2.0)."""
    return {
        "version": "2.0", "generated_at": datetime.now(timezone.utc).isoformat(),
        "speculators_version": versions.get("speculators"),
        "reproducibility": {"command": " ".join(["eagle-compat", *sys.argv[1:]]),
                            "package_versions": {k: versions.get(k) for k in ("torch", "vllm", "transformers",
                                                                             "speculators")},
                            "gpu": "CPU only" if not detect.feature("cuda_available") else "cuda"},
        "model": {"target_model_path": opts.model, "tensor_parallel_size": opts.tensor_parallel_size,
                  "gpu_memory_utilization": opts.gpu_memory_utilization, "hidden_size": hidden_size},
        "data": {"train_data_path": opts.data, "seq_length": opts.max_len, "max_samples": None,
                 "num_samples": num_samples, "seed": 0,
                 "chat_template_note": "Uses tokenizer's built-in chat template"},
        "hidden_states": {"layer_ids": layer_ids,
                          "description": "Layers selected for EAGLE3 fusion and target logits"},
        "generation": {"cache_dir": ""},
        "format": {"file_pattern": "data_{idx}.pt" if opts.format == "pt" else "data_{idx}.safetensors",
                   "data_format_version": 1,
                   "schema": {"input_ids": {"dtype": "torch.long", "shape": "[seq_len]"},
                              "hidden_states": {"shape": f"list of [seq_len, {hidden_size}]",
                                                "num_tensors": len(layer_ids)},
                              "loss_mask": {"dtype": "torch.long", "shape": "[seq_len]"}}},
    }


def run(opts: ExtractOptions) -> dict:
    import torch
    from transformers import AutoTokenizer

    from ..generator import VllmHiddenStatesGenerator, default_layer_ids, model_text_config, validate_layer_ids

    started = time.time()
    _check(opts)
    text_config = model_text_config(opts.model, opts.trust_remote_code)
    num_layers, hidden_size = int(text_config.num_hidden_layers), int(getattr(text_config, "hidden_size", 0))
    vocab_size = int(getattr(text_config, "vocab_size", 0) or 0)
    layer_ids = (default_layer_ids(num_layers) if opts.layers is None
                 else validate_layer_ids(opts.layers, num_layers))
    os.makedirs(opts.out, exist_ok=True)
    manifest_path = os.path.join(opts.out, writer.manifest_name(opts.shard))
    settings = settings_of(opts, layer_ids)
    if os.path.exists(manifest_path):
        if not opts.resume:
            raise InvalidInput(f"{opts.out} already holds an extraction ({os.path.basename(manifest_path)}); pass "
                               "--resume to continue it, or choose another --out")
        import json
        with open(manifest_path) as f:
            old = json.load(f)
        diffs = writer.settings_differences(old.get("settings", {}), settings)
        if diffs:
            raise InvalidInput("refusing to resume into a directory made with other settings:\n  " + "\n  ".join(diffs))
    try:
        tokenizer = AutoTokenizer.from_pretrained(opts.model, trust_remote_code=opts.trust_remote_code)
    except Exception:  # noqa: BLE001 - pre-tokenized input does not need one
        tokenizer = None
    samples = inputs.read_samples(opts.data, tokenizer, opts.max_len)
    bad = [s.index for s in samples if vocab_size and any(t < 0 or t >= vocab_size for t in s.input_ids)]
    if bad:
        raise InvalidInput(f"samples {bad[:10]} have token ids outside the vocabulary [0, {vocab_size - 1}]")
    shard_i, shard_n = opts.shard
    batches = [samples[k: k + opts.batch_size] for k in range(0, len(samples), opts.batch_size)]
    mine = [b for k, b in enumerate(batches) if k % shard_n == shard_i]
    # a batch is redone whole if any of its files is missing: its composition, hence its numbers, never change
    todo = [b for b in mine if not all(os.path.exists(writer.sample_path(opts.out, s.index, opts.format)) for s in b)]
    versions = detect.installed_versions().as_dict()
    manifest = {"eagle_compat": __import__("eagle_compat").__version__, "layer_convention": writer.LAYER_CONVENTION,
                "layer_ids": layer_ids, "num_layers": num_layers, "settings": settings, "versions": versions,
                "model_config": text_config.__dict__ if hasattr(text_config, "__dict__") else {},
                "num_samples_in_data": len(samples), "num_samples_in_shard": sum(map(len, mine)),
                "status": "running"}
    writer.atomic_write_json(manifest_path, manifest)
    done_tokens = done_samples = 0
    if todo:
        with VllmHiddenStatesGenerator(opts.model, layer_ids=layer_ids, max_model_len=opts.max_len + 1,
                                       gpu_memory_utilization=opts.gpu_memory_utilization,
                                       tensor_parallel_size=opts.tensor_parallel_size, dtype=opts.dtype,
                                       trust_remote_code=opts.trust_remote_code,
                                       kv_cache_memory_bytes=opts.kv_cache_memory_bytes) as gen:
            manifest["decoder_contract"] = gen.describe()
            manifest["engine_dtype"] = str(gen.vllm_config.model_config.dtype)
            t_engine = time.time()
            progress = _progress(sum(map(len, todo)), opts.progress)  # after the engine start: rates mean work
            def write(s: Any, r: dict) -> None:  # on a writer thread, while the engine runs the next batch
                sample = {"input_ids": r["input_ids"], "hidden_states": r["hidden_states"],
                          "loss_mask": torch.as_tensor(s.loss_mask, dtype=torch.long)}
                if opts.validate:
                    validate_sample(sample, vocab_size, len(layer_ids), hidden_size)
                writer.save_sample(opts.out, s.index, sample, opts.format)

            with pipeline.WriterPool(opts.writer_threads) as pool, \
                    contextlib.closing(pipeline.pipelined(gen, todo, lambda s: s.input_ids)) as batches:
                for batch, results in batches:
                    for s, r in zip(batch, results):
                        pool.submit(write, s, r)
                        done_samples += 1
                        done_tokens += len(s.input_ids)
                    del results, r
                    elapsed_engine = max(time.time() - t_engine, 1e-9)
                    progress.update(len(batch), done_samples / elapsed_engine, done_tokens / elapsed_engine)
            progress.close()
    elapsed = time.time() - started
    files = [writer.sample_path(opts.out, s.index, opts.format) for b in mine for s in b]
    manifest.update(status="complete", finished=datetime.now(timezone.utc).isoformat(),
                    samples_written_this_run=done_samples, tokens_this_run=done_tokens, seconds=round(elapsed, 2))
    writer.atomic_write_json(manifest_path, manifest)
    writer.atomic_write_json(os.path.join(opts.out, "data_config.json" if shard_n == 1
                                          else f"data_config.shard-{shard_i}-of-{shard_n}.json"),
                             speculators_data_config(opts, layer_ids, hidden_size, len(files), versions))
    return {"samples": len(files), "written_this_run": done_samples, "tokens_this_run": done_tokens,
            "seconds": round(elapsed, 2), "files": len(files), "out": opts.out, "manifest": manifest_path}


class _progress:
    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="sample", desc="extract", file=sys.stderr)
            except ImportError:
                pass

    def update(self, n: int, samples_per_s: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.update(n)
            self.bar.set_postfix_str(f"{samples_per_s:,.1f} samples/s, {tokens_per_s:,.0f} tok/s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
