"""The tokenized input kept in --out (extract/spool.py): a --resume, or another --shard of the set, reads it back
instead of tokenizing the input again, only where the input's bytes, the tokenizer's files, the releases and the
reading options are those that made it; anything else (a changed folder, a cut or foreign file) is read as no spool."""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest

from eagle_compat.errors import InvalidInput
from eagle_compat.extract import atomic_io, file_hashes, inputs, job, spool, writer

from helpers import extract_options, rewrite_in_place, rewritten_after_its_digest, write_dataset

N = 24


@pytest.fixture
def dataset(tmp_path):
    # conversations and pre-tokenized lines; --min-loss-tokens 8 leaves some out (listed with their cuts)
    return write_dataset(tmp_path / "data.jsonl", N, 10, 40, seed=13, conversations_every=3)


def _opts(model, data, out, **kw):
    kw.setdefault("min_loss_tokens", 8)
    kw.setdefault("max_len", 32)
    return extract_options(model, data, out, **kw)


@pytest.fixture
def tokenized(monkeypatch):
    """How many times the input was read and tokenized."""
    calls: list[str] = []
    real = inputs.read_dataset

    def counting(path, *args, **kwargs):
        calls.append(path)
        return real(path, *args, **kwargs)
    monkeypatch.setattr(inputs, "read_dataset", counting)
    return calls


def _held(data: inputs.Dataset) -> inputs.Dataset:
    """A spool's dataset with its samples read into a list (a spool reads them from its file when asked for)."""
    return dataclasses.replace(data, samples=list(data.samples))


def _files(out) -> dict[str, bytes]:
    return {f: (out / f).read_bytes() for f in sorted(os.listdir(out)) if f.startswith("data_") and f.endswith(".pt")}


def test_the_spool_holds_exactly_what_the_read_returned(tiny_llama, dataset, tmp_path):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    data = inputs.read_dataset(dataset, tokenizer, 32, min_loss_tokens=8)
    assert data.few_loss_tokens and any(s.cut.tokens for s in data.samples)  # the case is there to be kept
    key = spool.key(file_hashes.file_sha256(dataset), tiny_llama, tokenizer, {"max_len": 32})
    spool.save(str(tmp_path), key, data)
    back = spool.load(str(tmp_path), key)
    assert _held(back) == data  # samples (index, ids, mask, line, cut), left-out lines with their cuts, notes
    assert [type(s.input_ids) for s in back.samples[:1]] == [type(data.samples[0].input_ids)]
    assert list(back.samples) == [back.samples[k] for k in range(len(back.samples))]  # read in order, or one by one
    assert len(back.samples.indices) == len(data.samples)  # what memory holds of it: an index per sample


def test_a_spool_made_otherwise_cut_short_or_damaged_is_no_spool(tiny_llama, dataset, tmp_path):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    data = inputs.read_dataset(dataset, tokenizer, 32)
    key = spool.key(file_hashes.file_sha256(dataset), tiny_llama, tokenizer, {"max_len": 32})
    path = spool.save(str(tmp_path), key, data)
    assert _held(spool.load(str(tmp_path), key)) == data
    for other in ({"reading": {"max_len": 33}}, {"data_sha256": "0" * 64}, {"tokenizer_files_sha256": ""},
                  {"chat_template_sha256": ""}, {"reading_code_sha256": ""}):
        assert spool.load(str(tmp_path), {**key, **other}) is None, other
    whole = open(path, "rb").read()
    flipped = bytearray(whole)
    flipped[len(spool.MAGIC) + spool._RECORD.size + 1] ^= 1  # a token of the first sample: the digest no longer matches
    huge_header = whole[:-16] + (2**62).to_bytes(8, sys.byteorder) + spool.MAGIC
    for broken in (whole[:-1], whole + b"\0", b"not a spool", whole[:20], bytes(flipped), huge_header):
        with open(path, "wb") as f:
            f.write(broken)
        assert spool.load(str(tmp_path), key) is None, len(broken)


def test_the_key_covers_every_tokenizer_file_of_the_model_folder(tiny_llama, tmp_path):
    import shutil
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    before = spool.tokenizer_files_sha256(str(model))
    (model / "additional_chat_templates").mkdir()
    (model / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    with_template = spool.tokenizer_files_sha256(str(model))
    assert with_template != before
    (model / "merges.txt").write_text("a b")
    assert spool.tokenizer_files_sha256(str(model)) != with_template
    weights_before = spool.tokenizer_files_sha256(str(model))
    (model / "model.safetensors").write_bytes(b"other weights")  # weights do not tokenize
    assert spool.tokenizer_files_sha256(str(model)) == weights_before


def test_an_edited_chat_template_tokenizes_again(tiny_llama, dataset, tmp_path, fake_engine, tokenized):
    # the settings record does not hash chat_template.jinja; a resume after an edit must not reuse the old reading
    import shutil
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    template = model / "chat_template.jinja"
    assert template.exists()
    out = tmp_path / "out"
    job.run(_opts(str(model), dataset, out, shard=(0, 2)))
    template.write_text(template.read_text() + "\n")
    job.run(_opts(str(model), dataset, out, shard=(1, 2)))
    assert len(tokenized) == 2


def test_a_resume_reads_the_input_back_and_writes_the_same_files(tiny_llama, dataset, tmp_path, fake_engine,
                                                                 tokenized, capsys):
    full, out = tmp_path / "full", tmp_path / "out"
    job.run(_opts(tiny_llama, dataset, full))
    job.run(_opts(tiny_llama, dataset, out))
    assert (out / writer.SPOOL_FILE).exists() and len(tokenized) == 2
    for name in list(_files(out))[::3]:  # a killed run's set: some files missing
        os.unlink(out / name)
    capsys.readouterr()
    summary = job.run(_opts(tiny_llama, dataset, out, resume=True))
    assert len(tokenized) == 2, "the resume tokenized the input again"
    assert "input read back from .eagle-compat-input.bin" in capsys.readouterr().err
    assert summary["complete"] and _files(out) == _files(full)
    record = json.loads((out / writer.MANIFEST).read_text())
    assert record["left_out_few_loss_tokens"] == json.loads((full / writer.MANIFEST).read_text())[
        "left_out_few_loss_tokens"]


def test_another_transformers_release_tokenizes_again(tiny_llama, dataset, tmp_path, fake_engine, tokenized,
                                                     monkeypatch):
    import transformers
    out = tmp_path / "out"
    job.run(_opts(tiny_llama, dataset, out, shard=(0, 2)))
    monkeypatch.setattr(transformers, "__version__", "99.0.0")  # its tokenizers may cut the text otherwise
    job.run(_opts(tiny_llama, dataset, out, shard=(1, 2)))
    assert len(tokenized) == 2
    job.run(_opts(tiny_llama, dataset, out, resume=True))  # the second run kept its own reading
    assert len(tokenized) == 2


def test_a_spool_that_cannot_be_written_costs_only_the_next_read(tiny_llama, dataset, tmp_path, fake_engine,
                                                                 monkeypatch, capsys):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(spool.Builder, "keep", full_disk)
    summary = job.run(_opts(tiny_llama, dataset, tmp_path / "out"))
    assert summary["complete"]
    assert "the tokenized input could not be kept in --out (No space left on device)" in capsys.readouterr().err


def test_an_input_the_disk_cannot_hold_is_refused_before_out_is_made(tiny_llama, dataset, tmp_path, fake_engine,
                                                                     monkeypatch):
    """The samples are held on --out's file system while the run goes (not in memory): where it is full, the run
    says so before anything is written."""
    real_write = spool.io.BufferedWriter.write

    def full_disk(self, data):
        if getattr(self, "name", None) is not None and len(data) > 0 and self.tell() > 64:
            raise OSError(28, "No space left on device")
        return real_write(self, data)
    monkeypatch.setattr(spool.io, "BufferedWriter", type("Full", (spool.io.BufferedWriter,), {"write": full_disk}))
    with pytest.raises(atomic_io.OutputWriteError, match=r"tokenized input cannot be written in .*No space left"):
        job.run(_opts(tiny_llama, dataset, tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_the_spool_is_linked_into_out_not_copied_where_the_file_system_can(tiny_llama, dataset, tmp_path,
                                                                           fake_engine, monkeypatch):
    try:
        os.close(os.open(tmp_path, os.O_TMPFILE | os.O_RDWR, 0o600))
    except OSError:
        pytest.skip("this file system has no O_TMPFILE: the spool is copied in")

    def no_copy(*args, **kwargs):
        raise AssertionError("the spool was copied")
    monkeypatch.setattr(spool.shutil, "copyfileobj", no_copy)
    out = tmp_path / "out"
    job.run(_opts(tiny_llama, dataset, out))
    assert (out / spool.SPOOL_FILE).stat().st_nlink == 1
    assert not [f for f in os.listdir(out) if ".tmp" in f]
    with open(out / spool.SPOOL_FILE, "rb") as f:
        assert spool.header_of(f)[0]["samples"] == 20


def test_an_input_changed_between_its_digest_and_its_reading_is_refused_before_out_is_made(tiny_llama, dataset,
                                                                                           tmp_path, fake_engine,
                                                                                           monkeypatch):
    """The key's digest must be of the bytes the spool's samples come from: the input's identity is taken before
    its digest, and judged again when its last byte has been read."""
    real_sha256 = file_hashes.file_sha256

    def digest_then_append(path):  # a line added between the digest and the reading
        digest = real_sha256(path)
        if os.path.abspath(path) == os.path.abspath(dataset):
            with open(dataset, "a") as f:
                f.write(json.dumps({"input_ids": [5, 6, 7, 8, 9, 10, 11, 12]}) + "\n")
        return digest
    monkeypatch.setattr(file_hashes, "file_sha256", digest_then_append)
    out = tmp_path / "out"
    with pytest.raises(InvalidInput, match="changed while it was read") as caught:
        job.run(_opts(tiny_llama, dataset, out))
    assert isinstance(caught.value, spool.InputChanged) and dataset in str(caught.value)
    assert not out.exists()


def test_an_input_rewritten_in_place_between_its_digest_and_its_reading_is_refused_before_out_is_made(
        tiny_llama, dataset, tmp_path, fake_engine, monkeypatch):
    """Its inode, size and modification time put back, the input's identity says nothing: the SHA-256 of the bytes
    the reading consumed is compared with the settings' data_sha256. Before, the set completed from the rewritten
    bytes while its record (and its spool's key) named the digest taken first."""
    rewritten_after_its_digest(monkeypatch, dataset)
    out = tmp_path / "out"
    with pytest.raises(spool.InputChanged, match="SHA-256 of the bytes read") as caught:
        job.run(_opts(tiny_llama, dataset, out))
    assert dataset in str(caught.value)
    assert not out.exists()


def test_a_spool_is_keyed_by_the_bytes_its_samples_were_read_from(tiny_llama, dataset, tmp_path):
    """A spool read from other bytes than the digest it was handed stands for those bytes, never for the digest: a
    resume with the input the digest is of reads the input again."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    planned = file_hashes.file_sha256(dataset)
    rewrite_in_place(dataset)
    data = inputs.read_dataset(dataset, tokenizer, 32)
    assert data.data_sha256 == file_hashes.file_sha256(dataset) != planned  # the bytes consumed, not those planned
    key = spool.key(planned, tiny_llama, tokenizer, {"max_len": 32})
    spool.save(str(tmp_path), key, data)
    assert spool.load(str(tmp_path), key) is None
    back = spool.load(str(tmp_path), {**key, "data_sha256": data.data_sha256})
    assert back is not None and back.data_sha256 == data.data_sha256
