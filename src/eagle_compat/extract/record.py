"""The extraction record (`manifest.json`): every key it may hold, with its type and what it says, in one place.

The record stays a JSON object on disk (sets of earlier releases must keep opening), so the types are `TypedDict`s:
`Manifest` for the record, `RunEntry` for each run that added to the directory. `problems()` checks a record against
them (an undeclared key, a value of another type); the test suite checks every record any test writes
(tests/conftest.py), so a key added without its line here fails there."""
from __future__ import annotations

import types
import typing
from typing import Any, TypedDict, Union


class Settings(TypedDict, total=False):
    """What every run adding files to a directory must share (extract/job_options.py: settings_of): `Manifest.settings`.
    Batches are fixed by position, so the shard layout is not one of them."""
    model: str  # the absolute path
    model_checksums: dict  # file name -> its digest (file_hashes.model_checksums)
    data: str | None  # the absolute path (None: speculators 0.3.0's own output whose data_config.json names none)
    data_sha256: str
    layer_ids: list  # speculators 0.3.0's convention
    max_len: int | None  # None: as data_config.json above
    batch_size: int
    format: str
    dtype: str
    tensor_parallel_size: int
    skip_uncovered: bool
    trust_remote_code: bool  # --trust-remote-code (absent from earlier releases' records: False)
    validate: bool  # --validate with --skip-uncovered (it then decides which conversations are left out)
    min_loss_tokens: int
    loss_mask: str  # --loss-mask (absent from earlier releases' records: "generated")
    made_by: str  # a record `convert` made for speculators 0.3.0's own output (extract/convert.py)


class RunEntry(TypedDict, total=False):
    """One run (`extract`, a shard of it, or a `--resume`) that added to the directory: `Manifest.runs`."""
    shard: str  # "I/N"
    pid: int
    host: str
    started: str  # ISO time, UTC
    finished: str
    resume: bool
    versions: dict  # vllm, torch, transformers, speculators, python, eagle_compat
    batches_to_do: int | None  # None until a streamed input has been read (job.end_reading)
    temp_files_swept: int
    status: str  # running, complete, interrupted, "failed: ..."
    waited_for_earlier_writers_s: float
    skip_non_finite: bool
    left_out_non_finite: list  # {"index", "line", "layers"...} of the samples this run left out
    engine_dtype: str
    engine_start_s: float
    pipeline: dict  # the local runner's timings (extract/pipeline.py)
    ray: dict  # the Ray pool: cluster, actors, per-actor stats, timings
    report: dict
    samples_written: int
    tokens: int
    seconds: float
    # an `eagle-compat convert` into the directory (extract/convert.py)
    convert: bool
    at: str  # ISO time, UTC
    written: int


class Manifest(TypedDict, total=False):
    """The directory's record: what made its files (`settings`, checked by every run that adds to it), what the set
    holds, and each run that added to it."""
    eagle_compat: str  # the release that began the set
    layer_convention: str
    layer_ids: list  # speculators 0.3.0's convention (leaving layer k)
    num_layers: int
    layers: dict  # both conventions and the drafter's ids (extract/layers.py: record)
    settings: Settings
    max_len: dict  # the value and where it came from
    model_config: dict
    stamped_files: bool  # every file carries its settings' stamp (sets begun since stamps)
    versions: dict  # the first run's releases
    runs: list[RunEntry]
    status: str  # running, incomplete, complete
    num_samples_in_data: int
    num_samples: int
    samples_present: int
    skipped_uncovered: list  # --skip-uncovered: {"line", "index", "reason"}
    left_out_few_loss_tokens: list  # --min-loss-tokens: {"line", "index", "loss_tokens", "reason"}
    left_out_non_finite: list  # --skip-non-finite, over every run
    report: dict  # the data report of the whole input (extract/report.py)
    input_notes: dict
    engine_dtype: str | None  # None: an engine that reported none (a stand-in, a Ray actor's stats)
    states_dtype: str  # a converted set's (convert from fp8: bfloat16 whatever the engine ran)
    decoder_contract: dict  # the capture's resolution (generator.describe)
    replaced_record_without_files: dict  # a record whose runs wrote no file, replaced by other settings
    converted_from: dict  # eagle-compat convert: the source, its format and record
    arrow_rows: str  # the Arrow layout's note (extract/formats.py: manifest_notes)
    sample_indices: list  # a record made for speculators 0.3.0's own output by convert: the files present
    # each --resume that went on with a corrected input (extract/kept_files.py: record_correction): {"data_sha256_was",
    # "data_sha256", "at", "files_kept", "non_finite_redone"}
    input_corrections: list


def _accepts(expected: Any, value: Any) -> bool:
    origin = typing.get_origin(expected)
    if origin in (Union, types.UnionType):
        return any(_accepts(arg, value) for arg in typing.get_args(expected))
    if expected is type(None):
        return value is None
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)  # JSON writes 0.0 as 0.0, others 3
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if typing.is_typeddict(expected):  # its keys are checked by `problems`
        return isinstance(value, dict)
    return isinstance(value, origin or expected)


def problems(record: dict, schema: type = Manifest, where: str = "manifest") -> list[str]:
    """What in `record` its schema does not declare, or declares of another type (the runs' entries too)."""
    hints = typing.get_type_hints(schema)
    found = []
    for key, value in record.items():
        if key not in hints:
            found.append(f"{where}: {key!r} is not declared in extract/record.py:{schema.__name__}")
        elif not _accepts(hints[key], value):
            found.append(f"{where}: {key!r} is {type(value).__name__}, declared {hints[key]}")
    if schema is not Manifest:
        return found
    if isinstance(record.get("settings"), dict):
        found += problems(record["settings"], Settings, f"{where}.settings")
    for k, run in enumerate(record.get("runs") or []):
        found += (problems(run, RunEntry, f"{where}.runs[{k}]") if isinstance(run, dict) else
                  [f"{where}.runs[{k}] is {type(run).__name__}, not an object"])
    return found
