"""The extract job's batches on this machine: one `VllmHiddenStatesGenerator`, the engine computing batch k+1 while
writer threads save batch k through the run's format (pipeline.py, formats.py). `job.run` decides what to do and keeps
the directory's record; this module only turns batches into files, as `ray_runner` does on a pool."""
from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Any

from .. import detect
from ..errors import InvalidInput
from . import atomic_io, directory_lock, formats, pipeline, placement, stages, writer
from .batch_job import EngineArgs, SampleWriting


def _ignore_sigint(worker: Any) -> None:
    """Runs in each vLLM worker (main thread): Ctrl-C reaches the whole process group, but the driver stops the
    workers itself; a worker interrupted mid-forward would only print its traceback over the one-line message."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def extract(opts: Any, todo: list[list[formats.Placed]], engine_args: EngineArgs, writing: SampleWriting,
            manifest: dict, this_run: dict) -> tuple[int, int]:
    """Runs `todo` (the batches job.run chose); records the engine's description in `manifest` and where the run's
    time went in `this_run["pipeline"]`; returns (samples written, tokens)."""
    from .. import generator  # the module, looked up at run time (the tests put a stand-in engine there)

    done_tokens = 0
    release = detect.installed_versions().as_dict().get("vllm") or "not installed"
    try:
        with stages.waiting(f"engine starting (vLLM {release}, {engine_args.model}): loading the weights, building "
                            "the KV cache", "engine ready in {s:.0f} s") as took:
            gen = generator.VllmHiddenStatesGenerator(**engine_args.keywords(), show_load_progress=not opts.quiet)
        this_run["engine_start_s"] = round(took["seconds"], 1)
    except ValueError as exc:  # the engine's own length check, where the model's limit was not in its config
        if "max_model_len" not in str(exc) or isinstance(exc, InvalidInput):
            raise
        raise InvalidInput(f"--max-len {engine_args.max_len}: the engine refused it (max_model_len "
                           f"{engine_args.max_model_len}): {str(exc).splitlines()[-1].strip()[:400]}") from None

    def write(s: formats.Placed, r: dict) -> None:  # on a writer thread, while the engine runs the next batch
        try:
            left_out = writing.write(s, r)
        except OSError as exc:
            raise atomic_io.OutputWriteError(
                f"could not write {writing.path(s)}: {exc.strerror or exc}. The {pool.done} files "
                "written before it are complete (each is written under a temporary name and renamed when whole); "
                "free space or fix the directory, then rerun the same command with --resume") from exc
        if left_out is not None:
            this_run.setdefault("left_out_non_finite", []).append(left_out)  # one step

    with gen:
        if getattr(gen, "executor", None) is not None and threading.current_thread() is threading.main_thread():
            gen.executor.collective_rpc(_ignore_sigint)
        manifest["decoder_contract"] = gen.describe()
        engine_dtype = str(gen.vllm_config.model_config.dtype)
        writer.check_engine_dtype(writing.out, manifest.get("engine_dtype"), engine_dtype, engine_args.dtype,
                                  "this machine")
        manifest["engine_dtype"] = this_run["engine_dtype"] = engine_dtype
        t_engine = time.time()
        # after the engine start: rates mean work
        progress = pipeline.Progress(placement.sample_count(todo), opts.progress)
        # The driver's time goes to waiting for the engine's next batch or for a writer slot. Which of the two it
        # waits for says which sets the run's pace (not by how much: the engine thread keeps one batch ready and more
        # in flight on the workers while the driver waits). Slot waits at the last batch are left out: no engine
        # work is left to pace; what the last files take after it is `last_batch_to_last_file_s`.
        driver_waited_for_engine = driver_waited_for_writers = 0.0
        started = asked = last_batch = time.monotonic()
        with (pipeline.WriterPool(opts.writer_threads) as pool,
              contextlib.closing(pipeline.pipelined(gen, todo, lambda s: s.input_ids)) as batches):
            for batch, results in batches:
                driver_waited_for_engine += time.monotonic() - asked
                # as of this batch: kept for the last one (the input may still be read: no count of batches yet)
                driver_waited_for_writers, last_batch = pool.blocked_s, time.monotonic()
                directory_lock.check_lock_held(writing.out)  # its lock file removed: another run may write here now
                for s, r in zip(batch, results, strict=True):  # a result short would leave a sample without file
                    pool.submit(write, s, r)
                    done_tokens += len(s.input_ids)
                del results
                elapsed_engine = max(time.time() - t_engine, 1e-9)
                progress.update(len(batch), pool.done / elapsed_engine, done_tokens / elapsed_engine)
                asked = time.monotonic()
        ended = time.monotonic()
        this_run["pipeline"] = {"seconds": round(ended - started, 2),
                                "driver_waited_for_engine_s": round(driver_waited_for_engine, 2),
                                "driver_waited_for_writers_s": round(driver_waited_for_writers, 2),
                                "last_batch_to_last_file_s": round(ended - last_batch, 2),
                                "writer_threads": pool.threads}
        progress.close()
        # every submitted write finished (close() raised otherwise); those --skip-non-finite left out wrote nothing
        done_samples = pool.done - len(this_run.get("left_out_non_finite", ()))
    return done_samples, done_tokens
