"""What a run of extract decided before touching --out (`RunPlan`: options, model facts, the input read, this shard's
batches) and what its claim of the directory found (`Claim`)."""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any, Iterator

from . import formats, inputs, placement, spool, writer
from .batch_job import EngineArgs, SampleWriting
from .job_options import ExtractOptions
from .record import Manifest, RunEntry, Settings


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
    # the input is still being read (a new set of more than input_reading.READ_AHEAD_LINES lines): `data` holds the samples read so
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
