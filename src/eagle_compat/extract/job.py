"""`eagle-compat extract`: run the stable generator over a dataset and write training files."""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import signal
import socket
import sys
import threading
import time
from array import array
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterator

from .. import detect, leftovers, options
from .. import settings as envs  # the environment variables (job.run has its own `settings`: the run's)
from .._version import __version__
from ..errors import InvalidInput
from . import (atomic_io, conversation, directory_lock, file_hashes, formats, inputs, layers, local_runner, pipeline,
               placement, report, spool, stages, writer, written_index)
from .batch_job import EngineArgs, Runner, SampleWriting
from .record import Manifest, RunEntry, Settings

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


def _check(opts: ExtractOptions) -> None:
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


class Interrupted(KeyboardInterrupt):
    """Ctrl-C: the run stopped; every file it left is complete. The message says how to continue."""


def _stop_on_first_sigint(signum: int, frame: Any) -> None:
    # the run stops cleanly (the engine is closed, the manifest says "interrupted"); a second Ctrl-C meanwhile (a
    # worker hung in a call, a slow shutdown) ends the process at once
    signal.signal(signal.SIGINT, _end_at_once)
    raise KeyboardInterrupt


SECOND_SIGINT_MESSAGE = (b"\neagle-compat extract: interrupted again: ending now. Every sample file in --out is complete "
                         b"(a write in progress was under a temporary name, which the next run removes); rerun the "
                         b"same command with --resume to continue\n")


def _end_at_once(signum: int, frame: Any) -> None:
    """No cleanup that could hang: files are written under temporary names and renamed when whole, and the directory
    lock dies with the process. The processes the run started are ended first (SIGTERM, SIGKILL a second later): a
    hung vLLM worker does not exit with its parent, and os._exit skips every other way they are ended."""
    os.write(2, SECOND_SIGINT_MESSAGE)
    said = leftovers.end_every_tree(grace_s=1.0)
    if said:
        os.write(2, (leftovers.ended_line(said) + "\n").encode())
    os._exit(130)


def _write_json(path: str, obj: Any) -> None:
    try:
        atomic_io.atomic_write_json(path, obj)
    except OSError as exc:
        raise atomic_io.OutputWriteError(f"could not write {path}: {exc.strerror or exc}") from exc


# Below a tenth of the run (or a second), waiting for the writers is not worth a line of the summary.
WRITERS_PACE_NOTE_SHARE, WRITERS_PACE_NOTE_MIN_S = 0.10, 1.0


def writers_set_the_pace(pipeline_record: dict | None) -> str | None:
    """A sentence for the user when the writers (the disk of --out), not the engine, set the run's pace: the driver
    waited longer for writer slots than for the engine, and for a noticeable share of the run (local runs record it:
    local_runner, `this_run["pipeline"]`); None otherwise."""
    if not pipeline_record or not pipeline_record.get("seconds"):
        return None
    writers, engine = pipeline_record["driver_waited_for_writers_s"], pipeline_record["driver_waited_for_engine_s"]
    seconds = pipeline_record["seconds"]
    if writers <= engine or writers < max(WRITERS_PACE_NOTE_SHARE * seconds, WRITERS_PACE_NOTE_MIN_S):
        return None
    return (f"the writers set this run's pace: of its {seconds:.1f} s the driver waited {writers:.1f} s for a free "
            f"writer ({pipeline_record['writer_threads']} threads) and {engine:.1f} s for the engine, so the disk of "
            "--out is slower than the engine and a faster one would shorten the run (manifest.json: this run's "
            "\"pipeline\")")


def _say_waiting_once() -> Any:
    said = []

    def say(seconds: float) -> None:
        if not said:
            said.append(True)
            print("extract: waiting for writers of an earlier run that still hold this directory (orphaned --ray "
                  "actors end within seconds of their driver)", file=sys.stderr, flush=True)
    return say


def _best_effort_json(path: str, obj: Any) -> None:
    try:  # recording why a run stopped must not hide the reason it stopped (e.g. the disk is full)
        atomic_io.atomic_write_json(path, obj)
    except OSError:
        pass


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json",
                   "tiktoken.model", "spiece.model", "vocab.txt")


def tokenizer_problem(model: str, exc: Exception) -> str:
    """Why the model folder's tokenizer did not load, as the folder's problem, with the fix (the whole error: never
    cut short)."""
    present = [f for f in TOKENIZER_FILES if os.path.exists(os.path.join(model, f))]
    text = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    if not present:
        fix = (f"the folder has none of the tokenizer's files ({', '.join(TOKENIZER_FILES[:3])}, ...): copy them from "
               "the model's repository into it")
    elif "sentencepiece" in text or "tiktoken" in text:
        fix = (f"the folder has {', '.join(present)}, which need a package this Python lacks: `pip install "
               "sentencepiece tiktoken`, or add the model's tokenizer.json (a fast tokenizer needs neither)")
    else:
        fix = f"the folder has {', '.join(present)}: check them against the model's repository"
    return f"the tokenizer of --model {model} did not load ({text}); {fix}"


# ---- the job, in four phases: plan -> claim the directory -> run the batches -> finish the set ----


@dataclass
class RunPlan:
    """Phase 1 (`plan`): what the run will do, decided from the options, the model and the input before --out is
    touched (a refused run leaves it exactly as it was)."""
    opts: ExtractOptions  # the model a local folder, gpu_memory_utilization resolved
    fmt: Any  # the format object (formats.get)
    text_config: Any
    num_layers: int
    hidden_size: int
    vocab_size: int
    layer_ids: list[int]
    max_len: int
    max_len_note: dict  # where --max-len came from (the manifest's "max_len")
    settings: Settings  # what every run adding files to the directory must share (settings_of)
    data: inputs.Dataset  # its samples read from the spool (spool.Samples) when asked for
    placed: placement.PlacedSamples  # the set's samples with their places (index; row: rank in input order)
    mine: placement.Batches  # this shard's batches, fixed by position
    left_out_lines: dict[int, int]  # samples the input has but the set leaves out: index -> input line
    spool_key: dict  # what made this read of the input (spool.key): a spool in --out with this key stands for it
    spool_made: spool.Builder | None  # this run's reading of the input, to keep in --out; None: read back from it
    # the input is still being read (a new set of more than READ_AHEAD_LINES lines): `data` holds the samples read so
    # far, `mine` waits for the rest; its left-out lines, notes and report come with `end_reading`
    streaming: bool = False
    reading_started: float = 0.0
    # a --resume with a corrected input: the input's digest the set's record names (the only setting that differs);
    # every file already written is checked against the samples the input now gives before anything is written
    input_corrected_from: str | None = None

    @property
    def from_spool(self) -> bool:  # the input was read back from --out's spool, not tokenized again
        return self.spool_made is None

    @property
    def out(self) -> str:
        return self.opts.out

    def path_of(self, s: formats.Placed) -> str:
        return self.fmt.path(self.opts.out, s.index, s.row)

    def path_at(self, index: int, row: int) -> str:
        return self.fmt.path(self.opts.out, index, row)

    def refuse_without_resume(self) -> None:
        if self.opts.resume:
            return
        first, present = "", 0
        for path in itertools.starmap(self.path_at, self.mine.all_places()):
            if os.path.exists(path):
                first, present = first or os.path.basename(path), present + 1
        if present:
            raise writer.OutputDirectoryConflict(
                f"{self.out} already holds {present} of this run's {self.mine.sample_count()} files "
                f"({first}, ...), made with these same settings; pass --resume to continue (batches with a "
                "missing file are redone), or choose another --out")

    def every_place(self, leaving_out: Any = ()) -> Iterator[tuple[int, int]]:
        """(index, row) of each sample of the set but those whose index is in `leaving_out`."""
        return ((index, row) for row, index in enumerate(self.placed.indices) if index not in leaving_out)

    def files_present(self, places: Any) -> int:
        """How many of `places` ((index, row) pairs) have their file."""
        return sum(os.path.exists(self.path_at(index, row)) for index, row in places)

    def engine_args(self) -> EngineArgs:
        o = self.opts
        return EngineArgs(model=o.model, layer_ids=self.layer_ids, max_len=self.max_len,
                          gpu_memory_utilization=o.gpu_memory_utilization, tensor_parallel_size=o.tensor_parallel_size,
                          dtype=o.dtype, trust_remote_code=o.trust_remote_code,
                          kv_cache_memory_bytes=o.kv_cache_memory_bytes)

    def sample_writing(self, manifest: dict) -> SampleWriting:
        o = self.opts
        return SampleWriting(out=o.out, format=o.format, data=o.data, layer_ids=self.layer_ids, validate=o.validate,
                             vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                             stamp=writer.stamp_of(manifest), skip_non_finite=o.skip_non_finite)

    def description(self, num_samples: int, versions: dict) -> formats.DataDescription:
        """What data_config.json says of the set: the engine the runners start, the input, the counts."""
        e = self.engine_args()
        return formats.DataDescription(
            model=e.model, data=self.opts.data, layer_ids=e.layer_ids, hidden_size=self.hidden_size,
            num_samples=num_samples, max_len=e.max_len, versions=versions,
            tensor_parallel_size=e.tensor_parallel_size, gpu_memory_utilization=e.gpu_memory_utilization)


def plan(opts: ExtractOptions) -> RunPlan:
    """Every check, the model's facts, the layers, --max-len, the settings record's check (read-only) and the input
    read and placed. Refusals of paths and options come before anything heavy is imported (about a second)."""
    from .. import generator  # the module, looked up at run time (the tests put a stand-in engine there)
    from ..model_source import local_model_path

    opts = dataclasses.replace(opts, model=local_model_path(opts.model))  # a hub name: its cached snapshot
    _check(opts)
    if opts.gpu_memory_utilization is None:
        opts = dataclasses.replace(opts, gpu_memory_utilization=generator.default_gpu_memory_utilization())
    text_config = generator.model_text_config(opts.model, opts.trust_remote_code)
    num_layers, hidden_size = int(text_config.num_hidden_layers), int(getattr(text_config, "hidden_size", 0))
    vocab_size = int(getattr(text_config, "vocab_size", 0) or 0)
    layer_ids = _checked_layers(opts, num_layers)
    max_len, max_len_note = resolve_max_len(opts.model, text_config, opts.max_len)
    # before its digest (settings_of): a change from here to its last byte read is caught (spool.check_unchanged),
    # and one that puts the identity back by the SHA-256 of the bytes the reading consumed (spool.check_bytes_read)
    input_identity = spool.input_identity(opts.data)
    settings = settings_of(opts, layer_ids, max_len)
    # read-only first: a refused run leaves --out exactly as it was (checked again under the lock by `claim`)
    corrected_from = _input_corrected_from(opts, settings)
    writer.check_directory(opts.out, settings, ("data_sha256",) if corrected_from else ())
    reading_started = time.monotonic()
    data, spool_key, spool_made, streaming = _read_input(opts, max_len, vocab_size, settings, input_identity)
    placed = placement.PlacedSamples(data.samples)
    # a file of a sample the set leaves out is an earlier run's, made from other tokens
    left_out_lines = {i["index"]: i["line"] for i in [*data.skipped, *data.few_loss_tokens] if "index" in i}
    shard_i, shard_n = opts.shard
    batch_count = -(-len(placed) // opts.batch_size)
    mine = (placement.StreamedBatches(placed, opts.batch_size, opts.shard, spool_made) if streaming else
            placement.Batches(placed, opts.batch_size, range(shard_i, batch_count, shard_n)))
    the_plan = RunPlan(opts, formats.get(opts.format), text_config, num_layers, hidden_size, vocab_size, layer_ids,
                       max_len, max_len_note, settings, data, placed, mine, left_out_lines, spool_key, spool_made,
                       streaming, reading_started, corrected_from)
    the_plan.refuse_without_resume()
    return the_plan


def _input_corrected_from(opts: ExtractOptions, settings: Settings) -> str | None:
    """The input's digest the set's record names, where a --resume continues the set with a corrected input: the
    same --data path, another SHA-256, every other setting equal (a line fixed after it stopped a streamed run, say).
    None otherwise (a run without --resume, or with other settings too, is refused by writer.check_directory)."""
    if not opts.resume or not os.path.isdir(opts.out) or not writer.any_sample_file(opts.out):
        return None
    try:
        recorded = (writer.read_manifest(opts.out, mine=True) or {}).get("settings") or {}
    except InvalidInput:  # refused with its reason by check_directory
        return None
    differences = writer.settings_differences(recorded, settings)
    corrected = [d.split(":")[0] for d in differences] == ["data_sha256"]
    return recorded["data_sha256"] if corrected else None


def _checked_layers(opts: ExtractOptions, num_layers: int) -> list[int]:
    """--layers (or the default) checked against the model and for training; an earlier release's directory made
    with layers that would train a drafter wrongly is named as such."""
    layer_ids = (options.default_layer_ids(num_layers) if opts.layers is None
                 else options.validate_layer_ids(opts.layers, num_layers))
    try:
        options.check_training_layers(layer_ids, num_layers, "--layers")
    except InvalidInput as exc:
        try:
            earlier = (writer.read_manifest(opts.out) if os.path.isdir(opts.out) else None) or {}
        except InvalidInput:  # a record that cannot be read: the layers' own refusal says enough
            earlier = {}
        if (earlier.get("settings") or {}).get("layer_ids") == layer_ids:  # --resume of an earlier release's run
            raise InvalidInput(f"{exc}. {opts.out} was made with these layers by an earlier release, which did not "
                               "check them: its files would train a drafter wrongly, so it is not continued. Start a "
                               "new --out; a complete set holding layer N-1 can be rewritten in ascending order by "
                               "`eagle-compat convert` instead") from None
        raise
    return layer_ids


# An input of more lines than this is read while the batches run (the first batch waits for its samples, not for the
# whole input); a smaller one is read and checked whole before --out is touched.
READ_AHEAD_LINES = 20_000


def _read_input(opts: ExtractOptions, max_len: int, vocab_size: int, settings: dict,
                input_identity: tuple) -> tuple[inputs.Dataset, dict, spool.Builder | None, bool]:
    """The input, read and tokenized with the model's tokenizer (pre-tokenized lines need none) on a thread of its
    own, with its stage lines and notes; or read back from the spool an earlier run of this set left in --out, where
    everything that made it is unchanged (spool.py). Either way the samples stay on disk (an unnamed file beside
    --out until the run claims it), read when asked for. A new set (no sample file in --out, run here) whose input
    has more than READ_AHEAD_LINES lines is not waited for: its reading goes on while the batches run (`streaming`).
    Returns (data, the spool's key for this read, this read's spool to keep in --out, or None where it came from
    there, whether the reading goes on). `input_identity`: the input's, from before its digest was taken; a reading
    whose input differs from it at its last byte, or whose bytes read are not those of the settings' data_sha256,
    fails (spool.InputChanged)."""
    tokenizer_error = ""
    reading_started = time.monotonic()  # (plan's, to the same tenth of a second)
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(opts.model, trust_remote_code=opts.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - pre-tokenized input does not need one; conversations say why
        tokenizer, tokenizer_error = None, tokenizer_problem(opts.model, exc)
    chat_format = inputs.chat_format_of(opts.model)
    spool_key = spool.key(settings["data_sha256"], opts.model, tokenizer, {
        "max_len": max_len, "vocab_size": vocab_size, "skip_uncovered": opts.skip_uncovered,
        "validate": opts.validate, "min_loss_tokens": opts.min_loss_tokens, "loss_mask": opts.loss_mask,
        "trust_remote_code": opts.trust_remote_code, **spool.chat_format_key(chat_format)})
    data = spool.load(opts.out, spool_key) if os.path.isdir(opts.out) else None
    if data is not None:
        spool.check_bytes_read(opts.data, settings["data_sha256"], data)  # (its key holds the bytes it was read from)
        stages.say(f"input read back from {spool.SPOOL_FILE} in --out (tokenized by an earlier run of this set, "
                   "from the same input, tokenizer and options)")
        _say_input(opts, data, reading_started)
        return data, spool_key, None, False
    streamable = opts.ray is None and not writer.any_sample_file(opts.out)
    if streamable:  # a line the streamed reading met late would stop the run after batches ran: every line first
        _check_lines(opts, max_len, vocab_size)
    made = _new_spool(opts.out)
    try:
        with stages.counting("reading and tokenizing the input", None, "line") as lines_read:
            made.start(inputs.read_dataset, opts.data, tokenizer, max_len, vocab_size=vocab_size,
                       skip_uncovered=opts.skip_uncovered, check_decoded=opts.validate,
                       min_loss_tokens=opts.min_loss_tokens, loss_mask=opts.loss_mask, tokenizer_error=tokenizer_error,
                       chat_format=chat_format,
                       on_line=lines_read.add,
                       watched=(opts.data, input_identity, settings["data_sha256"]))
            ended = made.wait_lines(READ_AHEAD_LINES + 1 if streamable else None)
        if not ended:
            stages.say(f"input: the first {made.lines:,} lines read ({stages.plural(len(made.samples), 'sample')}); "
                       "the rest is read while the batches run, and a line it cannot take stops the run there")
            return inputs.Dataset(made.samples), spool_key, made, True
        return _input_read(opts, made, spool_key, reading_started), spool_key, made, False
    except BaseException:
        made.close()
        raise


def _check_lines(opts: ExtractOptions, max_len: int, vocab_size: int) -> None:
    """Every line of the input checked for what needs no tokenizer (inputs.check_lines: JSON, UTF-8, keys and
    types, token ids inside the vocabulary) before the engine starts and before --out is made: a bad line stops the
    run here, naming it, instead of where the batches reach it."""
    started = time.monotonic()
    with stages.counting("checking the input's lines (JSON, keys, types)", None, "line") as checked:
        lines = inputs.check_lines(opts.data, max_len, vocab_size, on_line=checked.add)
    if lines > READ_AHEAD_LINES:  # (a smaller input is read whole before anything is written: nothing to say)
        stages.say(f"input: every line's JSON, keys and types checked ({stages.plural(lines, 'line')}, "
                   f"{time.monotonic() - started:.1f} s)")


def _input_read(opts: ExtractOptions, made: spool.Builder, spool_key: dict, reading_started: float) -> inputs.Dataset:
    """The reading's end: its left-out lines and notes, the data report of every sample, the spool's header."""
    data = made.join()
    data.samples = made.done(spool_key, data)
    data.report = made.header["report"]
    _say_input(opts, data, reading_started)
    return data


def _say_input(opts: ExtractOptions, data: inputs.Dataset, reading_started: float) -> None:
    left_out = [*data.skipped, *data.few_loss_tokens]
    stages.say(f"input read: {stages.plural(len(data.samples), 'sample')}, "
               f"{stages.plural(data.samples.tokens, 'token')}"
               + (f"; {len(left_out):,} left out ({stages.lines_of(left_out)})" if left_out else "")
               + f" ({time.monotonic() - reading_started:.1f} s)")
    for note in inputs.describe_notes(data.notes):
        print(f"extract: NOTE: {opts.data}: {note}", file=sys.stderr, flush=True)


def _new_spool(out: str) -> spool.Builder:
    """An unnamed file for the tokenized input, on --out's file system (in --out, or the folder it will be made in):
    nothing is visible there until the run claims --out, and it is gone if the run stops before."""
    folder = os.path.abspath(out)
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        return spool.Builder(folder, report.Tally())
    except OSError as exc:
        raise atomic_io.OutputWriteError(f"--out {out!r}: the tokenized input cannot be written in {folder} "
                                      f"({exc.strerror or exc}); the run keeps it there, beside its files") from None


def _make_out(opts: ExtractOptions) -> None:
    try:
        os.makedirs(opts.out, exist_ok=True)
    except OSError as exc:
        raise atomic_io.OutputWriteError(f"--out {opts.out!r} cannot be made: {exc.strerror or exc}") from None
    directory_lock.refuse_others_folder(opts.out)  # again: made by another user between the checks and here
    if opts.shard[1] > 1 and (note := directory_lock.lock_scope_note(opts.out)):
        print(f"NOTE: {note}", file=sys.stderr)


@dataclass
class Claim:
    """Phase 2 (`claim`, under the directory lock): the record this run extends, the batches it does, and what
    every file of the set must hold. `manifest` is written as the run goes; `this_run` is its entry in "runs"."""
    record: Manifest | None  # the directory's record before this run (None: a new set)
    manifest: Manifest  # its keys and types: extract/record.py, checked on every record the test suite writes
    this_run: RunEntry
    todo: placement.Batches
    non_finite: dict[int, dict]  # samples left out for non-finite states (--skip-non-finite), this run's included
    states: writer.StatesExpected
    was_complete: bool
    swept: list
    versions: dict
    manifest_path: str

    def record_non_finite(self) -> None:
        """The samples this run left out for non-finite states join the directory's list (kept across runs)."""
        for entry in self.this_run["left_out_non_finite"]:
            self.non_finite.setdefault(entry["index"], entry)
        if self.non_finite:
            self.manifest["left_out_non_finite"] = sorted(self.non_finite.values(), key=lambda e: e["index"])


def _read_index(p: RunPlan, stamp: str | None, wanted: bytearray | None = None) -> written_index.IndexVerdicts:
    """For each row of the set (those `wanted` marks, or all), what the directory's index says of its file: vouched
    for (written by one of its runs for these tokens, unchanged since: name, size, times, inode), and else the digest
    of the bytes such a run wrote there, to compare once the file is opened. The index's lines are read in the order
    written, the last of a sample deciding (a batch redone wrote it again); a sample's tokens are read only where a
    line is of its file. Nothing is vouched for under --verify-kept (every file is opened, and its bytes compared)."""
    verdicts = written_index.IndexVerdicts(len(p.placed))
    for entry in written_index.index_entries(p.out):
        row = p.placed.position_of(entry["i"])
        if row is None or (wanted is not None and not wanted[row]):
            continue
        verdicts.forget(row)
        path = p.path_at(entry["i"], row)
        if not written_index.entry_names_file(entry, p.out, path, stamp):
            continue
        unchanged = not p.opts.verify_kept and written_index.entry_matches_file(entry, p.out, path, stamp)
        if unchanged or entry.get("h"):
            s = p.placed[row]
            _, ids, mask, _ = p.fmt.expected(p.out, s.index, s.row, s.input_ids, s.loss_mask, "")
            if entry.get("d") == written_index.tokens_digest(ids, mask):  # a line of other tokens: the file is opened
                verdicts.note(row, unchanged, entry.get("h"))
    return verdicts


def claim(p: RunPlan) -> Claim:
    """Under the directory lock: the record checked again (another run may have written since `plan`), temporary
    files swept, the batches to do chosen (a batch is redone whole if any of its files is missing: its composition,
    hence its numbers, never change), the kept files checked, and the manifest written before the first sample."""
    opts = p.opts
    versions = detect.installed_versions().as_dict()
    # again: another run may have written between the checks (and a dead run's writers, until they end)
    waited = directory_lock.wait_for_other_writers(opts.out, on_wait=_say_waiting_once())
    p.input_corrected_from = _input_corrected_from(opts, p.settings)  # again: another run may have recorded it
    record = writer.check_directory(opts.out, p.settings, ("data_sha256",) if p.input_corrected_from else ())
    was_complete = (record or {}).get("status") == "complete"  # before this run's entry says "running"
    p.refuse_without_resume()
    replaced = writer.read_manifest(opts.out) if record is None else None  # one whose runs wrote no file
    swept = writer.sweep_temp_files(opts.out)
    written_index.drop_index_of_another_user(opts.out)
    _read_whole_where_others_wrote(p)
    # samples an earlier run left out for non-finite states (--skip-non-finite) stay out: the record says so
    non_finite = {e["index"]: e for e in (record or {}).get("left_out_non_finite") or []}
    if p.input_corrected_from:
        non_finite = _still_non_finite(p, non_finite)
    todo, kept = _todo_and_kept(p, non_finite)
    first_kept = next((p.path_at(index, row) for index, row in kept.all_places() if index not in non_finite), None)
    states = _states_expected(p, record, first_kept)
    corrected_files = _check_corrected_input(p, non_finite, states) if p.input_corrected_from else 0
    if not p.streaming:  # (a set whose input is still being read is new: no file to keep or check)
        _check_kept(p, kept, non_finite, states, record, todo)
    manifest = _manifest_for(p, record, replaced, versions, states.dtype)
    if p.input_corrected_from:
        _record_correction(p, manifest, record, non_finite, corrected_files)
    shard_i, shard_n = opts.shard
    this_run = {"shard": f"{shard_i}/{shard_n}", "pid": os.getpid(), "host": socket.gethostname(),
                "started": datetime.now(timezone.utc).isoformat(), "resume": opts.resume,
                "versions": {**versions, "eagle_compat": __version__},
                "batches_to_do": None if p.streaming else len(todo), "temp_files_swept": len(swept),
                "status": "running",
                "waited_for_earlier_writers_s": round(waited, 1), "skip_non_finite": opts.skip_non_finite,
                "left_out_non_finite": []}  # filled by the runner under --skip-non-finite
    mixed = report.versions_that_differ(manifest, versions) if record and (p.streaming or len(todo)) else {}
    if mixed:  # allowed (a kernel or capture fix may be why the run resumes), but never unsaid
        print("extract: NOTE: this directory's files so far were written with "
              + ", ".join(f"{k} {' / '.join(old)}" for k, (old, _) in mixed.items()) + "; this run uses "
              + ", ".join(f"{k} {new}" for k, (_, new) in mixed.items()) + ": the set will hold states of both "
              "(manifest.json's runs list each run's versions; `eagle-compat report` says so too)",
              file=sys.stderr, flush=True)
    manifest.setdefault("runs", []).append(this_run)
    manifest["status"] = "running"
    if p.spool_made is not None and not p.streaming:  # before the record says "running": a stop while it is kept
        _keep_spool(p)  # leaves the record as it was
    elif p.streaming:  # kept when its reading ends, by the reading's thread: a run stopped later leaves it
        p.spool_made.keep_when_read(p.out, p.spool_key)
    manifest_path = os.path.join(opts.out, writer.MANIFEST)
    _write_json(manifest_path, manifest)  # the settings record exists before the first sample does
    return Claim(record, manifest, this_run, todo, non_finite, states, was_complete, swept, versions, manifest_path)


def _todo_and_kept(p: RunPlan, non_finite: dict) -> tuple[placement.Batches, placement.Batches]:
    """This shard's batches to do and those kept: a batch with every file (or left out for non-finite states) is
    kept, any other redone whole. A set whose input is still being read is new: all of its batches are to do."""
    if p.streaming:
        return p.mine, p.mine.select(())
    whole = [all(index in non_finite or os.path.exists(p.path_at(index, row)) for index, row in p.mine.places(j))
             for j in range(len(p.mine))]
    return (p.mine.select([j for j, done in enumerate(whole) if not done]),
            p.mine.select([j for j, done in enumerate(whole) if done]))


def _read_whole_where_others_wrote(p: RunPlan) -> None:
    """A set planned as new whose directory got files since `plan` (another run, a shard, wrote there): its input is
    read to its end, and the run goes on as one that read it first."""
    if p.streaming and writer.any_sample_file(p.out):
        _read_whole(p)
        p.refuse_without_resume()


def _still_non_finite(p: RunPlan, non_finite: dict[int, dict]) -> dict[int, dict]:
    """Under a corrected input, the samples left out for non-finite states that stay out: those the input still gives
    the tokens they had when left out ("d"). Any other (its line changed, or an entry of an earlier release, which
    recorded no digest) is redone: its states were never judged for its tokens now."""
    still = {}
    for index, entry in non_finite.items():
        row = p.placed.position_of(index)
        s = p.placed[row] if row is not None else None
        if s is not None and entry.get("d") == written_index.tokens_digest(s.input_ids, s.loss_mask):
            still[index] = entry
    return still


def _check_corrected_input(p: RunPlan, non_finite: dict, states: writer.StatesExpected) -> int:
    """Under a corrected input, every sample file already in --out (any batch's, any shard's) must hold the tokens the
    input now gives its sample, before anything is written: the index vouches for a file written for these tokens and
    unchanged since, any other is opened. A file whose line changed after it was written is refused, naming it (its
    states are of the line as it was). Returns how many files were there."""
    present = bytearray(len(p.placed))
    for index, row in p.every_place(non_finite):
        present[row] = os.path.exists(p.path_at(index, row))
    verdicts = _read_index(p, states.stamp, present)
    to_read = array("q", (row for row, there in enumerate(present) if there and not verdicts.vouched[row]))
    with stages.counting("corrected input: files already written read", len(to_read), "file") as read:
        wrong = writer.first_mismatch(p.placed.files_at(p.fmt, p.out, to_read, verdicts), states, on_each=read.add)
    if wrong:
        raise writer.OutputDirectoryConflict(
            f"{wrong.path} is not the sample the corrected input gives there: {wrong.why}. --data differs from the "
            f"input the set's record names (SHA-256 {p.input_corrected_from[:16]}..., now "
            f"{p.settings['data_sha256'][:16]}...), and a file of a line changed after it was written holds the "
            "states of the line as it was. Delete it (--resume then redoes its batch), or extract this input into a "
            "new --out. Nothing was written")
    return sum(present)


def _record_correction(p: RunPlan, manifest: Manifest, record: dict | None, non_finite: dict,
                       files: int) -> None:
    """A --resume with a corrected input, said and recorded: the set's settings name the input's digest now, and
    `input_corrections` the one they named before; the samples left out for non-finite states are those still out."""
    redone = len((record or {}).get("left_out_non_finite") or []) - len(non_finite)
    redone_note = (f"; {stages.plural(redone, 'sample')} left out for non-finite states "
                   f"{'is' if redone == 1 else 'are'} redone (the input changed them)") if redone else ""
    print(f"extract: NOTE: --data {p.opts.data} is not the input the set's record names (its SHA-256 was "
          f"{p.input_corrected_from[:16]}..., now {p.settings['data_sha256'][:16]}...): the set goes on with it as a "
          f"corrected input, since each of the {files:,} files already written holds the tokens it gives their "
          f"samples{redone_note}; manifest.json records it (input_corrections)", file=sys.stderr, flush=True)
    manifest["settings"] = {**manifest["settings"], "data_sha256": p.settings["data_sha256"]}
    manifest.setdefault("input_corrections", []).append({
        "data_sha256_was": p.input_corrected_from, "data_sha256": p.settings["data_sha256"],
        "at": datetime.now(timezone.utc).isoformat(), "files_kept": files, "non_finite_redone": redone})
    if non_finite:
        manifest["left_out_non_finite"] = sorted(non_finite.values(), key=lambda e: e["index"])
    else:
        manifest.pop("left_out_non_finite", None)


def _read_whole(p: RunPlan) -> None:
    """A streamed input's reading waited for to its end (its left-out lines, notes and report join the plan): the
    plan is then that of a run that read the input first. Refused where the input changed while it was read (judged
    by the reading, at its last byte: a change after it cannot reach the samples, read from the spool)."""
    data = _input_read(p.opts, p.spool_made, p.spool_key, p.reading_started)
    p.data = data
    p.left_out_lines.update({i["index"]: i["line"] for i in [*data.skipped, *data.few_loss_tokens] if "index" in i})
    p.mine = placement.Batches(p.placed, p.opts.batch_size, p.mine.numbers)  # every batch, now it has ended
    p.streaming = False


def end_reading(p: RunPlan, c: Claim) -> None:
    """A streamed input's reading, ended (its batches all ran): its left-out lines, notes and data report join the
    plan and the record, and the spool is kept in --out. A failure here (a full disk, Ctrl-C) is recorded."""
    try:
        _read_whole(p)
        _describe_input(c.manifest, p)
        c.this_run["batches_to_do"] = len(c.todo)
        if p.spool_made.keep_error is not None:
            _spool_not_kept(p.spool_made.keep_error)
        elif p.spool_made.kept_at is None:
            _keep_spool(p)
    except BaseException as exc:
        c.this_run.update(status=f"failed when the input's reading ended: {type(exc).__name__}: {str(exc)[:300]}",
                          finished=datetime.now(timezone.utc).isoformat())
        c.manifest.update(status="incomplete", samples_present=p.files_present(p.every_place()))
        _best_effort_json(c.manifest_path, c.manifest)
        raise


SPOOL_SAID_FROM_TOKENS = 50_000_000


def _keep_spool(p: RunPlan) -> None:
    """The tokenized input into --out, for a --resume or another --shard of this set to read back. A spool that
    cannot be written costs the next run its tokenizing, nothing else: said, never fatal."""
    tokens = p.data.samples.tokens
    if tokens >= SPOOL_SAID_FROM_TOKENS:  # seconds where it cannot be linked but is copied: said, never a hang
        stages.say(f"keeping the tokenized input in --out for a resume ({stages.plural(tokens, 'token')})")
    try:
        p.spool_made.keep(p.out)
    except OSError as exc:
        _spool_not_kept(exc)


def _spool_not_kept(exc: OSError) -> None:
    print(f"extract: NOTE: the tokenized input could not be kept in --out ({exc.strerror or exc}); a --resume "
          "will tokenize the input again", file=sys.stderr, flush=True)


def _states_expected(p: RunPlan, record: dict | None, first_kept: str | None) -> writer.StatesExpected:
    """What every file must hold besides its tokens: the run's stamp, layers, hidden size, and the engine's dtype as
    the set's record (or, for an earlier release's record, its first kept file) says, known before this run's
    engine starts (and refused if it differs). A set converted from fp8 holds bfloat16 whatever its engine ran."""
    recorded_dtype = (record or {}).get("states_dtype") or (record or {}).get("engine_dtype")
    dtype_from = "the directory's engine ran"
    if not recorded_dtype and first_kept:
        try:
            recorded_dtype = writer.read_facts(first_kept).dtype
            dtype_from = f"{os.path.basename(first_kept)} (the record names none) holds"
        except Exception:  # noqa: BLE001 - an unreadable file is named by the kept-file check
            recorded_dtype = None
    # every file of a set begun by this release carries a stamp (an earlier record cannot say: a set begun before
    # stamps and resumed since holds both kinds)
    stamped = record is None or bool(record.get("stamped_files"))
    return writer.StatesExpected(writer.states_stamp(p.settings), len(p.layer_ids), p.hidden_size, recorded_dtype,
                                 dtype_from, stamped=stamped)


def _check_kept(p: RunPlan, kept: placement.Batches, non_finite: dict, states: writer.StatesExpected,
                record: dict | None, todo: placement.Batches) -> None:
    """The files kept must be of these very samples (their token ids) and made as this run's would be; the index
    vouches for those the directory's runs wrote, unchanged since: only the others are opened (every one, on
    several threads, with --verify-kept), and their bytes compared with the digest the index recorded of them. No
    stray file of another set, and no extracting into a lossy conversion."""
    opts = p.opts
    kept_rows = bytearray(len(p.placed))
    for _, row in kept.all_places():
        kept_rows[row] = 1
    index = _read_index(p, states.stamp, kept_rows) if len(kept) else written_index.IndexVerdicts(0)
    del kept_rows
    to_read = array("q", (row for i, row in kept.all_places() if i not in non_finite and not index.vouched[row]))
    with stages.counting("resume check: kept files read", len(to_read), "file") as read:
        wrong = writer.first_mismatch(p.placed.files_at(p.fmt, opts.out, to_read, index), states,
                                      threads=8 if opts.verify_kept else 1, on_each=read.add)
    if wrong and wrong.changed:
        raise writer.OutputDirectoryConflict(
            f"{wrong.path} was changed since a run of this directory wrote it: {wrong.why}. A trainer would read "
            "states no run made for it: delete it, and --resume redoes its batch. Nothing was written")
    if wrong and wrong.states:
        raise writer.OutputDirectoryConflict(
            f"{wrong.path} is not this run's: {wrong.why}. Files join a directory only from runs of the same "
            "model, --layers, --dtype and --trust-remote-code (the README's shard merge included); remove the "
            "others, or choose another --out")
    formats.refuse_strays(p.fmt, opts.out, p.placed.members(), "Nothing was written", left_out=p.left_out_lines)
    converted = (record or {}).get("converted_from") or {}
    if len(todo) and converted.get("lossy"):
        raise writer.OutputDirectoryConflict(
            f"{opts.out} was converted from {converted.get('format')} with loss ({converted['lossy']}): files "
            "extracted now would sit beside states of another precision. Complete the source and convert it "
            "again, or extract into another --out")
    if wrong:
        raise writer.OutputDirectoryConflict(
            f"{wrong.path} is not the sample it stands for: {wrong.why}. The directory's files were made from a "
            "sample set that differs from this run's (another tokenizer, transformers version, chat template "
            "or option such as --validate / --skip-uncovered): adding to it would pair rows with other "
            "samples' states. Use the same environment and options, or choose another --out")
    if len(kept):
        kept_files = kept.sample_count() - sum(i in non_finite for i, _ in kept.all_places())
        compared = sum(index.content_of(row) is not None for row in to_read)
        stages.say(f"resume: {kept.sample_count():,} of this run's files kept, "
                   f"{stages.plural(len(todo), 'batch', 'batches')} to do: "
                   + kept_files_checked(kept_files - len(to_read), len(to_read), compared))


def kept_files_checked(unchanged: int, opened: int, compared: int) -> str:
    """What the resume check did of the kept files, in words: those the index vouched for were not opened."""
    said = []
    if unchanged:
        said.append(f"{unchanged:,} unchanged since written (the index's record of their name, size, times and "
                    "inode: not opened)")
    if opened:
        without = ("no digest of their bytes recorded" if not compared else
                   f"{compared:,} of them also against the digest of their bytes as written"
                   + (f", the other {opened - compared:,} without one" if compared < opened else ""))
        why_none = (": no line of this directory's index for them, or one of an earlier release"
                    if compared < opened else "")
        said.append(f"{opened:,} opened and checked (token ids, loss mask, the states' stamp, layers, hidden size "
                    f"and dtype; {without}{why_none})")
    return ", ".join(said) or "none has a file (left out for non-finite states)"


def _manifest_for(p: RunPlan, record: dict | None, replaced: dict | None, versions: dict,
                  recorded_dtype: str | None) -> dict:
    """The directory's record as this run extends it (a new one for a new set), with this run's reading of the
    input, which every kept file was checked against (a newer transformers may cover a conversation an earlier run
    skipped): the record describes the set this run completes."""
    manifest = record or {
        "eagle_compat": __version__, "layer_convention": writer.LAYER_CONVENTION,
        "layer_ids": p.layer_ids, "num_layers": p.num_layers, "settings": p.settings, "max_len": p.max_len_note,
        "model_config": p.text_config.__dict__ if hasattr(p.text_config, "__dict__") else {},
        # every file of a set begun now carries a stamp: one without is foreign to it
        "stamped_files": True, "versions": versions, "runs": []}
    if not p.streaming:  # a streamed input's is described when its reading ends
        _describe_input(manifest, p)
    if recorded_dtype and not manifest.get("engine_dtype") and not manifest.get("states_dtype"):
        manifest["engine_dtype"] = recorded_dtype  # read from the kept files (_states_expected)
    if replaced is not None:
        manifest["replaced_record_without_files"] = {"settings": replaced.get("settings"),
                                                     "runs": replaced.get("runs", [])}
    manifest.setdefault("layers", layers.record(p.layer_ids, p.num_layers))
    for key, note in p.fmt.manifest_notes.items():
        manifest.setdefault(key, note)
    return manifest


def _describe_input(manifest: dict, p: RunPlan) -> None:
    """The record's description of the input as this run read it (what every kept file was checked against)."""
    data = p.data
    manifest.update({
        "num_samples_in_data": len(data.samples) + len(data.skipped) + len(data.few_loss_tokens),
        "num_samples": len(data.samples), "skipped_uncovered": data.skipped,
        "left_out_few_loss_tokens": [{k: v for k, v in i.items() if k != "cut"} for i in data.few_loss_tokens]})
    left_out = {"--skip-uncovered": data.skipped, "--min-loss-tokens": data.few_loss_tokens}
    manifest["report"] = data.report or report.of_samples(data.samples, p.max_len, left_out)  # the whole input's
    manifest["input_notes"] = data.notes


def runner_for(opts: ExtractOptions) -> Runner:
    """The runner that turns batches into files: here (local_runner) or on a pool of Ray actors (ray_runner); the
    engine and the writing of each sample are the plan's (batch_job.py), the same for both."""
    if opts.ray is not None:
        from . import ray_runner
        return ray_runner.extract
    return local_runner.extract


def run_batches(p: RunPlan, c: Claim) -> tuple[int, int]:
    """Phase 3: the batches to do, through the runner; a stop (Ctrl-C, an error) is recorded before it is raised."""
    if not p.streaming and not len(c.todo):
        return 0, 0
    previous_handler = None
    if threading.current_thread() is threading.main_thread():
        previous_handler = signal.signal(signal.SIGINT, _stop_on_first_sigint)
    try:
        return runner_for(p.opts)(p.opts, c.todo, p.engine_args(), p.sample_writing(c.manifest), c.manifest,
                                  c.this_run)
    except KeyboardInterrupt:
        c.record_non_finite()
        c.this_run.update(status="interrupted", finished=datetime.now(timezone.utc).isoformat())
        c.manifest.update(status="incomplete")  # first: a second Ctrl-C may come while the files are counted
        _best_effort_json(c.manifest_path, c.manifest)
        present, total = p.files_present(p.mine.all_places()), p.mine.sample_count()
        of_total = f"{present} of this run's {total}" if total is not None else f"{present} of this run's"
        raise Interrupted(f"interrupted; {of_total} files are complete in "
                          f"{p.out} (no partial file is left); rerun the same command with --resume to "
                          "continue") from None
    except directory_lock.LockFileRemoved:
        raise  # another run may hold the directory now: its record is left to it
    except BaseException as exc:
        c.record_non_finite()
        c.this_run.update(status=f"failed: {type(exc).__name__}: {str(exc)[:500]}",
                          finished=datetime.now(timezone.utc).isoformat())
        c.manifest.update(status="incomplete", samples_present=p.files_present(p.every_place()))
        _best_effort_json(c.manifest_path, c.manifest)
        of_the_reading = p.spool_made is not None and exc is p.spool_made.error
        if of_the_reading and isinstance(exc, InvalidInput) and not isinstance(exc, spool.InputChanged):  # a line
            raise InvalidInput(f"{exc}. The input was read while the batches ran (it has more than "
                               f"{READ_AHEAD_LINES:,} lines): the files written before this line are kept. Fix the "
                               "line, then rerun the same command with --resume: it goes on with the corrected input, "
                               "keeping each file whose sample it still gives the same tokens") from None
        raise
    finally:
        if previous_handler is not None:
            signal.signal(signal.SIGINT, previous_handler)


def finish(p: RunPlan, c: Claim, done_samples: int, done_tokens: int, started: float) -> dict:
    """Phase 4: the files counted and, for a whole set, checked and described for the trainer before the manifest
    says "complete" (minutes on a large set): a run that fails or is interrupted here leaves the directory
    "incomplete", and --resume finishes it. Returns the run's summary."""
    directory_lock.check_lock_held(p.out)  # before the set is checked and said complete
    if p.streaming:
        end_reading(p, c)
    c.record_non_finite()
    elapsed = time.time() - started
    present, complete = None, False
    # the set: every sample but those left out
    whole_count = p.placed.members(c.non_finite).count
    try:
        present = p.files_present(p.every_place(c.non_finite))
        complete = present == whole_count
        c.this_run.update(status="complete", finished=datetime.now(timezone.utc).isoformat(),
                          samples_written=done_samples, tokens=done_tokens, seconds=round(elapsed, 2),
                          report=report.of_samples(c.todo.samples(), p.max_len))
        if complete:
            _finish_whole_set(p, c, whole_count)
    except writer.OutputDirectoryConflict as exc:
        c.manifest.update(status="incomplete", samples_present=present)
        c.this_run.update(status=f"failed: {str(exc)[:500]}")
        _best_effort_json(c.manifest_path, c.manifest)
        raise
    except OSError as exc:
        c.manifest.update(status="incomplete", samples_present=present)
        c.this_run.update(status=f"failed: {p.fmt.finishes} could not be written: {exc.strerror or exc}")
        _best_effort_json(c.manifest_path, c.manifest)
        raise atomic_io.OutputWriteError(f"could not write {p.fmt.finishes} in {p.out}: {exc.strerror or exc}; "
                                      "rerun the same command with --resume") from exc
    except BaseException as exc:  # Ctrl-C included; never left "running"
        c.manifest.update(status="incomplete", samples_present=present)
        interrupted = isinstance(exc, KeyboardInterrupt)
        c.this_run.update(status=f"{'interrupted' if interrupted else 'failed'} while the set was checked and "
                                 f"described: {type(exc).__name__}: {str(exc)[:300]}")
        _best_effort_json(c.manifest_path, c.manifest)
        if interrupted:
            raise Interrupted(f"interrupted while the whole set was checked and {p.fmt.finishes} written; every "
                              f"sample file in {p.out} is complete; rerun the same command with --resume "
                              "to finish it") from None
        raise
    c.manifest.update(status="complete" if complete else "incomplete", samples_present=present,
                      num_samples=whole_count)
    _write_json(c.manifest_path, c.manifest)
    if not complete and p.opts.shard[1] == 1:  # every batch was this run's, and each reported its files written
        raise atomic_io.OutputWriteError(
            f"{present} of {whole_count} samples have their file in {p.out} after a run that wrote every "
            "batch: files were written where this machine cannot see them (with --ray: an --out that is not one "
            "folder shared by every node) or removed meanwhile; rerun with --resume where --out is whole")
    return {"samples": present, "samples_in_data": len(p.data.samples), "complete": complete,
            "left_out_non_finite": sorted(c.non_finite.values(), key=lambda e: e["index"]),
            "written_this_run": done_samples, "tokens_this_run": done_tokens, "seconds": round(elapsed, 2),
            "files": present, "out": p.out, "manifest": c.manifest_path, "skipped": p.data.skipped,
            "pipeline": c.this_run.get("pipeline"), "engine_start_s": c.this_run.get("engine_start_s"),
            "temp_files_swept": c.swept, "max_len": p.max_len, "shard": c.this_run["shard"],
            "report": c.manifest["report"]}


def _finish_whole_set(p: RunPlan, c: Claim, whole_count: int) -> None:
    """Every file of the set (other shards' too) checked, then the set described (data_config.json, or the Arrow
    dataset). The files of this run's batches were checked (kept) or written by it, and the index vouches for those
    the directory's runs wrote, unchanged since: only the others are read (one sample at a time, from the spool),
    and compared with the digest of the bytes written there where the index has one."""
    atomic_io.fsync_renames(p.out)
    c.states.dtype = (c.manifest.get("states_dtype") or c.manifest.get("engine_dtype")  # this run's engine's
                      or c.states.dtype)
    index = _read_index(p, c.states.stamp)
    non_finite = c.non_finite
    # counted from the first second: a set of a million files takes minutes here (quiet: nothing within a tick)
    with stages.counting("completing the set: files checked", whole_count, "file") as checked:
        p.fmt.check_whole_set(p.out, p.placed.to_check(non_finite, p.mine, index, checked.add), c.states,
                              left_out=p.left_out_lines, on_each=checked.add, members=p.placed.members(non_finite))
    del index
    # a --resume of a finished set that wrote nothing keeps its description (the command recorded in it is the one
    # that made the set)
    finishes = os.path.join(p.out, p.fmt.finishes)
    already = (c.was_complete and not len(c.todo) and not p.fmt.arrow and os.path.exists(finishes)
               and os.lstat(finishes).st_uid == os.geteuid())  # another user's is written anew
    if not already:
        with (stages.waiting(f"writing {p.fmt.finishes}", f"{p.fmt.finishes} written in {{s:.0f}} s")
              if p.fmt.arrow else contextlib.nullcontext()):  # a dataset of every row: minutes on a large set
            p.fmt.finish(p.out, p.placed.ids_and_masks(non_finite), p.description(whole_count, c.versions))
    atomic_io.fsync_renames(p.out)


def run(opts: ExtractOptions) -> dict:
    """`eagle-compat extract`: plan (nothing written) -> claim the directory (lock, record) -> run the batches
    (here or on Ray) -> finish the set."""
    started = time.time()
    the_plan = plan(opts)
    try:
        if the_plan.opts.ray is not None:  # a cluster that cannot be reached is refused before --out is written
            from . import ray_runner
            ray_runner.connect(the_plan.opts.ray or None)
        _make_out(the_plan.opts)
        with directory_lock.DirectoryLock(the_plan.out):
            the_claim = claim(the_plan)
            done_samples, done_tokens = run_batches(the_plan, the_claim)
            return finish(the_plan, the_claim, done_samples, done_tokens, started)
    finally:
        if the_plan.spool_made is not None:  # a reading still going stops; the file is let go
            the_plan.spool_made.close()
