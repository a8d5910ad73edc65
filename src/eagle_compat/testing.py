"""The stand-in engine: `StandInEngine` takes `VllmHiddenStatesGenerator`'s arguments and answers its calls, with
hidden states computed here instead of by vLLM. The tests and the benchmarks use this one class (a stand-in of their
own drifted from the generator's signature once: a benchmark broke and nothing ran it), so that extract's and the
online iterable's own work (input, records, resume, formats, Ray's pool) runs without an engine start.

Its states are a pure function of (token, position, layer): the same tokens give the same bytes in every process,
and they differ from token to token, as a model's do (extract refuses a layer whose states are one vector at every
token). Their width is the model's hidden size where `model_path` has a config.json, else `HIDDEN`; their dtype the
one `dtype` names (`auto`: float32).

    from eagle_compat import generator, testing
    generator.VllmHiddenStatesGenerator = testing.StandInEngine   # extract's runners look it up at run time

`python -m eagle_compat.testing SCRIPT.py ARGS...` (or `-m MODULE ARGS...`, e.g. `-m eagle_compat.cli extract ...`)
runs a script with the stand-in in place, in its own process and in `--ray`'s actors: the benchmarks' smoke runs
(tests/test_benchmark_smoke.py).
"""
from __future__ import annotations

import json
import os
import sys
import threading
from types import SimpleNamespace
from typing import Any, Iterable, Iterator

from .options import check_batch_options, default_layer_ids

HIDDEN = 256  # the tiny Llama's hidden size (tiny_models): the width where the model has no config.json
_TORCH_DTYPES = {"auto": "float32", "float": "float32", "float32": "float32", "half": "float16",
                 "float16": "float16", "bfloat16": "bfloat16"}  # each of ENGINE_DTYPES


def _text_config(model_path: str) -> dict:
    """The model's config.json (its text_config where it wraps a language model); {} where there is none."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config.get("text_config") or config


class StandInEngine:
    """Stands in for `VllmHiddenStatesGenerator(model_path, layer_ids=None, max_model_len=2048, **kwargs)`.

    Class attributes, for tests: `started` counts the engines made (set it to 0 first); `block`, an Event set by a
    test, holds every `generate()` until it is set (at most 30 s); `max_model_len` is the last one asked for."""
    started = 0
    block: threading.Event | None = None
    max_model_len: int | None = None

    def __init__(self, model_path: str, layer_ids: list[int] | None = None, max_model_len: int = 2048, *,
                 dtype: str = "auto", **kwargs: Any):
        StandInEngine.started += 1
        StandInEngine.max_model_len = max_model_len
        self.model_path = os.fspath(model_path)
        config = _text_config(self.model_path)
        self.hidden_size = int(config.get("hidden_size") or HIDDEN)
        self.num_layers = int(config.get("num_hidden_layers") or 0)
        if layer_ids is None:
            if not self.num_layers:
                raise ValueError(f"layer_ids=None needs the model's num_hidden_layers ({self.model_path} has no "
                                 "config.json saying it): give layer_ids")
            layer_ids = default_layer_ids(self.num_layers)
        self.layer_ids = list(layer_ids)
        self.dtype = _TORCH_DTYPES.get(dtype, "float32")
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(dtype=f"torch.{self.dtype}"))
        self.closed = False

    def __enter__(self) -> "StandInEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.closed = True

    def describe(self) -> dict:
        return {"stand_in": True}

    def generate(self, token_ids: Iterable[Iterable[int]], *, truncate: bool = False) -> list[dict]:
        import torch
        if StandInEngine.block is not None:
            StandInEngine.block.wait(30)
        dtype = getattr(torch, self.dtype)
        out = []
        for ids in token_ids:
            t = torch.as_tensor(list(ids), dtype=torch.long)
            base = (t.float()[:, None] + torch.arange(len(t)).float()[:, None] / 7
                    + torch.arange(self.hidden_size) / 100)
            out.append({"input_ids": t, "hidden_states": [(base * (lid + 1)).to(dtype) for lid in self.layer_ids]})
        return out

    def generate_batches(self, batches: Iterable[Any], *, truncate: bool = False,
                         prefetch: int = 1) -> Iterator[list[dict]]:
        """`generate()` of each batch in turn (the real one pipelines; the results are the same)."""
        check_batch_options(truncate=truncate, prefetch=prefetch)
        for batch in batches:
            yield self.generate(batch)  # (a subclass's generate() may take the batch alone)

    def reserve_host_buffers(self, tokens_per_batch: int, count: int = 5) -> int:
        return 0  # no hand-over ring: the states are made in this process

    @property
    def handover_stats(self) -> dict:
        return {}


def stand_in_actor() -> type:
    """`--ray`'s actor with the stand-in engine, made from the job's engine arguments as the real actor makes its
    generator (the actors run in other processes: replacing the generator in this one does not reach them)."""
    from .extract import ray_runner

    class StandInActor(ray_runner.ExtractActor):
        def _start(self) -> None:
            self.gen = StandInEngine(**self.spec.engine.keywords())
    return StandInActor


def install() -> None:
    """The stand-in engine in place of the generator, in this process and in `--ray`'s actors."""
    from . import generator
    from .extract import ray_runner
    generator.VllmHiddenStatesGenerator = StandInEngine
    ray_runner.ExtractActor = stand_in_actor()


USAGE = "usage: python -m eagle_compat.testing SCRIPT.py ARGS... | -m MODULE ARGS..."


def main(argv: list[str] | None = None) -> int:
    """Runs a script (or `-m MODULE`) as __main__ with the stand-in engine in place (`install()`)."""
    import runpy
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv == ["-m"]:
        print(USAGE, file=sys.stderr)
        return 2
    install()
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as `python SCRIPT.py` has it
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
