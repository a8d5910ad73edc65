"""A new set whose input has more than READ_AHEAD_LINES lines is read while its batches run (input_reading.read_input,
spool.Builder.start, placement.StreamedBatches): the first batch waits for its own samples, not for the whole input,
and the set's files, record and kept spool are those of a run that read the input first. A line the reading cannot
take stops the run there, naming it; what was written stays whole."""
from __future__ import annotations

import json
import os
import re
import threading

import pytest

from eagle_compat.errors import InvalidInput
from eagle_compat.extract import atomic_io, file_hashes, input_reading, inputs, job, spool, writer
from eagle_compat.generator import VllmHiddenStatesGenerator  # the real one (tests put a stand-in in its place)

from helpers import extract_options, rewritten_after_its_digest, write_dataset

N = 40


@pytest.fixture
def dataset(tmp_path):
    return write_dataset(tmp_path / "data.jsonl", N, 10, 40, seed=5, conversations_every=3)


def _files(out) -> dict[str, bytes]:
    return {f: (out / f).read_bytes() for f in sorted(os.listdir(out)) if f.startswith("data_") and f.endswith(".pt")}


def _record(out) -> dict:
    return json.loads((out / writer.MANIFEST).read_text())


def _reading_held_until_a_batch_ran(monkeypatch, fake_engine, hold_after: int) -> dict:
    """The input's reading waits after `hold_after` samples until the engine has run a batch (a hook, not a timing
    window: where the first batch waits for the whole input, the reading is never let go and the test fails)."""
    seen = _reading_held(monkeypatch, hold_after)
    real_generate = fake_engine.generate

    def generate(self, token_ids):
        seen["batch_ran"].set()
        return real_generate(self, token_ids)
    monkeypatch.setattr(fake_engine, "generate", generate)
    return seen


def _reading_held(monkeypatch, hold_after: int) -> dict:
    """The input's reading waits after `hold_after` samples until `seen["batch_ran"]` is set (60 s at most)."""
    seen = {"batch_ran": threading.Event(), "held": False}
    real_read = inputs.read_dataset

    class Holding:
        def __init__(self, into):
            self.into = into

        def append(self, s):
            self.into.append(s)
            if len(self.into) == hold_after:
                seen["held"] = seen["batch_ran"].wait(60)

        def __len__(self):
            return len(self.into)

    def read(*args, into, **kwargs):
        return real_read(*args, into=Holding(into), **kwargs)
    monkeypatch.setattr(inputs, "read_dataset", read)
    return seen


def test_a_large_new_set_runs_its_first_batch_before_its_input_is_read(tiny_llama, dataset, tmp_path, fake_engine,
                                                                       monkeypatch):
    first = tmp_path / "read_first"
    job.run(extract_options(tiny_llama, dataset, first, max_len=32, min_loss_tokens=4))
    monkeypatch.setattr(input_reading, "READ_AHEAD_LINES", 6)
    monkeypatch.setattr(spool, "PUBLISH_EVERY", 4)
    seen = _reading_held_until_a_batch_ran(monkeypatch, fake_engine, hold_after=20)
    out = tmp_path / "streamed"
    summary = job.run(extract_options(tiny_llama, dataset, out, max_len=32, min_loss_tokens=4))
    assert seen["held"], "the first batch waited for the whole input"
    assert summary["complete"] and _files(out) == _files(first)
    streamed, read_first = _record(out), _record(first)
    for key in ("num_samples", "num_samples_in_data", "skipped_uncovered", "left_out_few_loss_tokens", "report",
                "input_notes", "status", "samples_present"):
        assert streamed[key] == read_first[key], key
    assert streamed["runs"][-1]["batches_to_do"] == read_first["runs"][-1]["batches_to_do"] > 0
    assert streamed["runs"][-1]["report"] == read_first["runs"][-1]["report"]
    # the spool it kept is the one a run reading first keeps: a resume reads it back
    with open(out / writer.SPOOL_FILE, "rb") as a, open(first / writer.SPOOL_FILE, "rb") as b:
        assert spool.header_of(a)[0] == spool.header_of(b)[0]


# a conversation and token ids that differ: the line's shape is right, only its tokenization tells it is wrong
_DIFFERING_FORMS = {"conversations": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}],
                    "input_ids": [5, 6, 7]}


@pytest.mark.parametrize("bad, message", [
    (b'{"input_ids": [1, 2,', "not JSON"),
    (b'{"input_ids": [5, 6], "note": "caf\xe9"}', "not UTF-8 text"),
    (b'{"input_ids": [5, 6], "input_ids": [7]}', "the key 'input_ids' appears twice in one object"),
    (b'{"input_ids": [5, 6, 7], "loss_mask": [1.0, 0.0, 1.0]}', "write the JSON integers 0 and 1"),
    (b'{"input_ids": [5, 6.0]}', "input_ids must be a list of ints"),
    (b'{"input_ids": [5, 600000]}', "token id 600000 outside the model's vocabulary"),
    (b'{"input_ids": []}', "the sample tokenizes to nothing"),
    (b'{"conversations": [{"role": "robot", "content": "hi"}]}', "message needs a role in"),
    (b'{"text": "hello"}', "a line needs 'conversations' (or 'messages') or 'input_ids'"),
    (b'[1, 2, 3]', "each line is one JSON object"),
])
def test_a_bad_line_deep_in_a_streamed_input_is_refused_before_the_engine_starts(tiny_llama, dataset, tmp_path,
                                                                                 monkeypatch, bad, message):
    """Every line's JSON, UTF-8, keys and types are checked before the engine starts (inputs.check_lines): a bad
    line late in an input read while the batches run used to stop the run only after the batches before it ran,
    and its correction was another set (no --resume took the changed input)."""
    from eagle_compat import generator
    with open(dataset, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    lines[34] = bad + b"\n"  # line 35 of 40: the streamed reading meets it long after the first batch
    with open(dataset, "wb") as f:
        f.write(b"".join(lines))
    monkeypatch.setattr(input_reading, "READ_AHEAD_LINES", 6)
    seen = _reading_held(monkeypatch, hold_after=20)  # the reading reaches line 35 only once an engine starts

    class NoEngine:
        def __init__(self, *args, **kwargs):
            seen["batch_ran"].set()
            raise AssertionError("an engine was started")
    monkeypatch.setattr(generator, "VllmHiddenStatesGenerator", NoEngine)
    out = tmp_path / "out"
    with pytest.raises(InvalidInput, match=r"data\.jsonl:35: .*" + re.escape(message)):
        job.run(extract_options(tiny_llama, dataset, out, max_len=32))
    assert not out.exists()  # nothing written, not even the directory


def test_a_line_the_streamed_reading_cannot_take_stops_the_run_naming_it(tiny_llama, tmp_path, fake_engine,
                                                                           monkeypatch):
    data = tmp_path / "data.jsonl"
    write_dataset(data, N, 10, 40, seed=5, conversations_every=3)
    lines = data.read_text().splitlines(keepends=True)
    lines[29] = json.dumps(_DIFFERING_FORMS) + "\n"  # line 30: only its tokenization tells it is wrong
    data.write_text("".join(lines))
    monkeypatch.setattr(input_reading, "READ_AHEAD_LINES", 6)
    monkeypatch.setattr(spool, "PUBLISH_EVERY", 4)
    seen = _reading_held_until_a_batch_ran(monkeypatch, fake_engine, hold_after=20)
    out = tmp_path / "out"
    with pytest.raises(InvalidInput, match=r"data\.jsonl:30: .*read while the batches ran .*Fix the line, then rerun "
                                           r"the same command with --resume"):
        job.run(extract_options(tiny_llama, str(data), out, max_len=32))
    assert seen["held"]
    record = _record(out)
    assert record["status"] == "incomplete" and record["runs"][-1]["status"].startswith("failed")
    written = _files(out)
    assert 0 < len(written) == record["samples_present"]
    assert not (out / writer.SPOOL_FILE).exists()  # a reading that failed is not kept
    for name in written:  # every file written is whole and its sample's
        assert writer.read_facts(str(out / name)).ids


def test_a_reading_that_fails_otherwise_is_not_called_a_bad_line(tiny_llama, dataset, tmp_path, fake_engine,
                                                                 monkeypatch):
    monkeypatch.setattr(input_reading, "READ_AHEAD_LINES", 6)
    monkeypatch.setattr(spool, "PUBLISH_EVERY", 4)
    _reading_held_until_a_batch_ran(monkeypatch, fake_engine, hold_after=20)
    real_append = spool.Builder.append

    def full_after_24(self, s):
        if len(self) == 24:
            raise atomic_io.OutputWriteError("the tokenized input cannot be written in X (No space left on device)")
        return real_append(self, s)
    monkeypatch.setattr(spool.Builder, "append", full_after_24)
    out = tmp_path / "out"
    with pytest.raises(atomic_io.OutputWriteError, match="No space left") as caught:
        job.run(extract_options(tiny_llama, dataset, out, max_len=32))
    assert "read while the batches ran" not in str(caught.value)
    assert _record(out)["status"] == "incomplete"


def test_an_input_changed_while_it_is_read_is_refused_before_the_set_completes(tiny_llama, dataset, tmp_path,
                                                                                fake_engine, monkeypatch):
    monkeypatch.setattr(input_reading, "READ_AHEAD_LINES", 6)
    monkeypatch.setattr(spool, "PUBLISH_EVERY", 4)
    seen = _reading_held_until_a_batch_ran(monkeypatch, fake_engine, hold_after=20)
    real_generate = fake_engine.generate

    def generate(self, token_ids):  # the input grows while the run reads it
        if not seen["batch_ran"].is_set():
            with open(dataset, "a") as f:
                f.write(json.dumps({"input_ids": [5, 6, 7, 8]}) + "\n")
        return real_generate(self, token_ids)
    monkeypatch.setattr(fake_engine, "generate", generate)
    out = tmp_path / "out"
    with pytest.raises(InvalidInput, match="changed while it was read"):
        job.run(extract_options(tiny_llama, dataset, out, max_len=32))
    record = _record(out)
    assert record["status"] == "incomplete" and not (out / "data_config.json").exists()
    assert not (out / writer.SPOOL_FILE).exists()


def test_a_shard_whose_directory_got_files_while_it_read_goes_on_as_a_run_that_read_first(tiny_llama, dataset,
                                                                                          tmp_path, fake_engine,
                                                                                          monkeypatch):
    whole = tmp_path / "whole"
    job.run(extract_options(tiny_llama, dataset, whole, max_len=32))
    out = tmp_path / "out"
    job.run(extract_options(tiny_llama, dataset, out, max_len=32, shard=(0, 2)))
    os.unlink(out / writer.SPOOL_FILE)  # (else shard 1 reads the input back instead of reading it)
    monkeypatch.setattr(input_reading, "READ_AHEAD_LINES", 6)
    seen = _reading_held(monkeypatch, hold_after=20)  # until the claim finds shard 0's files and waits for the rest
    real_read_input, real_read_whole = input_reading.read_input, job._read_whole

    def read_whole(p):
        seen["batch_ran"].set()
        return real_read_whole(p)
    monkeypatch.setattr(job, "_read_whole", read_whole)

    def planned_before_shard_0_wrote(*args, **kwargs):  # the plan saw no file: shard 0 wrote between it and the lock
        with monkeypatch.context() as m:
            m.setattr(writer, "any_sample_file", lambda out_dir: False)
            data, key, made, streaming = real_read_input(*args, **kwargs)
        assert streaming
        return data, key, made, streaming
    monkeypatch.setattr(input_reading, "read_input", planned_before_shard_0_wrote)
    summary = job.run(extract_options(tiny_llama, dataset, out, max_len=32, shard=(1, 2), resume=True))
    assert seen["held"] and summary["complete"] and _files(out) == _files(whole)
    assert _record(out)["num_samples"] == _record(whole)["num_samples"]


def test_a_streamed_run_stopped_after_its_reading_ended_leaves_the_tokenized_input_for_its_resume(
        tiny_llama, dataset, tmp_path, fake_engine, monkeypatch):
    first = tmp_path / "read_first"
    job.run(extract_options(tiny_llama, dataset, first, max_len=32))
    monkeypatch.setattr(input_reading, "READ_AHEAD_LINES", 6)
    monkeypatch.setattr(spool, "PUBLISH_EVERY", 4)
    out = tmp_path / "out"
    real_generate, batches = fake_engine.generate, []

    def generate(self, token_ids):  # stopped (Ctrl-C) at the third batch, once the reading has ended
        batches.append(1)
        if len(batches) == 3:
            for _ in range(600):
                if (out / writer.SPOOL_FILE).exists():
                    break
                threading.Event().wait(0.1)
            raise KeyboardInterrupt
        return real_generate(self, token_ids)
    monkeypatch.setattr(fake_engine, "generate", generate)
    with pytest.raises(KeyboardInterrupt):
        job.run(extract_options(tiny_llama, dataset, out, max_len=32))
    assert (out / writer.SPOOL_FILE).exists(), "the spool is kept when the reading ends, not when the set does"
    monkeypatch.setattr(fake_engine, "generate", real_generate)
    tokenized = []
    real_read = inputs.read_dataset
    monkeypatch.setattr(inputs, "read_dataset", lambda *a, **k: tokenized.append(1) or real_read(*a, **k))
    summary = job.run(extract_options(tiny_llama, dataset, out, max_len=32, resume=True))
    assert not tokenized and summary["complete"] and _files(out) == _files(first)


def _run_bounded(opts) -> dict:
    """job.run on a thread of its own, waited for 120 s at most: a run that hangs fails the test instead of holding
    the suite (a bound on a failure, not a timing window: a run that works ends long before)."""
    ended: dict = {}

    def running():
        try:
            ended["summary"] = job.run(opts)
        except BaseException as exc:  # noqa: BLE001 - looked at by the test
            ended["error"] = exc
    thread = threading.Thread(target=running, name="the-run", daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the run hangs"
    return ended


@pytest.mark.parametrize("how", ["removed", "renamed"])
def test_an_input_removed_or_renamed_while_it_is_read_stops_the_run_naming_it(tiny_llama, dataset, tmp_path,
                                                                              fake_engine, monkeypatch, how):
    monkeypatch.setattr(input_reading, "READ_AHEAD_LINES", 6)
    monkeypatch.setattr(spool, "PUBLISH_EVERY", 4)
    seen = _reading_held(monkeypatch, hold_after=20)
    real_generate = fake_engine.generate

    def generate(self, token_ids):  # at the first batch (the run holds --out), the input goes; then the reading ends
        if not seen["batch_ran"].is_set():
            if how == "removed":
                os.unlink(dataset)
            else:
                os.rename(dataset, dataset + ".moved")
            seen["batch_ran"].set()
        return real_generate(self, token_ids)
    monkeypatch.setattr(fake_engine, "generate", generate)
    out = tmp_path / "out"
    ended = _run_bounded(extract_options(tiny_llama, dataset, out, max_len=32))
    assert seen["held"]
    error = ended.get("error")
    assert isinstance(error, spool.InputChanged), repr(error)
    assert dataset in str(error) and "changed while it was read" in str(error)
    record = _record(out)
    assert record["status"] == "incomplete" and record["runs"][-1]["status"].startswith("failed")
    assert not (out / writer.SPOOL_FILE).exists()  # samples of an input that changed are not kept for a resume
    for name in _files(out):  # every file written is whole
        assert writer.read_facts(str(out / name)).ids


def _bounded(wait) -> BaseException | None:
    """`wait()` on a thread of its own, 60 s at most (a wait that never ends fails the test); returns what it
    raised."""
    raised: list = []

    def waiting():
        try:
            wait()
            raised.append(None)
        except BaseException as exc:  # noqa: BLE001 - looked at by the test
            raised.append(exc)
    thread = threading.Thread(target=waiting, daemon=True)
    thread.start()
    thread.join(60)
    assert raised, "the wait never ends"
    return raised[0]


def test_a_reading_thread_gone_without_a_word_is_an_error_for_its_waiters_not_a_hang(tmp_path):
    made = spool.Builder(str(tmp_path))
    try:  # a reading thread that ended without publishing its end (killed by something no `except` sees)
        made._thread = threading.Thread(target=lambda: None)
        made._thread.start()
        made._thread.join()
        for wait in (lambda: made.wait_samples(1), lambda: made.wait_lines(None), made.join):
            assert isinstance(_bounded(wait), spool.ReadingDied)
    finally:
        made.close()


class _PipeliningEngine:
    """The stand-in engine with the generator's own pipelining (`_pipelined`): an engine thread takes the batches
    while the caller waits for each one's results, as with vLLM."""

    @staticmethod
    def install(monkeypatch, fake_engine):
        from eagle_compat import generator

        class Pipelining(fake_engine):
            def generate_batches(self, batches, prefetch=1):
                return VllmHiddenStatesGenerator._pipelined(self, batches, False, prefetch)

            def _engine_batches(self, batches, truncate):
                for token_ids in batches:
                    yield self.generate(token_ids)
        monkeypatch.setattr(generator, "VllmHiddenStatesGenerator", Pipelining)


def test_the_first_ctrl_c_while_the_engine_waits_for_the_input_stops_the_run_at_once(tiny_llama, dataset, tmp_path,
                                                                                       fake_engine, monkeypatch):
    """Ctrl-C reaches the caller while it waits for the engine thread's next batch, and that thread waits for samples
    the reading has not read yet: the run stops then (the reading is cancelled before the engine thread is joined),
    not when the reading gets there."""
    import queue

    from eagle_compat import generator
    monkeypatch.setattr(input_reading, "READ_AHEAD_LINES", 6)
    monkeypatch.setattr(spool, "PUBLISH_EVERY", 4)
    hold_after, stopped, queues = 20, threading.Event(), []
    seen = {"held_to_its_bound": False}
    real_read, real_stop, real_wait = inputs.read_dataset, spool.Builder.stop, spool.Builder.wait_samples

    class Holding:  # the reading waits after `hold_after` samples until it is stopped (60 s at most)
        def __init__(self, into):
            self.into = into

        def append(self, s):
            self.into.append(s)
            if len(self.into) == hold_after:
                seen["held_to_its_bound"] = not stopped.wait(60)

        def __len__(self):
            return len(self.into)
    monkeypatch.setattr(inputs, "read_dataset", lambda *a, into, **k: real_read(*a, into=Holding(into), **k))

    def stop(self):
        real_stop(self)
        stopped.set()
    monkeypatch.setattr(spool.Builder, "stop", stop)

    class CtrlCQueue(queue.Queue):  # the caller's wait for the engine thread's next batch is where Ctrl-C lands
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            queues.append(self)

        def get(self, *args, **kwargs):
            item = super().get(*args, **kwargs)
            if item[0] == "ctrl-c":
                raise KeyboardInterrupt
            return item
    monkeypatch.setattr(generator, "queue", type("queue", (), {"Queue": CtrlCQueue, "Full": queue.Full}))

    def wait_samples(self, count):  # the engine thread about to wait for samples past the held ones: Ctrl-C
        if count > hold_after and not seen.get("ctrl_c"):
            seen["ctrl_c"] = True
            queues[-1].put(("ctrl-c", None))
        return real_wait(self, count)
    monkeypatch.setattr(spool.Builder, "wait_samples", wait_samples)
    _PipeliningEngine.install(monkeypatch, fake_engine)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt, match="rerun the same command with --resume"):
        job.run(extract_options(tiny_llama, dataset, out, max_len=32))
    assert seen["ctrl_c"] and not seen["held_to_its_bound"], "the run waited for the reading, not for Ctrl-C"
    record = _record(out)
    assert record["status"] == "incomplete" and record["runs"][-1]["status"] == "interrupted"


@pytest.mark.parametrize("how", ["appended", "touched"])
def test_an_input_changed_after_it_was_read_whole_leaves_the_finished_set_complete(tiny_llama, dataset, tmp_path,
                                                                                  fake_engine, monkeypatch, how):
    """The samples come from the spool once the input is read: a change after its last byte was read (a line
    appended for the next set, a touch) cannot reach them, and the set the run finished is complete."""
    first = tmp_path / "read_first"
    job.run(extract_options(tiny_llama, dataset, first, max_len=32))
    as_read = open(dataset, "rb").read()
    monkeypatch.setattr(input_reading, "READ_AHEAD_LINES", 6)
    monkeypatch.setattr(spool, "PUBLISH_EVERY", 4)
    real_end_reading = job.end_reading

    def end_reading(p, c):  # every batch ran, so the reading has ended: the input changes now
        with open(dataset, "ab") as f:
            f.write(json.dumps({"input_ids": [5, 6, 7, 8]}).encode() + b"\n" if how == "appended" else b"")
        os.utime(dataset, ns=(os.stat(dataset).st_atime_ns, os.stat(dataset).st_mtime_ns + 10**9))
        return real_end_reading(p, c)
    monkeypatch.setattr(job, "end_reading", end_reading)
    out = tmp_path / "out"
    summary = job.run(extract_options(tiny_llama, dataset, out, max_len=32))
    assert summary["complete"] and _files(out) == _files(first)
    assert _record(out)["status"] == "complete" and (out / "data_config.json").exists()
    with open(out / writer.SPOOL_FILE, "rb") as a, open(first / writer.SPOOL_FILE, "rb") as b:
        assert spool.header_of(a)[0] == spool.header_of(b)[0]
    # the set's resume, with the input the record names: the tokenized input is read back, nothing is redone
    with open(dataset, "wb") as f:
        f.write(as_read)
    monkeypatch.setattr(job, "end_reading", real_end_reading)
    tokenized, real_read = [], inputs.read_dataset
    monkeypatch.setattr(inputs, "read_dataset", lambda *a, **k: tokenized.append(1) or real_read(*a, **k))
    resumed = job.run(extract_options(tiny_llama, dataset, out, max_len=32, resume=True))
    assert not tokenized and resumed["complete"] and resumed["written_this_run"] == 0
    assert _files(out) == _files(first)


def test_a_streamed_input_rewritten_in_place_after_its_digest_stops_the_run_and_is_not_kept(tiny_llama, dataset,
                                                                                             tmp_path, fake_engine,
                                                                                             monkeypatch):
    """Rewritten in place between the settings' digest and its reading (inode, size and modification time put
    back): the SHA-256 of the bytes the reading consumed is judged when its last byte is read. Before, the set
    completed from the rewritten bytes, and its spool, keyed by the first digest, let a --resume with the input as
    it was complete the set from them."""
    monkeypatch.setattr(input_reading, "READ_AHEAD_LINES", 6)
    monkeypatch.setattr(spool, "PUBLISH_EVERY", 4)
    rewritten_after_its_digest(monkeypatch, dataset)
    # batches run before the last byte is read, so the stop finds a record to mark (a hook: without it a fast reading
    # may stop the run before its first record)
    seen = _reading_held_until_a_batch_ran(monkeypatch, fake_engine, hold_after=20)
    out = tmp_path / "out"
    ended = _run_bounded(extract_options(tiny_llama, dataset, out, max_len=32))
    error = ended.get("error")
    assert isinstance(error, spool.InputChanged), repr(ended)
    assert dataset in str(error) and "SHA-256 of the bytes read" in str(error)
    record = _record(out)
    assert seen["held"] and record["status"] == "incomplete" and not (out / "data_config.json").exists()
    assert not (out / writer.SPOOL_FILE).exists()


def _stopped_by_line_30(tiny_llama, tmp_path, fake_engine, monkeypatch) -> tuple[str, str, object]:
    """A new set of 40 lines read while its batches ran, stopped by line 30, which only its tokenization refuses,
    after batches ran: (the input, line 30 as it should be, --out)."""
    data = tmp_path / "data.jsonl"
    write_dataset(data, N, 10, 40, seed=5, conversations_every=3)
    lines = data.read_text().splitlines(keepends=True)
    good, lines[29] = lines[29], json.dumps(_DIFFERING_FORMS) + "\n"
    data.write_text("".join(lines))
    monkeypatch.setattr(input_reading, "READ_AHEAD_LINES", 6)
    monkeypatch.setattr(spool, "PUBLISH_EVERY", 4)
    seen = _reading_held_until_a_batch_ran(monkeypatch, fake_engine, hold_after=20)
    out = tmp_path / "out"
    with pytest.raises(InvalidInput, match=r"data\.jsonl:30: "):
        job.run(extract_options(tiny_llama, str(data), out, max_len=32))
    assert seen["held"] and _record(out)["samples_present"] > 0
    return str(data), good, out


def _with_line(path: str, number: int, text: str) -> None:
    with open(path) as f:
        lines = f.readlines()
    lines[number - 1] = text
    with open(path, "w") as f:
        f.write("".join(lines))


def test_a_corrected_line_lets_resume_finish_the_set_keeping_the_files_written(tiny_llama, tmp_path, fake_engine,
                                                                               monkeypatch, capsys):
    """The line that stopped a streamed run fixed, --resume goes on with the corrected input: every file already
    written holds the tokens the input now gives its sample (checked), so each is kept and the set completes as a
    clean run of the corrected input would. Before, every --resume refused it (data_sha256 changed), and the batches
    already run were lost."""
    data, good, out = _stopped_by_line_30(tiny_llama, tmp_path, fake_engine, monkeypatch)
    recorded = _record(out)["settings"]["data_sha256"]
    written = {name: os.stat(out / name).st_ino for name in _files(out)}
    _with_line(data, 30, good)
    capsys.readouterr()
    summary = job.run(extract_options(tiny_llama, data, out, max_len=32, resume=True))
    clean = tmp_path / "clean"
    job.run(extract_options(tiny_llama, data, clean, max_len=32))
    assert summary["complete"] and _files(out) == _files(clean)
    kept = [name for name, inode in written.items() if os.stat(out / name).st_ino == inode]
    assert kept and summary["written_this_run"] == N - len(kept)
    record = _record(out)
    assert record["status"] == "complete" and record["settings"]["data_sha256"] == file_hashes.file_sha256(data)
    assert [c["data_sha256_was"] for c in record["input_corrections"]] == [recorded]
    assert "the set goes on with it as a corrected input" in capsys.readouterr().err


def test_a_corrected_input_whose_written_sample_changed_is_refused_naming_the_file(tiny_llama, tmp_path, fake_engine,
                                                                                  monkeypatch):
    """A line whose sample was already written, changed with the correction: its file holds the states of the line
    as it was, so the --resume is refused before anything is written, naming the file and the line; once that file
    is deleted, the --resume redoes its batch and completes as a clean run of the corrected input."""
    data, good, out = _stopped_by_line_30(tiny_llama, tmp_path, fake_engine, monkeypatch)
    _with_line(data, 30, good)
    _with_line(data, 2, json.dumps({"input_ids": [7, 8, 9, 10, 11, 12]}) + "\n")  # data_1.pt was written before
    assert (out / "data_1.pt").exists()
    before = {name: os.stat(out / name).st_mtime_ns for name in os.listdir(out) if name != ".eagle-compat.lock"}
    with pytest.raises(writer.OutputDirectoryConflict, match=r"data_1\.pt is not the sample the corrected input "
                                                             r"gives there: input line 2: .*Nothing was written"):
        job.run(extract_options(tiny_llama, data, out, max_len=32, resume=True))
    assert {name: os.stat(out / name).st_mtime_ns for name in os.listdir(out) if name != ".eagle-compat.lock"} == before
    os.unlink(out / "data_1.pt")
    summary = job.run(extract_options(tiny_llama, data, out, max_len=32, resume=True))
    clean = tmp_path / "clean"
    job.run(extract_options(tiny_llama, data, clean, max_len=32))
    assert summary["complete"] and _files(out) == _files(clean)


def test_a_changed_input_without_resume_is_refused_saying_resume_takes_a_corrected_one(tiny_llama, dataset, tmp_path,
                                                                                    fake_engine):
    out = tmp_path / "out"
    job.run(extract_options(tiny_llama, dataset, out, max_len=32))
    _with_line(dataset, 2, json.dumps({"input_ids": [7, 8, 9, 10, 11, 12]}) + "\n")
    with pytest.raises(writer.OutputDirectoryConflict, match=r"(?s)another version of --data .*data_sha256: was .*"
                                                             r"rerun with --resume"):
        job.run(extract_options(tiny_llama, dataset, out, max_len=32))
