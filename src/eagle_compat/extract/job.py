"""`eagle-compat extract`: run the stable generator over a dataset and write training files."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Any

from .. import detect, leftovers, options
from .._version import __version__
from ..errors import InvalidInput
from . import (atomic_io, directory_lock, formats, input_reading, kept_files, layers, local_runner, placement, report,
               spool, stages, writer, written_index)
from .batch_job import Runner
from .job_options import ExtractOptions, check_options, resolve_max_len, settings_of
from .record import Settings
from .run_plan import Claim, RunPlan


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


# ---- the job, in four phases: plan -> claim the directory -> run the batches -> finish the set ----


def plan(opts: ExtractOptions) -> RunPlan:
    """Every check, the model's facts, the layers, --max-len, the settings record's check (read-only) and the input
    read and placed. Refusals of paths and options come before anything heavy is imported (about a second)."""
    from .. import model_facts
    from ..model_source import local_model_path

    opts = dataclasses.replace(opts, model=local_model_path(opts.model))  # a hub name: its cached snapshot
    check_options(opts)
    if opts.gpu_memory_utilization is None:
        opts = dataclasses.replace(opts, gpu_memory_utilization=model_facts.default_gpu_memory_utilization())
    text_config = model_facts.model_text_config(opts.model, opts.trust_remote_code)
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
    data, spool_key, spool_made, streaming = input_reading.read_input(opts, max_len, vocab_size, settings, input_identity)
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


def _make_out(opts: ExtractOptions) -> None:
    try:
        os.makedirs(opts.out, exist_ok=True)
    except OSError as exc:
        raise atomic_io.OutputWriteError(f"--out {opts.out!r} cannot be made: {exc.strerror or exc}") from None
    directory_lock.refuse_others_folder(opts.out)  # again: made by another user between the checks and here
    if opts.shard[1] > 1 and (note := directory_lock.lock_scope_note(opts.out)):
        print(f"NOTE: {note}", file=sys.stderr)


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
        non_finite = kept_files.still_non_finite(p, non_finite)
    todo, kept = kept_files.todo_and_kept(p, non_finite)
    first_kept = next((p.path_at(index, row) for index, row in kept.all_places() if index not in non_finite), None)
    states = kept_files.states_expected(p, record, first_kept)
    corrected_files = kept_files.check_corrected_input(p, non_finite, states) if p.input_corrected_from else 0
    if not p.streaming:  # (a set whose input is still being read is new: no file to keep or check)
        kept_files.check_kept(p, kept, non_finite, states, record, todo)
    manifest = _manifest_for(p, record, replaced, versions, states.dtype)
    if p.input_corrected_from:
        kept_files.record_correction(p, manifest, record, non_finite, corrected_files)
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


def _read_whole_where_others_wrote(p: RunPlan) -> None:
    """A set planned as new whose directory got files since `plan` (another run, a shard, wrote there): its input is
    read to its end, and the run goes on as one that read it first."""
    if p.streaming and writer.any_sample_file(p.out):
        _read_whole(p)
        p.refuse_without_resume()


def _read_whole(p: RunPlan) -> None:
    """A streamed input's reading waited for to its end (its left-out lines, notes and report join the plan): the
    plan is then that of a run that read the input first. Refused where the input changed while it was read (judged
    by the reading, at its last byte: a change after it cannot reach the samples, read from the spool)."""
    data = input_reading.finish_reading(p.opts, p.spool_made, p.spool_key, p.reading_started)
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
        manifest["engine_dtype"] = recorded_dtype  # read from the kept files (kept_files.states_expected)
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
                               f"{input_reading.READ_AHEAD_LINES:,} lines): the files written before this line are kept. Fix the "
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
    index = kept_files.read_index(p, c.states.stamp)
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
