"""extract's options as one record (`ExtractOptions`), checked before anything starts, and the set's settings they make
(with --max-len resolved against what the model takes)."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from typing import Any

from .. import options
from .. import settings as envs  # the environment variables (job.run has its own `settings`: the run's)
from ..errors import InvalidInput
from . import conversation, directory_lock, file_hashes, formats, pipeline, writer
from .record import Settings


FORMATS = tuple(formats.FORMATS)
DEFAULT_MAX_LEN = 2048  # speculators 0.3.0's data-generation default, capped by what the model takes
# the config keys vLLM derives a model's length limit from (the smallest wins)
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                 "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
# RoPE scalings whose factor extends the positions given in the config (the others leave them already scaled)
ROPE_EXTENDING = ("linear", "dynamic")


@dataclass
class ExtractOptions:
    model: str
    data: str
    out: str
    layers: list[int] | None = None
    batch_size: int = 8
    max_len: int | None = None  # None: min(DEFAULT_MAX_LEN, what the model takes)
    skip_uncovered: bool = False
    # a sample whose states hold NaN/Inf is left out (listed in the record) instead of stopping the run; not a
    # setting (it changes no state written): a --resume may add it to finish a set a non-finite sample stopped
    skip_non_finite: bool = False
    min_loss_tokens: int = 1  # a sample with fewer loss tokens (after --max-len) is left out, counted and listed
    loss_mask: str = "generated"  # conversation.LOSS_MASKS: what of each reply is trained on
    quiet: bool = False  # the CLI's default: no vLLM logs, warnings or load bar (cli.quiet_engine_output)
    resume: bool = False
    shard: tuple[int, int] = (0, 1)
    validate: bool = False
    format: str = "pt"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float | None = 0.8  # None: the device's default (the command line's)
    kv_cache_memory_bytes: int | None = None
    dtype: str = "auto"
    trust_remote_code: bool = False
    progress: bool = True
    # a --resume opens every kept file to check it (on several threads) instead of trusting the directory's index of
    # the files its runs wrote; not a setting
    verify_kept: bool = False
    writer_threads: int = pipeline.DEFAULT_THREADS
    ray: str | None = None  # --ray [ADDRESS]: None runs here; "" is Ray's default (RAY_ADDRESS or a new local cluster)
    ray_actors: int | None = None  # None: as many as the cluster's resources fit
    ray_cpus_per_actor: int | None = None  # None: one per tensor-parallel rank on CPU, 1 on GPU


def defaults() -> dict[str, Any]:
    """Each option's default, declared once (above): the command lines (`extract`, `run --online`) take theirs here."""
    return {f.name: f.default for f in dataclasses.fields(ExtractOptions)}


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
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidInput(f"--layers {text!r}: expected comma-separated ints, e.g. 2,16,29,31") from None
    if not ids:
        raise InvalidInput(f"--layers {text!r}: no layer id; expected comma-separated ints, e.g. 2,16,29,31")
    return ids


def check_options(opts: ExtractOptions) -> None:
    formats.get(opts.format)
    if opts.batch_size < 1:
        raise InvalidInput(f"--batch-size {opts.batch_size}; must be >= 1")
    if opts.skip_non_finite and opts.format in ("arrow", "arrow-fp8"):
        raise InvalidInput(f"--skip-non-finite with --format {opts.format}: Arrow rows are numbered before the run, "
                           "and a row left out would shift every later one. Extract with --format pt (or "
                           "safetensors) and --skip-non-finite, then `eagle-compat convert --to arrow`")
    conversation.check_loss_mask(opts.loss_mask, "--loss-mask")
    if not isinstance(opts.min_loss_tokens, int) or opts.min_loss_tokens < 0:
        raise InvalidInput(f"--min-loss-tokens {opts.min_loss_tokens!r}; must be an int >= 0 (0 keeps every sample)")
    if opts.max_len is not None and opts.max_len < 1:
        raise InvalidInput(f"--max-len {opts.max_len}; must be >= 1")
    if not os.path.isfile(opts.data):
        raise InvalidInput(f"--data {opts.data!r}: " + ("a directory; give the JSONL file" if os.path.isdir(opts.data)
                                                         else "no such file"))
    if not os.path.exists(opts.model):
        raise InvalidInput(f"--model {opts.model!r}: no such directory")
    if os.path.exists(opts.out) and not os.path.isdir(opts.out):
        raise InvalidInput(f"--out {opts.out!r} is a file; give a directory (new or made by extract)")
    if os.path.isdir(opts.out):
        directory_lock.refuse_others_folder(opts.out)
    if os.path.realpath(opts.out) == os.path.realpath(opts.model):  # its manifest would change the model's checksums
        raise InvalidInput(f"--out {opts.out!r} is the model's directory; give a directory of its own (the run's "
                           "records there would change the model's checksums, and no --resume would be accepted)")
    model_dir, out_dir = os.path.realpath(opts.model), os.path.realpath(opts.out)
    if os.path.commonpath([model_dir, out_dir]) == model_dir:
        raise InvalidInput(f"--out {opts.out!r} is inside the model's directory {opts.model!r}; give a folder outside "
                           "it (files written there would change the model's checksums and could be read as its own)")
    if os.path.isdir(opts.out):
        writer.refuse_foreign_folder(opts.out)
    nearest = os.path.abspath(opts.out)  # the folder --out is (or will be made) in: before the data is read
    while not os.path.exists(nearest) and os.path.dirname(nearest) != nearest:
        nearest = os.path.dirname(nearest)
    if not os.path.isdir(nearest):
        raise InvalidInput(f"--out {opts.out!r} cannot be made: {nearest} is a file")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise InvalidInput(f"--out {opts.out!r}: this user cannot write in {nearest}")
    options.check_engine_options(tensor_parallel_size=opts.tensor_parallel_size,
                                 gpu_memory_utilization=opts.gpu_memory_utilization,
                                 kv_cache_memory_bytes=opts.kv_cache_memory_bytes, dtype=opts.dtype,
                                 name=lambda option: "--" + option.replace("_", "-"))
    if opts.ray is not None:
        from . import ray_runner
        ray_runner.check_options(opts)
    else:
        given = [f"--{k.replace('_', '-')} {v}" for k, v in (("ray_actors", opts.ray_actors),
                                                             ("ray_cpus_per_actor", opts.ray_cpus_per_actor))
                 if v is not None]
        if given:
            raise InvalidInput(f"{', '.join(given)} without --ray: Ray options apply only to a run on a Ray cluster; "
                               "add --ray [ADDRESS], or leave them out")


def settings_of(opts: ExtractOptions, layer_ids: list[int], max_len: int) -> Settings:
    """What must be equal for any run to add files to a directory. Not the shard layout: batches are fixed by
    position, so any layout writes the same files (tested), and shards may finish in any order. Large weight files
    are hashed the way the directory's record says, where it has one."""
    try:
        earlier = (writer.read_manifest(opts.out) if writer.any_sample_file(opts.out) else None) or {}
    except InvalidInput:  # a record that cannot be read is refused, with its reason, by check_directory
        earlier = {}
    recorded = (earlier.get("settings") or {}).get("model_checksums")
    checksums = file_hashes.model_checksums(opts.model, recorded if isinstance(recorded, dict) else None)
    earlier_way = file_hashes.hashed_the_earlier_way(checksums)
    if earlier_way:
        print(f"extract: NOTE: {opts.out} was made by an earlier release, which hashed large weight files by size and "
              f"first and last MiB ({', '.join(earlier_way)}); it is continued that way, "
              "so a fine-tune that left both ends of each file as they were is not told from its base here. A new "
              "--out hashes each tensor's ends", file=sys.stderr, flush=True)
    return {"model": os.path.abspath(opts.model), "model_checksums": checksums,
            "data": os.path.abspath(opts.data), "data_sha256": file_hashes.file_sha256(opts.data),
            "layer_ids": layer_ids,
            "max_len": max_len, "batch_size": opts.batch_size, "format": opts.format, "dtype": opts.dtype,
            "tensor_parallel_size": opts.tensor_parallel_size, "skip_uncovered": opts.skip_uncovered,
            # the checkpoint's own config and model classes (auto_map) may build another model than transformers'
            "trust_remote_code": opts.trust_remote_code,
            # --validate also decides which conversations --skip-uncovered leaves out
            # (without --skip-uncovered a failed check stops the run: it cannot change the sample set)
            "validate": opts.validate and opts.skip_uncovered, "min_loss_tokens": opts.min_loss_tokens,
            "loss_mask": opts.loss_mask}


def model_position_limit(model: str, text_config: Any) -> tuple[int | None, str]:
    """The most positions the model takes, and where that comes from: the smallest of the config keys vLLM reads
    (times a linear/dynamic RoPE factor) and the tokenizer's model_max_length."""
    found = [(int(v), f"{k}={v} in config.json") for k in POSITION_KEYS
             if isinstance(v := getattr(text_config, k, None), (int, float)) and not isinstance(v, bool) and v > 0]
    limit, source = min(found) if found else (None, "")
    rope = getattr(text_config, "rope_scaling", None) or getattr(text_config, "rope_parameters", None)
    if limit is not None and isinstance(rope, dict):
        kind = rope.get("rope_type", rope.get("type"))
        factor = rope.get("factor")
        if kind in ROPE_EXTENDING and isinstance(factor, (int, float)) and factor > 1:
            limit, source = int(limit * factor), f"{source} x {kind} RoPE factor {factor}"
    try:
        with open(os.path.join(model, "tokenizer_config.json")) as f:
            tok_max = json.load(f).get("model_max_length")
    except (OSError, ValueError):
        tok_max = None
    if isinstance(tok_max, int) and tok_max < 10**9 and (limit is None or tok_max < limit):  # 1e30: "unset"
        limit, source = tok_max, f"model_max_length={tok_max} in tokenizer_config.json"
    return limit, source


def resolve_max_len(model: str, text_config: Any, requested: int | None) -> tuple[int, dict]:
    """--max-len, checked against the model before any engine starts; the note goes into the manifest."""
    limit, source = model_position_limit(model, text_config)
    # the engine keeps one position for the token it samples after the prompt
    allowed = None if limit is None else limit - 1
    if envs.value("VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        allowed, source = None, f"{source}; not enforced: VLLM_ALLOW_LONG_MAX_MODEL_LEN is set"
    if requested is None:
        value = DEFAULT_MAX_LEN if allowed is None else min(DEFAULT_MAX_LEN, allowed)
        how = f"default: min({DEFAULT_MAX_LEN}, the model's limit)"
    elif allowed is not None and requested > allowed:
        raise InvalidInput(f"--max-len {requested}: this model takes at most {allowed} tokens per sample ({source}; "
                           "one position is kept for the engine's sampled token). Pass --max-len "
                           f"{allowed} or less, or leave it out (default: min({DEFAULT_MAX_LEN}, {allowed}))")
    else:
        value, how = requested, "--max-len"
    return value, {"value": value, "from": how, "model_limit": allowed,
                   "model_limit_from": source or "the model's config names no position limit"}
