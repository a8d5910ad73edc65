"""A restart in seconds: the directory's append-only index of the files its runs wrote lets a --resume (and the
completion of a sharded set) trust those files without opening them, and every guarantee of the content check
holds: a file changed, replaced or copied in since is opened and judged as before; --verify-kept opens them all."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from eagle_compat.errors import EagleCompatError
from eagle_compat.extract import atomic_io, job, writer, written_index

from helpers import extract_options, token_lines

N = 24


@pytest.fixture
def dataset(tmp_path):
    return token_lines(tmp_path / "data.jsonl", N, seed=9)


_opts = extract_options


@pytest.fixture
def reads(monkeypatch):
    """The sample files a run opens to check them."""
    opened: list[str] = []
    real = writer.read_facts

    def counting(path):
        opened.append(os.path.basename(path))
        return real(path)
    monkeypatch.setattr(writer, "read_facts", counting)
    return opened


def _half_done(tiny_llama, dataset, out):
    """Shard 0 of 2 (even batches): a set half done, as a killed run leaves it."""
    job.run(_opts(tiny_llama, dataset, out, shard=(0, 2)))
    return json.loads((out / writer.MANIFEST).read_text())


def test_each_file_written_has_its_line(tiny_llama, dataset, tmp_path, fake_engine):
    out = tmp_path / "out"
    job.run(_opts(tiny_llama, dataset, out))
    entries = written_index.read_index(str(out))
    assert sorted(entries) == list(range(N))
    for index, entry in entries.items():
        st = os.stat(out / entry["f"])
        assert entry["f"] == f"data_{index}.pt" and (entry["n"], entry["m"]) == (st.st_size, st.st_mtime_ns)


def test_a_resume_opens_no_file_the_index_vouches_for(tiny_llama, dataset, tmp_path, fake_engine, reads):
    out = tmp_path / "out"
    _half_done(tiny_llama, dataset, out)
    reads.clear()
    summary = job.run(_opts(tiny_llama, dataset, out, resume=True))
    assert summary["complete"] and summary["written_this_run"] == N // 2
    assert reads == [], reads  # neither the kept files nor, at completion, the other shard's


def test_verify_kept_opens_every_kept_file(tiny_llama, dataset, tmp_path, fake_engine, reads):
    out = tmp_path / "out"
    _half_done(tiny_llama, dataset, out)
    reads.clear()
    job.run(_opts(tiny_llama, dataset, out, resume=True, verify_kept=True))
    kept = {f"data_{i}.pt" for k in range(0, N // 4, 2) for i in range(4 * k, 4 * k + 4)}
    assert kept <= set(reads)


@pytest.mark.parametrize("change", ["rewritten", "copied in", "index line torn"])
def test_a_file_the_index_does_not_vouch_for_is_opened_and_judged(tiny_llama, dataset, tmp_path, fake_engine, reads,
                                                                  change):
    out, other = tmp_path / "out", tmp_path / "other"
    _half_done(tiny_llama, dataset, out)
    victim = out / "data_1.pt"
    if change == "rewritten":  # other tokens in the same file name: the content check refuses it
        sample = writer.load_sample(str(victim))
        sample["input_ids"] = sample["input_ids"].flip(0)
        writer.save_sample(str(out), 1, sample, "pt", [0, 5], writer.read_facts(str(victim)).stamp)
    elif change == "copied in":  # another directory's file of another model's states (another stamp)
        job.run(_opts(tiny_llama, dataset, other, shard=(0, 2), layers=[1, 5]))
        shutil.copy(other / "data_1.pt", victim)
    else:  # the last write of the index cut short: that file is read, and is fine
        text = (out / written_index.INDEX_FILE).read_text().splitlines(keepends=True)
        line = next(ln for ln in text if json.loads(ln)["i"] == 1)
        (out / written_index.INDEX_FILE).write_text("".join(ln for ln in text if ln is not line) + line[:20])
    reads.clear()
    if change == "index line torn":
        assert job.run(_opts(tiny_llama, dataset, out, resume=True))["complete"]
        assert reads == ["data_1.pt"], reads
        return
    with pytest.raises(EagleCompatError, match="data_1.pt"):
        job.run(_opts(tiny_llama, dataset, out, resume=True))
    assert reads[-1] == "data_1.pt"


@pytest.mark.skipif(os.geteuid() != 0, reason="a file of another user needs root (chown)")
def test_an_index_of_another_user_vouches_for_nothing(tiny_llama, dataset, tmp_path, fake_engine, reads):
    """In a folder others may write (its group's), another user could replace the index with lines vouching for
    files of theirs: its lines are not read, every kept file is opened, and the run starts an index of its own."""
    out = tmp_path / "out"
    _half_done(tiny_llama, dataset, out)
    os.chown(out / written_index.INDEX_FILE, 4242, -1)
    reads.clear()
    assert job.run(_opts(tiny_llama, dataset, out, resume=True))["complete"]
    kept = {f"data_{i}.pt" for k in range(0, N // 4, 2) for i in range(4 * k, 4 * k + 4)}
    assert kept <= set(reads)
    assert os.stat(out / written_index.INDEX_FILE).st_uid == os.geteuid()


def test_the_index_is_not_a_stray_or_a_foreign_file(tiny_llama, dataset, tmp_path, fake_engine):
    """A directory holding only the index and a lock (the record removed) is still ours to start again."""
    out = tmp_path / "out"
    (out).mkdir()
    (out / written_index.INDEX_FILE).write_text("")
    assert job.run(_opts(tiny_llama, dataset, out))["complete"]


def test_a_resume_of_a_finished_set_keeps_its_recorded_command(tiny_llama, dataset, tmp_path, fake_engine):
    out = tmp_path / "out"
    job.run(_opts(tiny_llama, dataset, out))
    before = (out / "data_config.json").read_bytes()
    summary = job.run(_opts(tiny_llama, dataset, out, resume=True))
    assert summary["complete"] and summary["written_this_run"] == 0
    assert (out / "data_config.json").read_bytes() == before


def test_the_token_digest_is_the_same_for_every_way_the_tokens_come():
    """Indexes written by earlier runs hold digests made one token at a time: the converted-in-C path must give the
    same digest for lists, and anything else (tensors, bools, out-of-range mask values) goes the old way."""
    import hashlib
    from array import array

    import torch

    def per_token(ids, mask):  # the digest as earlier releases computed it
        h = hashlib.blake2b(digest_size=12)
        h.update(array("q", [int(t) for t in ids]).tobytes())
        h.update(b"|" + bytes(int(m) & 1 for m in mask))
        return h.hexdigest()
    ids, mask = [5, 150_000, 0, 2**40, 7], [0, 1, 1, 0, 1]
    cases = [(ids, mask), (torch.tensor(ids), torch.tensor(mask)), (tuple(ids), tuple(mask)),
             ([True, 3, 4], [True, False, 1]), ([1, 2, 3], [2, 3, 0]), ([1.0, 2, 3], [1, 0, 1]),
             (array("i", [5, 150_000, 0, 7]), array("b", [0, 1, 1, 0])),  # extract's samples
             (array("q", [5, 2**40]), array("i", [1, 0])), (array("i", [1, 2]), array("b", [2, 1]))]
    for case_ids, case_mask in cases:
        assert written_index.tokens_digest(case_ids, case_mask) == per_token(case_ids, case_mask), (case_ids, case_mask)
    assert written_index.tokens_digest(ids, mask) != written_index.tokens_digest(ids, [1, 1, 1, 0, 1])


def test_the_completion_of_a_set_counts_every_file_it_checks(tiny_llama, dataset, tmp_path, fake_engine, monkeypatch):
    """The completion says its progress like the resume check does: every file of the set counted once, whether
    this run wrote it, the index vouches for it or it is opened (the other shard's, with --verify-kept)."""
    import contextlib

    from eagle_compat.extract import stages
    seen = {}
    real = stages.counting

    @contextlib.contextmanager
    def recording(doing, total, unit, **kwargs):
        with real(doing, total, unit, **kwargs) as count:
            yield count
        seen[doing] = (count.n, total)
    monkeypatch.setattr(stages, "counting", recording)
    out = tmp_path / "out"
    _half_done(tiny_llama, dataset, out)
    for verify_kept in (True, False):
        seen.clear()
        summary = job.run(_opts(tiny_llama, dataset, out, shard=(1, 2), resume=True, verify_kept=verify_kept))
        assert summary["complete"]
        assert seen["completing the set: files checked"] == (N, N), seen


@pytest.mark.parametrize("storage_bound", [True, False])
def test_verify_kept_reads_on_threads_only_where_reads_wait_on_storage(monkeypatch, storage_bound):
    """The first files are read on the calling thread; threads take the rest only where those reads were slow (the
    threshold stands in for the storage here). Either way the same first mismatch is found, and every file is read."""
    import threading

    readers = []

    def fake_read_facts(path):
        readers.append(threading.current_thread().name)
        k = int(path)
        return writer.SampleFacts([k, 99 if k == 35 else k], [1, 1], "stamp", 2, 8, "torch.bfloat16")
    monkeypatch.setattr(writer, "read_facts", fake_read_facts)
    monkeypatch.setattr(writer, "THREADS_PAY_FROM_S", -1.0 if storage_bound else float("inf"))
    expected = [(str(k), [k, k], [1, 1], f"line {k}") for k in range(40)]
    seen = []
    wrong = writer.first_mismatch(expected, writer.StatesExpected("stamp", 2, 8, "torch.bfloat16"), threads=4,
                                  on_each=lambda: seen.append(1))
    assert wrong.path == "35" and "line 35" in wrong.why and not wrong.states
    assert len(seen) == 36  # counted up to the mismatch
    on_threads = [r for r in readers if r.startswith("eagle-compat-check")]
    assert readers[:writer.PROBE_FILES] == [threading.current_thread().name] * writer.PROBE_FILES
    assert bool(on_threads) == storage_bound, readers


def _edit_states_in_place(path):
    """One state value changed in the file's own bytes (same inode, same size), its modification time put back with
    os.utime: what a script patching the array in place leaves. utime cannot put back the change time: the loop
    only waits for the clock to pass the one the index saw (a coarse clock may not have moved yet)."""
    sample = writer.load_sample(str(path))
    row = sample["hidden_states"][1][2].numpy().tobytes()
    raw = path.read_bytes()
    at = raw.find(row)
    assert at > 0 and raw.find(row, at + 1) == -1
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write((sample["hidden_states"][1][2] + 1).numpy().tobytes())
    while True:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        now = os.stat(path)
        if now.st_ctime_ns != before.st_ctime_ns:
            break
    assert (now.st_size, now.st_mtime_ns, now.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    assert writer.load_sample(str(path))["input_ids"].tolist() == sample["input_ids"].tolist()


@pytest.mark.parametrize("verify_kept", [False, True])
def test_a_kept_file_edited_in_place_with_its_size_and_time_put_back_is_refused(tiny_llama, dataset, tmp_path,
                                                                                 fake_engine, reads, verify_kept):
    """Its token ids, stamp and shapes are as written: only the digest of its bytes at write time tells. Before,
    both --resume (size and modification time matched the index) and --resume --verify-kept kept it."""
    out = tmp_path / "out"
    _half_done(tiny_llama, dataset, out)
    victim = out / "data_1.pt"
    _edit_states_in_place(victim)
    reads.clear()
    with pytest.raises(writer.OutputDirectoryConflict, match=r"data_1\.pt was changed since a run of this directory "
                                                             r"wrote it: input line 2: its bytes are not those"):
        job.run(_opts(tiny_llama, dataset, out, resume=True, verify_kept=verify_kept))
    assert "data_1.pt" in reads and not (out / "data_config.json").exists()
    victim.unlink()  # as the message says: its batch is redone
    assert job.run(_opts(tiny_llama, dataset, out, resume=True))["complete"]


def test_each_line_records_what_utime_cannot_put_back_and_the_digest_of_the_bytes_written(tiny_llama, dataset,
                                                                                          tmp_path, fake_engine):
    out = tmp_path / "out"
    job.run(_opts(tiny_llama, dataset, out, format="safetensors"))
    for entry in written_index.read_index(str(out)).values():
        path = out / entry["f"]
        st = os.stat(path)
        assert (entry["ino"], entry["c"]) == (st.st_ino, st.st_ctime_ns)
        assert entry["h"] == atomic_io.file_content_digest(str(path)) == atomic_io.content_digest(path.read_bytes())


def _strip_index(out, *keys):
    """The index as an earlier release wrote it: its lines without `keys`."""
    lines = [json.loads(line) for line in (out / written_index.INDEX_FILE).read_text().splitlines()]
    (out / written_index.INDEX_FILE).write_text("".join(json.dumps({k: v for k, v in e.items() if k not in keys}) + "\n"
                                                 for e in lines))


def test_lines_of_an_earlier_release_vouch_for_nothing_and_the_log_says_what_was_checked(tiny_llama, dataset,
                                                                                        tmp_path, fake_engine,
                                                                                        reads, capsys):
    """A line without the file's inode and change time cannot tell a file edited in place: its file is opened and
    checked (ids, mask, stamp, shapes; no digest to compare). The resume's line says which files were not opened
    and what was checked of the others (it said "(each checked)" of files it never opened)."""
    out = tmp_path / "out"
    _half_done(tiny_llama, dataset, out)
    _strip_index(out, "ino", "c", "h")
    capsys.readouterr()
    reads.clear()
    assert job.run(_opts(tiny_llama, dataset, out, resume=True))["complete"]
    kept = {f"data_{i}.pt" for k in range(0, N // 4, 2) for i in range(4 * k, 4 * k + 4)}
    assert kept <= set(reads)
    said = capsys.readouterr().err
    assert "resume: 12 of this run's files kept, 3 batches to do: 12 opened and checked" in said, said
    assert "(each checked)" not in said and "no digest of their bytes recorded" in said, said
    capsys.readouterr()
    job.run(_opts(tiny_llama, dataset, out, resume=True))  # every line now one of this release
    said = capsys.readouterr().err
    assert "resume: 24 of this run's files kept, 0 batches to do: 12 unchanged since written" in said, said
    job.run(_opts(tiny_llama, dataset, out, resume=True, verify_kept=True))
    said = capsys.readouterr().err
    assert "24 opened and checked" in said and "12 of them also against the digest of their bytes as written" in said
