"""What a runner needs to turn batches into files, derived once from the run's plan: the engine to start and the way
each sample is written. Both runners (here: `local_runner`; on a pool: `ray_runner`, whose actors receive these
records as they are) start their engine and write their samples through them, so a fact (`--max-len`, the format,
the layers) is handed to the engine and to the writer in one place.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Protocol

from . import formats, writer


@dataclass(frozen=True)
class EngineArgs:
    """The engine every runner starts: the stable generator with the run's model, layers and engine options (the
    runner calls it: the generator module is looked up at run time, where the tests put a stand-in engine)."""
    model: str  # a local folder (job.plan resolved a hub name)
    layer_ids: list[int]  # speculators 0.3.0's convention, checked by options.validate_layer_ids
    max_len: int  # the longest sample in tokens
    gpu_memory_utilization: float
    tensor_parallel_size: int
    dtype: str
    trust_remote_code: bool
    kv_cache_memory_bytes: int | None

    @property
    def max_model_len(self) -> int:
        return self.max_len + 1  # the engine samples one token after the prompt: one position more

    def keywords(self) -> dict[str, Any]:
        """`VllmHiddenStatesGenerator`'s arguments, the same for every runner."""
        return dict(model_path=self.model, layer_ids=self.layer_ids, max_model_len=self.max_model_len,
                    gpu_memory_utilization=self.gpu_memory_utilization,
                    tensor_parallel_size=self.tensor_parallel_size, dtype=self.dtype,
                    trust_remote_code=self.trust_remote_code, kv_cache_memory_bytes=self.kv_cache_memory_bytes)


@dataclass(frozen=True)
class SampleWriting:
    """How every runner writes a sample: where, in which format, checked how, stamped with which settings."""
    out: str
    format: str  # a name of formats.FORMATS (checked by the plan)
    data: str  # the input file, named in a refused sample's message with its line
    layer_ids: list[int]
    validate: bool
    vocab_size: int
    hidden_size: int
    stamp: str | None  # writer.states_stamp of the directory's settings (None: a record without settings)
    skip_non_finite: bool

    @functools.cached_property
    def fmt(self) -> formats.SampleFiles | formats.ArrowLayout:
        return formats.get(self.format)

    def path(self, s: formats.Placed) -> str:
        return self.fmt.path(self.out, s.index, s.row)

    def write(self, s: formats.Placed, result: dict) -> dict | None:
        """Writes one sample (atomically); returns its record where --skip-non-finite leaves it out. An OSError is
        the caller's to word (it knows what was written before, and where)."""
        try:
            formats.write_sample(self.fmt, self.out, s, result, self.layer_ids, data=self.data,
                                 validate=self.validate, vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                                 stamp=self.stamp)
        except writer.NonFiniteStates as exc:
            if not self.skip_non_finite:
                raise
            return formats.left_out_entry(s, exc)
        return None


class Runner(Protocol):
    """What turns a run's batches into files: `local_runner.extract` (one engine here) or `ray_runner.extract` (a
    pool of actors). It records the engine's description in `manifest` and its own figures in `this_run`, and returns
    (samples written, tokens)."""

    def __call__(self, opts: Any, todo: Any, engine_args: EngineArgs, writing: SampleWriting, manifest: dict,
                 this_run: dict) -> tuple[int, int]: ...
