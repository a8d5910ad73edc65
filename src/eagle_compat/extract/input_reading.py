"""extract's input, read once: every line checked first, then tokenized into a spool on --out's file system (read back
from --out where an earlier run of the set kept it), with the reading streamed beside the batches for a large new
set."""
from __future__ import annotations

import os
import sys
import time

from . import atomic_io, inputs, report, spool, stages, writer
from .job_options import ExtractOptions


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


# An input of more lines than this is read while the batches run (the first batch waits for its samples, not for the
# whole input); a smaller one is read and checked whole before --out is touched.
READ_AHEAD_LINES = 20_000


def read_input(opts: ExtractOptions, max_len: int, vocab_size: int, settings: dict,
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
        return finish_reading(opts, made, spool_key, reading_started), spool_key, made, False
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


def finish_reading(opts: ExtractOptions, made: spool.Builder, spool_key: dict, reading_started: float) -> inputs.Dataset:
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
