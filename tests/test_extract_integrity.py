"""eagle-compat extract under misuse and faults, without an engine: the output directory is the unit of consistency
(one settings record, refusals that leave it untouched, one writer at a time, temporary files swept, a whole set
described for speculators), bad input lines named before any engine, a failing writer, --max-len against the model,
loss-mask coverage. Where samples must be produced, a deterministic stand-in engine replaces vLLM: these tests are
about which files the job writes, keeps and refuses; test_extract.py checks the tensors on real vLLM."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
import time

import pytest
import torch

import eagle_compat.generator
from eagle_compat import InvalidInput, tiny_models
from eagle_compat.errors import EagleCompatError, OutputDirectoryBusy
from eagle_compat.extract import atomic_io, directory_lock, file_hashes, inputs, job, job_options, writer

from helpers import HIDDEN, FakeEngine, prompts  # noqa: F401 - FakeEngine: the stand-in engine, also for other suites
N = 12  # samples in the dataset; batch size 4: three batches


@pytest.fixture(scope="module")
def model():
    return tiny_models.build_tiny_model("llama")


def _write_lines(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


@pytest.fixture
def dataset(tmp_path):
    records = []
    for n, ids in enumerate(prompts(N, 10, 40, seed=5)):
        if n % 3 == 0:
            records.append({"conversations": [
                {"role": "user", "content": " ".join(f"w{t - 7}" for t in ids[:5])},
                {"role": "assistant", "content": " ".join(f"w{t - 7}" for t in ids[5:15])}]})
        else:
            records.append({"input_ids": ids})
    return _write_lines(tmp_path / "data.jsonl", records)


def _opts(model, data, out, **kw):
    kw.setdefault("layers", [0, 5])
    kw.setdefault("batch_size", 4)
    return job.ExtractOptions(model=model, data=data, out=str(out), progress=False, **kw)


def _snapshot(out):
    """Every file in --out with its content hash and mtime: a refused run must change none of them."""
    if not os.path.isdir(out):
        return None
    snap = {}
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name)
        with open(path, "rb") as f:
            snap[name] = (hashlib.sha256(f.read()).hexdigest(), os.stat(path).st_mtime_ns)
    return snap


def _samples(out):
    return sorted((f for f in os.listdir(out) if re.match(r"^(data|hs)_\d+\.pt$", f)), key=lambda f: (len(f), f))


def _equal_dirs(a, b):
    assert _samples(a) == _samples(b) and _samples(a)
    for name in _samples(a):
        x, y = writer.load_sample(os.path.join(a, name)), writer.load_sample(os.path.join(b, name))
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        for h, g in zip(x["hidden_states"], y["hidden_states"], strict=True):
            assert torch.equal(h, g), name


# ---- item 1: the directory is the unit of consistency ------------------------------------------------------------

def test_other_layers_into_a_sharded_directory_are_refused_and_nothing_is_touched(model, dataset, tmp_path,
                                                                                 fake_engine):
    """The issue's reproduction: --shard 0/2 --layers 0,5, then an unsharded --layers 2,5 without --resume."""
    out = tmp_path / "out"
    job.run(_opts(model, dataset, out, layers=[0, 5], shard=(0, 2)))
    before = _snapshot(out)
    assert _samples(out)
    for resume in (False, True):
        with pytest.raises(InvalidInput, match=r"layer_ids: was \[0, 5\], now \[2, 5\]"):
            job.run(_opts(model, dataset, out, layers=[2, 5], resume=resume))
        assert _snapshot(out) == before
    assert fake_engine.started == 1


def test_samples_without_a_settings_record_are_refused(model, dataset, tmp_path, fake_engine):
    out = tmp_path / "out"
    job.run(_opts(model, dataset, out, shard=(0, 2)))
    for record in out.glob("manifest*.json"):
        record.unlink()
    before = _snapshot(out)
    for layers, resume in (([2, 5], False), ([2, 5], True), ([0, 5], True)):  # other settings, and even the same
        with pytest.raises(InvalidInput, match="no settings record") as exc:
            job.run(_opts(model, dataset, out, layers=layers, resume=resume))
        assert "data_0.pt" in str(exc.value)
        assert _snapshot(out) == before
    os.mkdir(tmp_path / "theirs")  # files another tool wrote (speculators' hs_{i}.pt) count too
    (tmp_path / "theirs" / "hs_3.pt").write_bytes(b"x")
    with pytest.raises(InvalidInput, match="hs_3.pt"):
        job.run(_opts(model, dataset, tmp_path / "theirs"))
    assert fake_engine.started == 1


def test_shards_end_with_one_record_and_data_config_for_the_whole_set(model, dataset, tmp_path, fake_engine):
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    job.run(_opts(model, dataset, whole))
    first = job.run(_opts(model, dataset, sharded, shard=(1, 2)))
    assert not os.path.exists(sharded / "data_config.json")
    second = job.run(_opts(model, dataset, sharded, shard=(0, 2)))
    assert sorted(f for f in os.listdir(sharded) if f.endswith(".json")) == ["data_config.json", "manifest.json"]
    config = json.load(open(sharded / "data_config.json"))
    assert config["data"]["num_samples"] == N and config["hidden_states"]["layer_ids"] == [0, 5]
    assert not first["complete"] and second["complete"] and second["samples"] == N
    manifest = json.load(open(sharded / "manifest.json"))
    assert manifest["status"] == "complete" and [r["shard"] for r in manifest["runs"]] == ["1/2", "0/2"]
    _equal_dirs(whole, sharded)
    before = _snapshot(sharded)
    with pytest.raises(InvalidInput, match="pass --resume"):  # the same shard again
        job.run(_opts(model, dataset, sharded, shard=(0, 2)))
    assert _snapshot(sharded) == before
    assert job.run(_opts(model, dataset, sharded, resume=True))["written_this_run"] == 0  # the merge check


@contextlib.contextmanager
def _first_run_held(model, dataset, out, fake_engine):
    """A first run of --out started on a thread and held inside the engine once its record (and lock) exist; on
    leaving, released and joined. Yields the list that receives the first run's error, if any."""
    fake_engine.block = threading.Event()
    first_error: list = []

    def first():
        try:
            job.run(_opts(model, dataset, out))
        except BaseException as exc:  # noqa: BLE001
            first_error.append(exc)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        for _ in range(600):  # the first run holds the lock once its record is written
            if os.path.exists(out / "manifest.json"):
                break
            thread.join(0.1)
        yield first_error
    finally:
        fake_engine.block.set()
        thread.join(60)


def test_a_second_run_on_a_locked_directory_is_refused_naming_the_holder(model, dataset, tmp_path, fake_engine):
    out = tmp_path / "out"
    with _first_run_held(model, dataset, out, fake_engine) as first_error:
        with pytest.raises(InvalidInput, match=rf"pid {os.getpid()} on "):
            job.run(_opts(model, dataset, out, shard=(1, 2)))
    assert not first_error and len(_samples(out)) == N


def test_a_lock_file_removed_while_a_run_holds_out_lets_no_second_run_in(model, dataset, tmp_path, fake_engine):
    """A clean-up of *.lock files while a run holds --out: a second run is refused (the folder itself is locked), and
    the holder stops before writing its next batch (its lock file no longer guards it)."""
    out = tmp_path / "out"
    with _first_run_held(model, dataset, out, fake_engine) as first_error:
        (out / directory_lock.LOCK_FILE).unlink()
        with pytest.raises(OutputDirectoryBusy, match=r"being written by another run \(holder unknown: its "
                                                      r"\.eagle-compat\.lock was removed"):
            job.run(_opts(model, dataset, out, shard=(1, 2)))
        assert not (out / directory_lock.LOCK_FILE).exists()  # refused before it made a lock file of its own
    assert len(first_error) == 1 and isinstance(first_error[0], directory_lock.LockFileRemoved), first_error
    assert "was removed or replaced while this run held it" in str(first_error[0])
    assert not _samples(out) and fake_engine.started == 1
    assert job.run(_opts(model, dataset, out, resume=True))["complete"]


def test_temp_files_of_a_dead_run_are_swept(model, dataset, tmp_path, fake_engine):
    out = tmp_path / "out"
    job.run(_opts(model, dataset, out, shard=(0, 2)))
    stale = ["data_5.pt.tmp-999999", "manifest.json.tmp-424242"]
    for name in stale:
        (out / name).write_bytes(b"partial")
    summary = job.run(_opts(model, dataset, out, shard=(1, 2)))
    assert not [f for f in os.listdir(out) if ".tmp-" in f]
    assert sorted(summary["temp_files_swept"]) == sorted(stale)


# ---- item 6: bad input lines, a failing writer --------------------------------------------------------------------

GOOD = {"input_ids": [5, 6, 7]}
CHAT = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4"}]


@pytest.mark.parametrize("bad, message", [
    ('{"input_ids": [5, 6', "not JSON"),
    ('[1, 2, 3]', "a JSON list; each line is one JSON object"),
    ({"text": "hello"}, "a line needs 'conversations' (or 'messages') or 'input_ids'"),
    ({"input_ids": [5, "x"]}, "input_ids must be a list of ints"),
    ({"input_ids": [5, 6], "loss_mask": [1]}, "loss_mask must be a list of 0/1 values, one per input id (2)"),
    ({"input_ids": [5, 6], "loss_mask": "11"}, "got a str"),
    ({"input_ids": [5, 100000]}, "token id 100000 outside the model's vocabulary [0, 511]"),
    ({"input_ids": [5, -3, 7]}, "token id -3 outside the model's vocabulary [0, 511]"),
    ({"input_ids": [5, 512, 600]}, "token id 512 outside the model's vocabulary [0, 511]"),  # the first one named
    ({"conversations": []}, "must be a non-empty list of messages"),
    ({"conversations": [{"role": "robot", "content": "hi"}]}, "message needs a role in"),
    ({"conversations": CHAT, "input_ids": [5, 6, 7]}, "holds both a conversation and 'input_ids'/'loss_mask', which"),
    (b'{"input_ids": [5, 6]}\xff', "not UTF-8 text"),
])
def test_a_malformed_line_is_named_before_any_engine(model, tmp_path, no_engine, bad, message):
    data = tmp_path / "data.jsonl"
    with open(data, "wb") as f:
        for record in (GOOD, GOOD, bad, GOOD):
            f.write(record if isinstance(record, bytes) else
                    (record if isinstance(record, str) else json.dumps(record)).encode())
            f.write(b"\n")
    out = tmp_path / "out"
    with pytest.raises(InvalidInput, match=r"data\.jsonl:3: .*" + re.escape(message)):
        job.run(_opts(model, str(data), out))
    assert not out.exists()  # nothing written, not even the directory


def test_a_line_with_a_conversation_and_input_ids_that_agree_is_taken(model, tmp_path):
    """Both forms in one line were resolved silently in favour of the conversation; now they must agree (the
    parametrized case above: they differ, refused)."""
    from transformers import AutoTokenizer
    from eagle_compat.extract import inputs
    tok = AutoTokenizer.from_pretrained(model)
    data = _write_lines(tmp_path / "one.jsonl", [{"conversations": CHAT}])
    ids = list(inputs.read_dataset(data, tok, 256, vocab_size=512).samples[0].input_ids)
    both = _write_lines(tmp_path / "both.jsonl", [{"conversations": CHAT, "input_ids": ids}])
    assert list(inputs.read_dataset(both, tok, 256, vocab_size=512).samples[0].input_ids) == ids
    every = _write_lines(tmp_path / "mask.jsonl", [{"conversations": CHAT, "input_ids": ids, "loss_mask": [1] * len(ids)}])
    with pytest.raises(InvalidInput, match=r"mask\.jsonl:1: holds both .* which differ"):
        inputs.read_dataset(every, tok, 256, vocab_size=512)  # the line's own mask: not dropped without a word


def _fail_on_write(monkeypatch, after: int):
    """The disk fills up while sample `after` (and any later one) is written: its temporary file is already on disk.
    By index, not by count: several writer threads save a batch at once."""
    real_fsync = os.fsync

    def fsync(fd):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if name.startswith("data_") and ".pt.tmp-" in name and int(name[5:name.index(".")]) >= after:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_failing_writer_is_a_clear_error_and_resume_completes(model, dataset, tmp_path, fake_engine, monkeypatch):
    clean, out = tmp_path / "clean", tmp_path / "out"
    job.run(_opts(model, dataset, clean))
    with monkeypatch.context() as m:
        _fail_on_write(m, after=5)
        # whichever of the batch's samples 5-7 a writer thread reaches first is the one named
        with pytest.raises(EagleCompatError, match=r"could not write .*data_[5-7]\.pt: No space left on device"
                                                          r".*rerun the same command with --resume"):
            job.run(_opts(model, dataset, out))
    # nothing from data_5 on; data_4, the same batch's, may or may not have been written when the pool stopped
    assert {f"data_{i}.pt" for i in range(4)} <= set(_samples(out)) <= {f"data_{i}.pt" for i in range(5)}
    assert not [f for f in os.listdir(out) if ".tmp-" in f]
    manifest = json.load(open(out / "manifest.json"))
    assert manifest["status"] == "incomplete" and manifest["runs"][-1]["status"].startswith("failed: OutputWriteError")
    assert not os.path.exists(out / "data_config.json")
    summary = job.run(_opts(model, dataset, out, resume=True))
    assert summary["complete"] and summary["written_this_run"] == 8  # the batch with data_5 is redone whole
    _equal_dirs(clean, out)


def test_a_full_disk_leaves_no_partial_file_and_resume_completes(model, dataset, tmp_path, fake_engine):
    """A real ENOSPC: the output directory is a 1 MiB tmpfs (needs root; skipped where mount is not allowed)."""
    clean, mount = tmp_path / "clean", tmp_path / "tmpfs"
    out = mount / "out"  # the filler beside it, on the same file system (an --out of the user's files is refused)
    job.run(_opts(model, dataset, clean))
    os.mkdir(mount)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        filler = mount / "filler"
        sizes = sorted(os.path.getsize(clean / f) for f in _samples(clean))
        filler.write_bytes(b"\0" * (1024 * 1024 - 4 * sizes[-1] - 64 * 1024))  # room for a few samples only
        with pytest.raises(EagleCompatError, match="No space left on device"):
            job.run(_opts(model, dataset, out))
        kept = _samples(out)
        assert 0 < len(kept) < N and not [f for f in os.listdir(out) if ".tmp-" in f]
        for name in kept:  # every file left is whole and equal to the clean run's
            assert open(out / name, "rb").read() == open(clean / name, "rb").read()
        filler.unlink()
        assert job.run(_opts(model, dataset, out, resume=True))["complete"]
        _equal_dirs(clean, out)
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=False)  # a writer thread may still hold a file


# ---- item 7: --max-len follows the model ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def short_model(model, tmp_path_factory):
    """The tiny Llama with max_position_embeddings=512."""
    path = tmp_path_factory.mktemp("short") / "model"
    shutil.copytree(model, path)
    config = json.load(open(path / "config.json"))
    config["max_position_embeddings"] = 512
    json.dump(config, open(path / "config.json", "w"))
    return str(path)


def test_max_len_default_follows_the_model_and_is_in_the_manifest(short_model, dataset, tmp_path, fake_engine):
    summary = job.run(_opts(short_model, dataset, tmp_path / "out"))
    assert json.load(open(tmp_path / "out" / "data_config.json"))["data"]["seq_length"] == 511
    assert summary["max_len"] == 511 and fake_engine.max_model_len == 512  # what the engine is asked for
    note = json.load(open(tmp_path / "out" / "manifest.json"))["max_len"]
    assert note["value"] == 511 and note["model_limit"] == 511
    assert "max_position_embeddings=512" in note["model_limit_from"]
    assert json.load(open(tmp_path / "out" / "data_config.json"))["data"]["seq_length"] == 511


def test_a_max_len_the_model_cannot_take_is_refused_before_the_engine(short_model, dataset, tmp_path, no_engine):
    with pytest.raises(InvalidInput, match=r"--max-len 2048: this model takes at most 511 tokens per sample "
                                           r"\(max_position_embeddings=512 in config.json"):
        job.run(_opts(short_model, dataset, tmp_path / "out", max_len=2048))
    assert not (tmp_path / "out").exists()


# ---- item 8: loss-mask coverage ------------------------------------------------------------------------------------

# renders earlier assistant turns without their reasoning (as Qwen3's template does): the old mask dropped them
THINK_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
    "<|assistant|> {{ m['content'].split('</think>')[-1] }} </s> "
    "{% else %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}")


@pytest.fixture(scope="module")
def think_model(model, tmp_path_factory):
    return _with_template(model, tmp_path_factory.mktemp("think") / "model", THINK_TEMPLATE)


def _think_data(tmp_path):
    two_turns = {"conversations": [
        {"role": "user", "content": "w10 w11"}, {"role": "assistant", "content": "w12 w13 </think> w14 w15"},
        {"role": "user", "content": "w16"}, {"role": "assistant", "content": "w17 w18"}]}
    return _write_lines(tmp_path / "think.jsonl", [GOOD, two_turns, GOOD])


def test_an_assistant_turn_that_cannot_be_located_is_an_error_naming_the_line(think_model, tmp_path, no_engine):
    with pytest.raises(InvalidInput, match=r"think.jsonl:2: assistant message 1 .*--skip-uncovered"):
        job.run(_opts(think_model, _think_data(tmp_path), tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_skip_uncovered_counts_and_reports_the_skipped_conversation(think_model, tmp_path, fake_engine):
    summary = job.run(_opts(think_model, _think_data(tmp_path), tmp_path / "out", skip_uncovered=True))
    assert [s["line"] for s in summary["skipped"]] == [2] and summary["samples"] == 2
    manifest = json.load(open(tmp_path / "out" / "manifest.json"))
    assert manifest["skipped_uncovered"][0]["line"] == 2 and manifest["settings"]["skip_uncovered"] is True
    assert _samples(tmp_path / "out") == ["data_0.pt", "data_2.pt"]  # names stay the lines' indices


def _with_template(model, path, template):
    shutil.copytree(model, path)
    config = json.load(open(path / "tokenizer_config.json"))
    config["chat_template"] = template
    json.dump(config, open(path / "tokenizer_config.json", "w"))
    for extra in ("chat_template.jinja", "chat_template.json"):
        if os.path.exists(path / extra):
            os.unlink(path / extra)
    return str(path)


def test_a_reply_the_template_trims_is_still_in_the_mask(model, tmp_path):
    from transformers import AutoTokenizer

    trimming = _with_template(model, tmp_path / "trim", tiny_models.CHAT_TEMPLATE.replace(
        "{{ m['content'] }}", "{{ m['content'] | trim }}"))
    tok = AutoTokenizer.from_pretrained(trimming)
    messages = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"},
                {"role": "user", "content": "w4"}, {"role": "assistant", "content": " w5 w6\n"}]
    ids, mask = inputs.tokenize_conversation(tok, messages, 512)
    assert tok.convert_ids_to_tokens([i for i, m in zip(ids, mask) if m]) == ["w3", "w5", "w6"]


# Templates whose rendered turn differs from their generation prompt: the reply's search used to start before the
# header, where a short reply matched the header's own letters (R1's "<｜Assistant｜>" holds "A", Qwen3's "<think>"
# holds "hi"); the header token was masked and the reply was not.
R1_LIKE = ("{% for m in messages %}{% if m['role'] == 'user' %}<|user|> {{ m['content'] }} "
           "{% else %}<|assistant|> {{ m['content'] }} </s> {% endif %}{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|> <think> {% endif %}")
QWEN3_LIKE = ("{% for m in messages %}{% if m['role'] == 'assistant' and loop.last %}"
              "<|assistant|> <think> </think> {{ m['content'] }} </s> "
              "{% else %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|> {% endif %}")


@pytest.mark.parametrize("template, reply", [(R1_LIKE, "ant"), (QWEN3_LIKE, "hi")], ids=["r1_like", "qwen3_like"])
def test_a_short_reply_is_masked_where_the_template_put_it_not_in_its_header(model, tmp_path, template, reply):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_with_template(model, tmp_path / "m", template))
    messages = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": reply}]
    text = tok.apply_chat_template(messages, tokenize=False)
    where = text.rindex(f"{reply} </s>")
    assert text.index(reply) < where  # the header holds the reply's letters first
    assert inputs.assistant_spans(tok, messages, text) == [(where, where + len(reply))]
    ids, mask = inputs.tokenize_conversation(tok, messages, 512)
    offsets = tok(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    assert [offsets[j] for j, m in enumerate(mask) if m] == [(where, where + len(reply))]


def test_validate_refuses_a_reply_masked_on_a_header_token_that_holds_its_letters(model, tmp_path, monkeypatch):
    """A reply located inside the template's header decodes as part of it ("ant" in "<|assistant|>"), so spelling
    alone does not notice; the header is a special token the reply does not hold."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_with_template(model, tmp_path / "m", R1_LIKE))
    tok.add_special_tokens({"additional_special_tokens": ["<|assistant|>", "<|user|>"]})
    tok.add_tokens(["ant"])
    messages = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "ant"}]
    text = tok.apply_chat_template(messages, tokenize=False)
    header = text.index("<|assistant|>")
    # where the old search went
    monkeypatch.setattr(inputs, "assistant_pieces", lambda *a: [(header + 8, header + 11, 1, "content")])
    with pytest.raises(InvalidInput, match=r"its masked tokens hold '<\|assistant\|>', a special token reaching "
                                              r"outside the reply \"ant\""):
        inputs.tokenize_conversation(tok, messages, 512, check_decoded=True)
    monkeypatch.undo()
    ids, mask = inputs.tokenize_conversation(tok, messages, 512, check_decoded=True)
    assert tok.convert_ids_to_tokens([i for i, m in zip(ids, mask) if m]) == ["ant"]


def test_validate_checks_that_masked_tokens_spell_the_reply(model, monkeypatch):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    messages = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4"}]
    real = tok.__class__.__call__

    def shifted_offsets(self, *args, **kwargs):  # a tokenizer whose character offsets are off by one token
        enc = real(self, *args, **kwargs)
        if "offset_mapping" in enc:
            enc["offset_mapping"] = enc["offset_mapping"][1:] + enc["offset_mapping"][-1:]
        return enc

    monkeypatch.setattr(tok.__class__, "__call__", shifted_offsets)
    inputs.tokenize_conversation(tok, messages, 512)  # without --validate nothing notices
    with pytest.raises(InvalidInput, match="masked tokens decode to"):
        inputs.tokenize_conversation(tok, messages, 512, check_decoded=True)


# A template whose assistant header depends on the reply (its length): rendered with placeholders, the text around
# the replies differs, so each reply is looked up in order (after the generation header the prefix renders).
LENGTH_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' %}"
                   "[{{ m['content'] | length }}]{% endif %} {{ m['content'] }} </s> {% endfor %}"
                   "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _turns(n: int) -> list[dict]:
    """`n` messages, user and assistant in turn, of 3 to 7 words each."""
    words = [" ".join(f"w{(7 * k + j) % 400}" for j in range(3 + k % 5)) for k in range(n)]
    return [{"role": ("user", "assistant")[k % 2], "content": text} for k, text in enumerate(words)]


def _tokenizer(model, tmp_path, template):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model if template is None else _with_template(model, tmp_path / "m", template))


def _masking_work(tok, monkeypatch, path, messages, max_len: int) -> dict:
    """What reading one conversation costs, counted: messages rendered by the chat template, token offsets visited."""
    work = {"messages rendered": 0, "token offsets visited": 0}
    render, encode = tok.apply_chat_template, tok.__class__.__call__

    class CountedOffsets(list):
        def __iter__(self):
            for item in super().__iter__():
                work["token offsets visited"] += 1
                yield item

    def counted_render(conversation, *args, **kwargs):
        work["messages rendered"] += len(conversation)
        return render(conversation, *args, **kwargs)

    def counted_encode(self, *args, **kwargs):
        enc = encode(self, *args, **kwargs)
        if "offset_mapping" in enc:
            enc["offset_mapping"] = CountedOffsets(enc["offset_mapping"])
        return enc

    with monkeypatch.context() as m:
        m.setattr(tok, "apply_chat_template", counted_render)
        m.setattr(tok.__class__, "__call__", counted_encode)
        inputs.read_dataset(_write_lines(path, [{"conversations": messages}]), tok, max_len, vocab_size=512)
    return work


@pytest.mark.parametrize("template", [None, LENGTH_TEMPLATE], ids=["in_place", "in_order"])
def test_masking_a_long_conversation_grows_linearly_with_its_turns(model, tmp_path, monkeypatch, template):
    """Each reply was tested against every token (and, where the template renders placeholders differently, the
    conversation was rendered again per reply): a 1,000-turn conversation took seconds at --max-len 2048. Twice
    the turns is now at most twice the work."""
    tok = _tokenizer(model, tmp_path, template)
    half = _masking_work(tok, monkeypatch, tmp_path / "half.jsonl", _turns(200), 256)
    whole = _masking_work(tok, monkeypatch, tmp_path / "whole.jsonl", _turns(200) * 2, 256)
    for what, n in whole.items():
        assert n <= 2 * half[what] + 100, f"{what}: {half[what]} for 200 turns, {n} for 400"


def _every_reply_against_every_token(tok, messages, max_len: int) -> tuple[list[int], inputs.Cut]:
    """The mask and the cut as they were computed before: every reply located, tested against every token."""
    text = tok.apply_chat_template(messages, tokenize=False)
    spans = inputs.assistant_spans(tok, messages, text)
    offsets = tok(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    full = [int(any(s < e_tok and b_tok < e for s, e in spans)) for b_tok, e_tok in offsets]
    covering = [[j for j, (b_tok, e_tok) in enumerate(offsets) if s < e_tok and b_tok < e] for s, e in spans]
    kept = [sum(1 for j in c if j < max_len) for c in covering]
    return full[:max_len], inputs.Cut(max(0, len(offsets) - max_len), sum(full) - sum(full[:max_len]), len(spans),
                                      sum(1 for c, n in zip(covering, kept) if c and not n),
                                      sum(1 for c, n in zip(covering, kept) if 0 < n < len(c)))


@pytest.mark.parametrize("template", [None, LENGTH_TEMPLATE, R1_LIKE, QWEN3_LIKE],
                         ids=["in_place", "in_order", "r1_like", "qwen3_like"])
def test_the_mask_and_the_cut_are_those_of_every_reply_tested_against_every_token(model, tmp_path, template):
    tok = _tokenizer(model, tmp_path, template)
    for messages in (_turns(2), _turns(9), _turns(60)):
        for max_len in (1, 7, 37, 100, 256, 10_000):
            cut = inputs.Cut()
            ids, mask = inputs.tokenize_conversation(tok, messages, max_len, cut=cut)
            assert (mask, cut) == _every_reply_against_every_token(tok, messages, max_len), (len(messages), max_len)
            assert len(ids) == len(mask) <= max_len


def test_writes_left_undone_by_a_failure_log_no_traceback_each(caplog):
    """Writers lagging behind (the GPU case) when the run fails or is interrupted: their queued writes are cancelled,
    and each cancelled write used to log "exception calling callback" with a CancelledError traceback."""
    import logging

    from eagle_compat.extract import pipeline
    release = threading.Event()
    caplog.set_level(logging.ERROR, logger="concurrent.futures")
    with pytest.raises(KeyboardInterrupt):
        with pipeline.WriterPool(threads=1, max_pending=8) as pool:
            pool.submit(release.wait)  # the one writer is busy until the queued writes are cancelled
            for _ in range(6):
                pool.submit(lambda: None)  # queued behind it
            shutdown = pool._pool.shutdown

            def cancel_then_release(wait=True, cancel_futures=False):
                shutdown(wait=False, cancel_futures=cancel_futures)
                release.set()
                shutdown(wait=wait)
            pool._pool.shutdown = cancel_then_release
            raise KeyboardInterrupt  # Ctrl-C with writes still queued
    assert not [r for r in caplog.records if "callback" in r.getMessage()], [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("fmt", ["pt", "safetensors", "arrow", "arrow-fp8"])
def test_non_finite_states_are_refused_naming_the_sample_and_layer(tmp_path, fmt):
    """One Inf would otherwise be written as it is (and in fp8 make its token's scale Inf: the token zeros or NaN)."""
    from eagle_compat.extract import formats
    states = [torch.randn(5, 8), torch.randn(5, 8)]
    states[1][3, 2] = float("inf")
    with pytest.raises(writer.NonFiniteStates, match=r"sample 7: layer id 12 has 1 NaN/Inf values, at tokens \[3\]"):
        formats.get(fmt).save(str(tmp_path), 7, 7, torch.arange(5), torch.ones(5, dtype=torch.long), states,
                              layer_ids=[4, 12])
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # nothing of it was written


def _writer_of(out):
    """Another process holding the directory's writers lock shared, as a `--ray` actor does for its life (an orphan
    of a killed driver here); it lets go when its stdin closes."""
    code = ("import sys\n"
            "from eagle_compat.extract import atomic_io, directory_lock, file_hashes, writer\n"
            f"fd = directory_lock.hold_as_writer({str(out)!r})\n"
            "print('holding', flush=True)\n"
            "sys.stdin.read()\n")
    proc = subprocess.Popen([__import__("sys").executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "holding"
    return proc


def test_resume_waits_for_writers_of_an_earlier_run_before_touching_the_directory(model, dataset, tmp_path,
                                                                                   fake_engine, monkeypatch):
    """`--resume` right after a killed `--ray` driver: its orphaned actors may still be writing. The new run sweeps
    temporary files and redoes batches only once they are gone; it waits (here: the orphan ends on the run's first
    wait, a hook) or, past the deadline, refuses naming the lock."""
    out = tmp_path / "out"
    os.makedirs(out)
    orphan = _writer_of(out)
    (out / "data_1.pt.tmp-otherhost-123-0badcafe").write_bytes(b"being written by the orphan")
    seen = []

    def orphan_ends(seconds):
        if not seen:
            seen.append(os.listdir(out))  # nothing was swept while the orphan lived
            orphan.stdin.close()
            orphan.wait()
    monkeypatch.setattr(job, "_say_waiting_once", lambda: orphan_ends)
    summary = job.run(_opts(model, dataset, out))
    assert seen and "data_1.pt.tmp-otherhost-123-0badcafe" in seen[0], seen
    assert summary["temp_files_swept"] == ["data_1.pt.tmp-otherhost-123-0badcafe"]
    run = json.load(open(out / "manifest.json"))["runs"][-1]
    assert run["waited_for_earlier_writers_s"] >= 0 and run["status"] == "complete"

    still = _writer_of(out)
    try:
        monkeypatch.setenv(directory_lock.WRITERS_WAIT_ENV, "0")
        def data(snapshot):  # the directory lock's file names its holder: this run took it, then refused
            return {k: v for k, v in snapshot.items() if k != ".eagle-compat.lock"}
        before = data(_snapshot(out))
        with pytest.raises(OutputDirectoryBusy, match=r"still being written by processes of an earlier run"):
            job.run(_opts(model, dataset, out, resume=True))
        assert data(_snapshot(out)) == before
    finally:
        still.stdin.close()
        still.wait()


def test_temporary_names_are_unique_across_hosts_and_swept(tmp_path, monkeypatch):
    """Two hosts writing one file on shared storage have the same PIDs often: the temporary name carries the host and a
    random part; the sweep knows it and the earlier `.tmp-PID` form."""
    names = []
    monkeypatch.setattr(os, "replace", lambda src, dst: names.append(os.path.basename(src)))
    for _ in range(2):
        atomic_io.atomic_write_bytes(str(tmp_path / "data_0.pt"), b"x")
    assert names[0] != names[1] and all(re.fullmatch(
        rf"data_0\.pt\.tmp-{re.escape(__import__('socket').gethostname())}-{os.getpid()}-[0-9a-f]{{8}}", n) for n in names)
    monkeypatch.undo()
    for n in names + ["data_2.pt.tmp-4242"]:
        (tmp_path / n).write_bytes(b"x")
    assert sorted(writer.sweep_temp_files(str(tmp_path))) == sorted(names + ["data_2.pt.tmp-4242"])


def test_a_resume_whose_samples_tokenize_differently_is_refused_naming_the_file(model, dataset, tmp_path,
                                                                                fake_engine, monkeypatch):
    """Files are bound to samples by position. Resuming with another tokenizer, transformers version or option (on
    another shard machine, say) numbered rows differently and paired files with other samples' states, manifest
    "complete". Now every kept file is checked against its sample by content (its token ids)."""
    out = tmp_path / "out"
    job.run(_opts(model, dataset, out))
    os.unlink(writer.sample_path(str(out), 9, "pt"))  # something left to do
    real = inputs.read_dataset

    def other_tokenizer(*args, into, **kwargs):  # what another transformers version's chat template does to line 3
        data = real(*args, **kwargs)  # into a list, changed, then where extract keeps its samples
        s = data.samples[2]
        data.samples[2] = inputs.Sample(s.index, list(s.input_ids[1:]) + [s.input_ids[0]], s.loss_mask, s.line)
        for sample in data.samples:
            into.append(sample)
        data.samples = into
        return data
    monkeypatch.setattr(inputs, "read_dataset", other_tokenizer)
    import transformers  # another release: the input kept tokenized in --out does not stand for its reading
    real_version = transformers.__version__
    monkeypatch.setattr(transformers, "__version__", "99.0.0")
    before = {k: v for k, v in _snapshot(out).items() if k != ".eagle-compat.lock"}
    with pytest.raises(writer.OutputDirectoryConflict, match=r"data_2\.pt is not the sample it stands for: input "
                                                             r"line 3: the file holds"):
        job.run(_opts(model, dataset, out, resume=True))
    assert {k: v for k, v in _snapshot(out).items() if k != ".eagle-compat.lock"} == before
    monkeypatch.setattr(inputs, "read_dataset", real)  # (not undo(): that would put the real engine back too)
    monkeypatch.setattr(transformers, "__version__", real_version)
    job.run(_opts(model, dataset, out, resume=True))  # the same environment completes it


@pytest.mark.parametrize("fmt", ["pt", "safetensors", "arrow"])
def test_a_shard_merged_in_from_a_run_of_other_layers_is_refused_naming_the_file(model, dataset, tmp_path,
                                                                                fake_engine, fmt):
    """The README's merge: shards run into their own directories, files copied into one, then --resume there. Kept
    files were checked by their token ids only, so shard 1 of --layers 2,5 merged into shard 0's --layers 0,5
    directory completed as one set (the files of layer 2 under a record of layer 0). Each file now carries the stamp of
    the settings that made its states; the merge and the completion check it."""
    a, b = tmp_path / "a", tmp_path / "b"
    job.run(_opts(model, dataset, a, shard=(0, 2), format=fmt))
    job.run(_opts(model, dataset, b, shard=(1, 2), format=fmt, layers=[2, 5]))
    copied = _merge(b, a)
    before = _tree(a)
    with pytest.raises(writer.OutputDirectoryConflict, match=r"is not this run's: input line \d+: its states were made "
                                                             r"with other settings \(another model, --layers or --dtype"):
        job.run(_opts(model, dataset, a, resume=True, format=fmt))
    assert _tree(a) == before
    for name in copied:  # the same shard, run with the directory's settings, merges and completes the set
        (a / name).unlink()
    job.run(_opts(model, dataset, tmp_path / "c", shard=(1, 2), format=fmt))
    _merge(tmp_path / "c", a)
    summary = job.run(_opts(model, dataset, a, resume=True, format=fmt))
    assert summary["complete"] and summary["written_this_run"] == 0


@pytest.mark.parametrize("fmt", ["pt", "safetensors", "arrow", "arrow-fp8"])
def test_each_file_says_what_made_its_states_and_a_file_made_otherwise_is_named(tmp_path, fmt):
    """The facts a kept file is checked by, in every format: its stamp, layer count, hidden size and dtype (a shard
    of float16 files, from an older GPU resolving --dtype auto, merged into a bfloat16 set). A file written before
    stamps existed is judged by the rest."""
    from eagle_compat.extract import formats
    ids, mask = torch.arange(5), torch.ones(5, dtype=torch.long)
    states = [torch.randn(5, 8, dtype=torch.float16) for _ in range(2)]
    fp8 = fmt == "arrow-fp8"
    want = writer.StatesExpected("s1", 2, 8, "torch.bfloat16")

    def why(stamp, states=states):
        path = formats.get(fmt).save(str(tmp_path), 0, 0, ids, mask, states, [0, 5], stamp)
        wrong = writer.first_mismatch([(path, ids.tolist(), mask.tolist(), "line 1")], want)
        return wrong.why if wrong else None
    assert "stamp s0, this run's s1" in why("s0")
    assert "it holds 1 layers of states, this run 2" in why("s1", states[:1])
    assert (why("s1") is None) if fp8 else ("float16, the directory's engine ran torch.bfloat16" in why("s1"))
    states = [h.to(torch.bfloat16) for h in states]
    assert why("s1", states) is None and why(None, states) is None
    assert "hidden size 4, the model 8" in why(None, [h[:, :4] for h in states])
    want.stamped = True  # a set begun by a stamping release: a file without a stamp was made elsewhere
    assert "it carries no stamp of the settings that made its states" in why(None, states)


def test_a_file_without_a_stamp_is_refused_in_a_set_whose_files_carry_one(model, dataset, tmp_path, fake_engine):
    """Shard 1 of --layers 2,5 made by an earlier release (no stamps; layer count, hidden size and dtype agree),
    copied into a --layers 0,5 set begun by this release: the set must not complete with layer 2 under layer 0's
    record. A set begun without stamps keeps taking files without one."""
    a, b = tmp_path / "a", tmp_path / "b"
    job.run(_opts(model, dataset, a, shard=(0, 2)))
    assert json.load(open(a / "manifest.json"))["stamped_files"] is True
    job.run(_opts(model, dataset, b, shard=(1, 2), layers=[2, 5]))
    for path in b.glob("data_*.pt"):  # as an earlier release wrote them
        sample = torch.load(path, weights_only=True)
        del sample[writer.STAMP_KEY]
        torch.save(sample, path)
    _merge(b, a)
    with pytest.raises(writer.OutputDirectoryConflict, match=r"does not belong to this set: input line \d+: it carries "
                                                             r"no stamp of the settings that made its states"):
        job.run(_opts(model, dataset, a, shard=(0, 2), resume=True))
    assert not (a / "data_config.json").exists()


@pytest.mark.parametrize("fmt", ["pt", "arrow"])
def test_the_run_completing_a_set_checks_the_other_shards_files_and_refuses_strays(model, dataset, tmp_path,
                                                                                  fake_engine, fmt):
    """The files of other shards are read only by the run that completes the set: shard 1's files of --layers 2,5
    copied next to shard 0's, then shard 0's --resume, must not complete it; nor may a sample file that stands for
    no sample (speculators 0.3.0 trains on every .pt of the folder)."""
    a, b = tmp_path / "a", tmp_path / "b"
    job.run(_opts(model, dataset, a, shard=(0, 2), format=fmt))
    job.run(_opts(model, dataset, b, shard=(1, 2), format=fmt, layers=[2, 5]))
    copied = _merge(b, a)
    with pytest.raises(writer.OutputDirectoryConflict, match=r"does not belong to this set: (row \d+ \()?input line "
                                                             r"\d+\)?: its states were made with other settings"):
        job.run(_opts(model, dataset, a, shard=(0, 2), format=fmt, resume=True))
    assert json.load(open(a / "manifest.json"))["status"] == "incomplete"
    assert not (a / "data_config.json").exists() and not (a / "state.json").exists()
    for name in copied:
        (a / name).unlink()
    job.run(_opts(model, dataset, a, shard=(1, 2), format=fmt))  # the set is whole now
    stray = a / (f"data_{N + 65}.pt" if fmt == "pt" else f"hidden_states/hs_{N + 65}.safetensors")
    shutil.copy2(a / ("data_0.pt" if fmt == "pt" else "hidden_states/hs_0.safetensors"), stray)
    with pytest.raises(writer.OutputDirectoryConflict, match=rf"{re.escape(stray.name)} \(and 0 more\) stands for no "
                                                             r"sample of this set"):
        job.run(_opts(model, dataset, a, format=fmt, resume=True))
    stray.unlink()
    assert job.run(_opts(model, dataset, a, format=fmt, resume=True))["complete"]


def _files_a_trainer_reads(folder) -> list[str]:
    """What speculators 0.3.0's trainer takes for its samples (speculators/train/data.py, `list_files`): every file
    under the folder, subfolders included, whose name ends in "pt"."""
    return sorted(os.path.relpath(os.path.join(root, name), folder) for root, _, names in os.walk(folder)
                  for name in names if name.endswith("pt"))


@pytest.mark.parametrize("fmt", ["pt", "arrow"])
def test_files_a_trainer_would_take_for_samples_anywhere_under_out_are_refused(model, dataset, tmp_path, fake_engine,
                                                                              fmt):
    """The README's merge done as `cp -r shard1 merged/` (a subfolder), and a file manager's `data_0 (copy).pt`:
    the set completed with its 12 samples, and speculators 0.3.0's trainer, walking the folder, read 17 files."""
    merged, shard1 = tmp_path / "merged", tmp_path / "shard1"
    job.run(_opts(model, dataset, merged, shard=(0, 2), format=fmt))
    job.run(_opts(model, dataset, shard1, shard=(1, 2), format=fmt))
    _merge(shard1, merged)  # the README's merge, and the same shard copied in as a subfolder
    shutil.copytree(shard1, merged / "shard1")
    first = "data_0.pt" if fmt == "pt" else "hidden_states/hs_0.safetensors"
    duplicate = first.replace("_0.", "_0 (copy).")
    shutil.copy2(merged / first, merged / duplicate)
    if fmt == "pt":
        assert len(_files_a_trainer_reads(merged)) == N + 5
    with pytest.raises(writer.OutputDirectoryConflict,
                       match=rf"{re.escape(str(merged / duplicate))} \(and 4 more: shard1/[^)]*\) is not a file of "
                             r"this set.*Move (it|them) out of"):
        job.run(_opts(model, dataset, merged, resume=True, format=fmt))
    assert json.load(open(merged / "manifest.json"))["status"] == "incomplete"
    assert not (merged / "data_config.json").exists() and not (merged / "state.json").exists()
    shutil.move(merged / "shard1", tmp_path / "moved-out")
    (merged / duplicate).unlink()
    assert job.run(_opts(model, dataset, merged, resume=True, format=fmt))["complete"]
    if fmt == "pt":
        assert _files_a_trainer_reads(merged) == sorted(f"data_{i}.pt" for i in range(N))


def test_temporary_names_carry_no_dot_of_the_host_so_every_host_writes_the_same_bytes(tmp_path, monkeypatch):
    """torch.save names its archive after the file's name up to the last dot: a host `node1.cluster` wrote other
    bytes than `node2` for the same sample."""
    import socket
    sample = {"input_ids": torch.arange(4), "hidden_states": [torch.arange(32.0).reshape(4, 8)],
              "loss_mask": torch.ones(4)}
    written = []
    for host in ("node1.cluster.example", "node2"):
        monkeypatch.setattr(socket, "gethostname", lambda host=host: host)
        (tmp_path / host).mkdir()
        written.append(open(writer.save_sample(str(tmp_path / host), 0, sample, "pt", [0], "s"), "rb").read())
    assert written[0] == written[1]


def test_an_earlier_records_set_takes_its_precision_from_its_files_before_the_engine(model, dataset, tmp_path,
                                                                                    fake_engine):
    """A record of an earlier release names no engine dtype: the first kept file's precision stands for it, so an
    engine of another precision is refused before it writes (it was found only at completion, after the engine)."""
    out = tmp_path / "out"
    job.run(_opts(model, dataset, out))
    record = json.load(open(out / "manifest.json"))
    del record["engine_dtype"]
    json.dump(record, open(out / "manifest.json", "w"))
    os.unlink(writer.sample_path(str(out), 7, "pt"))

    class OlderGpu(FakeEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.vllm_config.model_config.dtype = "torch.float16"
            OlderGpu.generated = 0

        def generate(self, *args, **kwargs):
            OlderGpu.generated += 1
            return super().generate(*args, **kwargs)

    fake_engine_cls = eagle_compat.generator.VllmHiddenStatesGenerator
    try:
        eagle_compat.generator.VllmHiddenStatesGenerator = OlderGpu
        with pytest.raises(writer.OutputDirectoryConflict, match=r"engine runs torch.float16 .* written by an engine "
                                                                 r"in torch.float32"):
            job.run(_opts(model, dataset, out, resume=True))
        assert OlderGpu.generated == 0 and not os.path.exists(writer.sample_path(str(out), 7, "pt"))
    finally:
        eagle_compat.generator.VllmHiddenStatesGenerator = fake_engine_cls


def _tree(out):
    """Every file under --out (sub-folders included) with its content hash, but the lock."""
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != directory_lock.LOCK_FILE}


def _merge(src, dst):
    """Copy a shard's sample files into another directory (the README's merge), returning their names."""
    names = []
    for path in src.rglob("*"):
        rel = path.relative_to(src)
        if path.is_file() and re.match(r"^(data|hs)_\d+\.", path.name):
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dst / rel)
            names.append(str(rel))
    return names


def test_validate_is_part_of_the_settings_record(model, dataset, tmp_path, fake_engine):
    """--validate changes which conversations --skip-uncovered leaves out, so it changes the sample set."""
    out = tmp_path / "out"
    job.run(_opts(model, dataset, out, skip_uncovered=True))
    with pytest.raises(writer.OutputDirectoryConflict, match=r"validate: was False, now True"):
        job.run(_opts(model, dataset, out, skip_uncovered=True, validate=True, resume=True))
    job.run(_opts(model, dataset, out, skip_uncovered=True, resume=True))  # the same settings add to it


def test_trust_remote_code_is_part_of_the_settings_record_and_the_stamp(model, dataset, tmp_path, fake_engine):
    """--trust-remote-code builds a checkpoint with `auto_map` from its own config and model classes (DeepSeek, Kimi):
    another model than transformers' classes build. A shard or --resume with the other value is refused naming it,
    a file made with it does not pass for one made without, and a record of an earlier release (which did not
    record it) resumes as made without it."""
    out, other = tmp_path / "out", tmp_path / "other"
    job.run(_opts(model, dataset, out, shard=(0, 2)))
    before = _tree(out)
    for kw in ({"shard": (1, 2)}, {"resume": True}):
        with pytest.raises(writer.OutputDirectoryConflict, match=r"trust_remote_code: was False, now True"):
            job.run(_opts(model, dataset, out, trust_remote_code=True, **kw))
        assert _tree(out) == before
    settings = json.load(open(out / "manifest.json"))["settings"]
    assert settings["trust_remote_code"] is False
    assert writer.states_stamp(settings) != writer.states_stamp({**settings, "trust_remote_code": True})
    job.run(_opts(model, dataset, other, shard=(1, 2), trust_remote_code=True))
    copied = _merge(other, out)  # its files copied in: their stamp names the other value
    with pytest.raises(writer.OutputDirectoryConflict, match=r"its states were made with other settings \(another "
                                                             r"model, --layers or --dtype, or another --trust-remote"):
        job.run(_opts(model, dataset, out, resume=True))
    for name in copied:
        (out / name).unlink()
    record = json.load(open(out / "manifest.json"))
    del record["settings"]["trust_remote_code"]  # as an earlier release wrote it
    (out / "manifest.json").write_text(json.dumps(record))
    assert writer.states_stamp(record["settings"]) == writer.states_stamp(settings)  # its files' stamps hold
    with pytest.raises(writer.OutputDirectoryConflict, match=r"trust_remote_code: was False, now True"):
        job.run(_opts(model, dataset, out, shard=(1, 2), trust_remote_code=True))
    assert job.run(_opts(model, dataset, out, shard=(1, 2)))["complete"]


def test_a_second_ctrl_c_ends_the_run_at_once():
    """The first Ctrl-C stops the run cleanly (tested with a real engine in test_extract.py); a second one while the
    engine closes (a hung worker, a slow shutdown) used to be ignored. Now it ends the process at once, exit 130,
    saying that every file is complete."""
    import sys
    code = ("import os, signal\n"
            "from eagle_compat.extract import job\n"
            "signal.signal(signal.SIGINT, job._stop_on_first_sigint)\n"
            "try:\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "except KeyboardInterrupt:\n"
            "    print('first: stopping cleanly', flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGINT)  # the second, while 'closing'\n"
            "    print('not reached', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130 and proc.stdout == "first: stopping cleanly\n", (proc.returncode, proc.stdout)
    assert "interrupted again: ending now. Every sample file in --out is complete" in proc.stderr


@pytest.mark.parametrize("fmt", ["pt", "arrow"])
def test_one_extract_run_enters_the_job_module_once(model, dataset, tmp_path, fake_engine, fmt):
    """The house's one direction (docs/adr/0039-import-floors.md): `job.run` plans, keeps the record and calls down
    (inputs, writer, the runner, the format); nothing below calls back into extract/job.py, on any thread."""
    import sys
    import threading
    job_file = job.__file__
    entries = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == job_file:
            caller = frame.f_back
            if caller is None or caller.f_code.co_filename != job_file:
                entries.append((frame.f_code.co_name, caller.f_code.co_filename if caller else None))
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        job.run(_opts(model, dataset, tmp_path / "out", layers=[0, 5], format=fmt))
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert [name for name, _ in entries] == ["run"], entries


# ---- where the run's time went: the writers (the disk of --out) setting the pace ---------------------------------


def _wait_until(condition, what):
    """Polls a state another thread sets (no timing window: the test fails only if it never happens)."""
    gate, deadline = threading.Event(), time.monotonic() + 300  # a bound on a stuck run, generous on a busy machine
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        gate.wait(0.01)


def test_the_writer_pool_counts_the_submits_that_waited_for_a_free_slot():
    from eagle_compat.extract import pipeline
    release = threading.Event()
    with pipeline.WriterPool(threads=1, max_pending=1) as pool:
        pool.submit(release.wait)  # the one slot is taken until released
        assert pool.blocked_submits == 0
        second = threading.Thread(target=pool.submit, args=(lambda: None,))
        second.start()
        _wait_until(lambda: pool.blocked_submits == 1, "the second submit waiting for the slot")
        release.set()
        second.join()
    assert pool.blocked_submits == 1 and pool.blocked_s > 0 and pool.done == 2
    with pipeline.WriterPool(threads=2, max_pending=8) as free:
        for _ in range(4):
            free.submit(lambda: None)
    assert free.blocked_submits == 0 and free.blocked_s == 0.0


def _held_writes(monkeypatch):
    """Each write waits until the driver has waited for a writer slot: the wait is certain, not a matter of speed.
    Returns the run's writer pools."""
    from eagle_compat.extract import formats, pipeline
    pools, write_sample = [], formats.write_sample
    original_init = pipeline.WriterPool.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        pools.append(self)

    def held_write(*args, **kwargs):
        _wait_until(lambda: pools and pools[0].blocked_submits, "the driver waiting for a writer")
        return write_sample(*args, **kwargs)

    monkeypatch.setattr(pipeline.WriterPool, "__init__", recording_init)
    monkeypatch.setattr(formats, "write_sample", held_write)
    return pools


def test_a_run_paced_by_its_writers_records_the_driver_s_waits(model, dataset, tmp_path, fake_engine, monkeypatch):
    """One writer thread, four slots, batches of four (three batches): the second batch's first submit waits."""
    pools = _held_writes(monkeypatch)
    summary = job.run(_opts(model, dataset, tmp_path / "out", writer_threads=1))
    record = json.load(open(tmp_path / "out" / "manifest.json"))["runs"][-1]["pipeline"]
    assert summary["pipeline"] == record and record["writer_threads"] == 1
    assert pools[0].blocked_submits >= 1 and pools[0].blocked_s > 0
    assert record["driver_waited_for_writers_s"] <= round(pools[0].blocked_s, 2)
    assert record["seconds"] + 0.015 >= (record["driver_waited_for_writers_s"] + record["driver_waited_for_engine_s"]
                                         + record["last_batch_to_last_file_s"])  # each rounded to 0.01
    assert summary["complete"] and len(_samples(tmp_path / "out")) == N


def test_waits_at_the_last_batch_are_not_counted_as_pacing_the_engine(model, tmp_path, fake_engine, monkeypatch):
    """Two batches of four, one writer thread, four slots: only the last batch's submits wait, when the engine
    has nothing left to do; that time is the tail (`last_batch_to_last_file_s`), not the writers pacing it."""
    data = _write_lines(tmp_path / "eight.jsonl", [{"input_ids": ids} for ids in prompts(8, 10, 40, seed=3)])
    pools = _held_writes(monkeypatch)
    summary = job.run(_opts(model, data, tmp_path / "out", writer_threads=1))
    assert pools[0].blocked_submits >= 1 and pools[0].blocked_s > 0  # all at the last batch: the first fills 4 slots
    assert summary["pipeline"]["driver_waited_for_writers_s"] == 0.0
    assert summary["pipeline"]["last_batch_to_last_file_s"] >= round(pools[0].blocked_s, 2)


def _record(writers, engine, seconds=100.0, threads=8):
    return {"seconds": seconds, "driver_waited_for_writers_s": writers, "driver_waited_for_engine_s": engine,
            "last_batch_to_last_file_s": 0.5, "writer_threads": threads}


def test_the_pace_note_names_the_waits_and_the_remedy_only_when_the_writers_dominate():
    assert job.writers_set_the_pace(None) is None  # a --ray run records no pipeline section
    assert job.writers_set_the_pace(_record(9.9, 1.0)) is None  # under a tenth of the run
    assert job.writers_set_the_pace(_record(40.0, 55.0)) is None  # the engine set the pace
    assert job.writers_set_the_pace(_record(0.9, 0.1, seconds=5.0)) is None  # a tiny run: under a second is no news
    note = job.writers_set_the_pace(_record(61.0, 3.0))
    assert note.startswith("the writers set this run's pace: of its 100.0 s the driver waited 61.0 s for a free "
                           "writer (8 threads) and 3.0 s for the engine")
    assert "a faster one would shorten the run" in note


def test_extract_prints_the_pace_note_between_the_summary_and_the_report(model, dataset, tmp_path, fake_engine,
                                                                        monkeypatch, capsys):
    from eagle_compat import cli
    real_run = job.run

    def run_paced_by_writers(opts):
        summary = real_run(opts)
        return {**summary, "pipeline": _record(61.0, 3.0)}  # what a disk-bound run records

    monkeypatch.setattr(job, "run", run_paced_by_writers)
    assert cli.main(["extract", "--model", model, "--data", dataset, "--out", str(tmp_path / "out"),
                     "--layers", "0,5", "--batch-size", "4", "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("extract: 12 samples in ")
    assert out[1].startswith("extract: the writers set this run's pace: of its 100.0 s"), out
    assert out[2].startswith("data report: 12 samples"), out


@pytest.mark.parametrize("option, value, says", [
    ("tensor_parallel_size", 0, r"--tensor-parallel-size=0; must be an int >= 1"),
    ("gpu_memory_utilization", 1.5, r"--gpu-memory-utilization=1.5; must be in \(0, 1\]"),
    ("kv_cache_memory_bytes", -1, r"--kv-cache-memory-bytes=-1; must be a positive int"),
    ("dtype", "bfloat", r"--dtype='bfloat'; allowed: auto, half, float16, bfloat16, float, float32"),
    ("ray_actors", 4, r"--ray-actors 4 without --ray"),
])
def test_engine_option_typos_are_refused_before_the_directory_is_made(model, dataset, tmp_path, no_engine, option,
                                                                      value, says):
    """Before, these reached the engine after --out held a settings record, and the corrected command was refused
    as "other settings"."""
    with pytest.raises(InvalidInput, match=says):
        job.run(_opts(model, dataset, tmp_path / "out", **{option: value}))
    assert not (tmp_path / "out").exists()


def test_a_record_whose_runs_wrote_no_file_gives_way_to_other_settings(model, dataset, tmp_path, fake_engine,
                                                                       monkeypatch):
    """An engine that cannot start (too many tensor-parallel ranks for the machine, say) leaves only the record:
    nothing there to mix with, so the corrected command runs; its record keeps the replaced one's history. With one
    file written the refusal stands."""
    out = tmp_path / "out"

    def cannot_start(*args, **kwargs):
        raise RuntimeError("no device for rank 3")

    with monkeypatch.context() as m:
        m.setattr(eagle_compat.generator, "VllmHiddenStatesGenerator", cannot_start)
        with pytest.raises(RuntimeError, match="no device for rank 3"):
            job.run(_opts(model, dataset, out, layers=[2, 5], tensor_parallel_size=4))
    failed = json.load(open(out / "manifest.json"))
    assert failed["status"] == "incomplete" and failed["samples_present"] == 0  # no longer "running"
    assert not writer.sample_files(str(out))
    job.run(_opts(model, dataset, out, layers=[2, 5]))
    record = json.load(open(out / "manifest.json"))
    assert record["status"] == "complete" and record["settings"]["tensor_parallel_size"] == 1
    assert record["replaced_record_without_files"]["settings"]["tensor_parallel_size"] == 4
    assert record["replaced_record_without_files"]["runs"][0]["status"].startswith("failed: RuntimeError")
    with pytest.raises(InvalidInput, match="other settings"):
        job.run(_opts(model, dataset, out, layers=[3, 5], resume=True))


def test_a_record_of_a_run_still_marked_running_does_not_give_way(model, dataset, tmp_path, fake_engine):
    """No file yet, but its run may be alive where the lock cannot see it (locks per machine on a shared file
    system): refused as before, saying what to do if no run is writing it."""
    out = tmp_path / "out"
    job.run(_opts(model, dataset, out, layers=[2, 5]))
    record = json.load(open(out / "manifest.json"))
    for name in writer.sample_files(str(out)):
        os.unlink(out / name)
    os.unlink(out / "data_config.json")
    record["status"], record["runs"][-1]["status"] = "running", "running"  # loading its model on another machine
    json.dump(record, open(out / "manifest.json", "w"))
    with pytest.raises(InvalidInput, match=r"(?s)other settings .* \(it holds no sample file: if no run is writing it, "
                                           r"remove its manifest.json\)"):
        job.run(_opts(model, dataset, out, layers=[3, 5]))


def test_resuming_an_earlier_releases_run_with_layers_now_refused_says_to_start_anew(model, dataset, tmp_path,
                                                                                    fake_engine, monkeypatch):
    from eagle_compat import options as options_mod
    from eagle_compat.extract import layers as layers_mod
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(layers_mod, "check_training_layers", lambda *a: None)  # an earlier release's run, cut short
        m.setattr(options_mod, "check_training_layers", lambda *a: None)
        job.run(_opts(model, dataset, out, layers=[0, 1], shard=(0, 2)))
    with pytest.raises(InvalidInput, match=r"the last layer must be .* was made with these layers by an earlier "
                                           r"release, which did not check them: .* Start a new --out"):
        job.run(_opts(model, dataset, out, layers=[0, 1], resume=True))


def test_bad_model_and_out_paths_are_clear_errors_before_the_data_is_read(model, dataset, tmp_path, no_engine):
    empty = tmp_path / "empty_model"
    empty.mkdir()
    broken = tmp_path / "broken_model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    for bad, says in ((dataset, r"is a file; give the model's directory"),
                      (empty, r"has no config.json; give the model.s directory"),
                      (broken, r"config.json cannot be read as JSON")):
        with pytest.raises(InvalidInput, match=says):
            job.run(_opts(str(bad), dataset, tmp_path / "out"))
    with pytest.raises(InvalidInput, match=r"--out .* cannot be made: .* is a file"):
        job.run(_opts(model, dataset, os.path.join(dataset, "sub")))
    with pytest.raises(InvalidInput, match=r"--data .*: a directory; give the JSONL file"):
        job.run(_opts(model, str(tmp_path), tmp_path / "out"))
    with pytest.raises(InvalidInput, match=r"--layers ',': no layer id"):
        job_options.parse_layers(",")
    assert not (tmp_path / "out").exists()
    own = shutil.copytree(model, tmp_path / "model")  # (a copy: a regression must not write into the shared one)
    before = sorted(os.listdir(own))  # --out the model's own folder: its records would change its checksums
    with pytest.raises(InvalidInput, match=r"--out .* is the model's directory; give a directory of its own"):
        job.run(_opts(str(own), dataset, own))
    assert sorted(os.listdir(own)) == before


def test_conversations_without_a_tokenizer_say_why_it_did_not_load(model, tmp_path, no_engine):
    no_tokenizer = tmp_path / "model"
    shutil.copytree(model, no_tokenizer)
    for f in no_tokenizer.iterdir():
        if "token" in f.name:
            f.unlink()
    data = _write_lines(tmp_path / "c.jsonl", [{"conversations": [{"role": "user", "content": "hi"},
                                                                  {"role": "assistant", "content": "ho"}]}])
    with pytest.raises(InvalidInput, match=r"c.jsonl:1 is a conversation, which needs the model's tokenizer: the "
                                           r"tokenizer of --model .* did not load \(\w+(Error|Exception)?: "):
        job.run(_opts(str(no_tokenizer), data, tmp_path / "out"))


def test_validate_failures_name_the_input_line(tmp_path):
    """--validate ran its own check first: a NaN was a bare RuntimeError there (a traceback, no line), clearer
    without --validate. Both are now the writer's errors with the input line."""
    from eagle_compat.extract import formats
    placed = formats.Placed(index=7, row=7, line=8, input_ids=[1, 2, 3], loss_mask=[0, 1, 1])
    nan = {"input_ids": torch.tensor([1, 2, 3]), "hidden_states": [torch.tensor([[0.0], [float("nan")], [1.0]])]}
    with pytest.raises(writer.NonFiniteStates, match=r"d.jsonl:8: sample 7: layer id 5 has 1 NaN/Inf values"):
        formats.write_sample(formats.get("pt"), str(tmp_path), placed, nan, [5], data="d.jsonl", validate=True,
                             vocab_size=10, hidden_size=1)
    short = {"input_ids": torch.tensor([1, 2, 3]), "hidden_states": [torch.zeros(2, 1)]}
    with pytest.raises(writer.InvalidSample, match=r"d.jsonl:8: --validate: hidden_states\[0\] has shape \(2, 1\)"):
        formats.write_sample(formats.get("pt"), str(tmp_path), placed, short, [5], data="d.jsonl", validate=True,
                             vocab_size=10, hidden_size=1)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("fmt", ["pt", "arrow"])
def test_the_renames_are_synced_before_the_set_is_described_as_whole(model, dataset, tmp_path, fake_engine,
                                                                     monkeypatch, fmt):
    """After a machine crash no record may say complete while the last files' renames were lost (a trainer would
    take the set as whole): the directory is synced once, after the last file and before data_config.json, the
    Arrow dataset and status "complete"."""
    out = tmp_path / "out"
    seen = []
    real = atomic_io.fsync_renames

    def record(folder):
        present = len([f for f in writer.sample_files(folder) if f != "state.json"])  # the samples' own files
        described = [f for f in ("data_config.json", "state.json") if os.path.exists(os.path.join(folder, f))]
        seen.append((present, described, json.load(open(os.path.join(folder, "manifest.json")))["status"]))
        real(folder)

    monkeypatch.setattr(atomic_io, "fsync_renames", record)
    summary = job.run(_opts(model, dataset, out, layers=[0, 5], format=fmt))
    described = ["data_config.json"] if fmt == "pt" else ["state.json"]
    assert seen == [(summary["samples"], [], "running"), (summary["samples"], described, "running")]
    assert json.load(open(out / "manifest.json"))["status"] == "complete"


@pytest.mark.parametrize("fmt", ["pt", "arrow"])
def test_ctrl_c_while_the_whole_set_is_checked_leaves_it_incomplete_and_resume_finishes(model, dataset, tmp_path,
                                                                                        fake_engine, monkeypatch, fmt):
    """Checking a large set and writing its Arrow dataset take minutes, after the run restored Ctrl-C's handler: an
    interrupt there left the manifest "running" for ever. Now "incomplete", the run's entry says where it stopped, and
    --resume finishes the set."""
    from eagle_compat.extract import formats
    out = tmp_path / "out"
    real = formats.get(fmt).check_whole_set

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(type(formats.get(fmt)), "check_whole_set", interrupted)
    with pytest.raises(job.Interrupted, match="rerun the same command with --resume to finish it"):
        job.run(_opts(model, dataset, out, format=fmt))
    record = json.load(open(out / "manifest.json"))
    assert record["status"] == "incomplete" and record["runs"][-1]["status"].startswith("interrupted while the set")
    monkeypatch.setattr(type(formats.get(fmt)), "check_whole_set", real.__func__)
    summary = job.run(_opts(model, dataset, out, format=fmt, resume=True))
    assert summary["complete"] and summary["written_this_run"] == 0
    assert json.load(open(out / "manifest.json"))["status"] == "complete"


def test_a_resume_whose_engine_resolves_another_dtype_is_refused_before_it_writes(model, dataset, tmp_path,
                                                                                 fake_engine):
    """--dtype auto resolves per machine (bfloat16 on Ampere or newer and on CPU, float16 on V100/T4): a resume or a
    shard on another machine added files of another precision under a record naming one, and ended "complete"."""
    out = tmp_path / "out"
    job.run(_opts(model, dataset, out))
    os.unlink(writer.sample_path(str(out), 7, "pt"))
    before = {k: v for k, v in _snapshot(out).items() if k != ".eagle-compat.lock"}

    class OlderGpu(FakeEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.vllm_config.model_config.dtype = "torch.float16"

    fake_engine_cls = eagle_compat.generator.VllmHiddenStatesGenerator
    try:
        eagle_compat.generator.VllmHiddenStatesGenerator = OlderGpu
        with pytest.raises(writer.OutputDirectoryConflict, match=r"this machine's engine runs torch.float16 \(--dtype "
                                                                 r"'auto'\), and the files in .* were written by an "
                                                                 r"engine in torch.float32: .* Run with --dtype float32"):
            job.run(_opts(model, dataset, out, resume=True))
    finally:
        eagle_compat.generator.VllmHiddenStatesGenerator = fake_engine_cls
    after = {k: v for k, v in _snapshot(out).items() if k != ".eagle-compat.lock"}
    assert {k: v for k, v in after.items() if k != "manifest.json"} == {k: v for k, v in before.items()
                                                                         if k != "manifest.json"}
    record = json.load(open(out / "manifest.json"))
    assert record["engine_dtype"] == "torch.float32" and record["status"] == "incomplete"
    assert job.run(_opts(model, dataset, out, resume=True))["complete"]  # the same precision completes it


def test_an_unsharded_run_whose_files_are_not_all_there_fails(model, dataset, tmp_path, fake_engine, monkeypatch):
    """Every batch reported its files written, yet this machine does not see them all (`--ray` actors writing to a
    per-node folder at the same path): exit 0 with "shard 0/1 done ... run the other shards" before."""
    from eagle_compat.extract import local_runner
    monkeypatch.setattr(local_runner.formats, "write_sample", lambda fmt, out, s, *a, **k: fmt.path(out, s.index, s.row))
    with pytest.raises(atomic_io.OutputWriteError,
                       match=r"0 of 12 samples have their file in .* after a run that wrote every batch"):
        job.run(_opts(model, dataset, tmp_path / "out"))
    assert json.load(open(tmp_path / "out" / "manifest.json"))["status"] == "incomplete"


def test_a_ray_actor_that_does_not_see_the_drivers_out_refuses_to_start(tmp_path):
    from eagle_compat.extract import ray_runner
    from eagle_compat.extract.batch_job import EngineArgs, SampleWriting
    engine_args = EngineArgs(model="m", layer_ids=[0], max_len=8, gpu_memory_utilization=0.3, tensor_parallel_size=1,
                             dtype="auto", trust_remote_code=False, kv_cache_memory_bytes=None)
    writing = SampleWriting(out=str(tmp_path), format="pt", data="d", layer_ids=[0], validate=False, vocab_size=8,
                            hidden_size=8, stamp=None, skip_non_finite=False)
    spec = ray_runner.ActorSpec(engine=engine_args, writing=writing, cpus=1, on_gpu=False)
    with pytest.raises(InvalidInput, match=r"does not see .*manifest.json, which the driver wrote: --out must be a "
                                           r"folder every Ray node shares"):
        ray_runner.ExtractActor(spec, 0)
    assert not os.listdir(tmp_path)  # not even its writers lock


@pytest.mark.skipif(os.geteuid() != 0, reason="a file of another user needs root (chown)")
def test_a_ray_actor_of_another_user_than_the_driver_refuses_to_start(tmp_path):
    """A run trusts only its user's files: an actor running as another user would write files its driver's resume
    and completion refuse, so it refuses at its start, not after the work."""
    from eagle_compat.extract import ray_runner
    from eagle_compat.extract.batch_job import EngineArgs, SampleWriting
    engine_args = EngineArgs(model="m", layer_ids=[0], max_len=8, gpu_memory_utilization=0.3, tensor_parallel_size=1,
                             dtype="auto", trust_remote_code=False, kv_cache_memory_bytes=None)
    writing = SampleWriting(out=str(tmp_path), format="pt", data="d", layer_ids=[0], validate=False, vocab_size=8,
                            hidden_size=8, stamp=None, skip_non_finite=False)
    spec = ray_runner.ActorSpec(engine=engine_args, writing=writing, cpus=1, on_gpu=False)
    (tmp_path / writer.MANIFEST).write_text("{}")
    os.chown(tmp_path / writer.MANIFEST, 4242, -1)  # the driver's user
    with pytest.raises(InvalidInput, match=r"runs as uid 0, and the driver that wrote .*manifest.json as uid 4242: a "
                                           r"run trusts only its own user's files"):
        ray_runner.ExtractActor(spec, 0)
    assert os.listdir(tmp_path) == [writer.MANIFEST]  # not even its writers lock


# ---- large weight files: what their checksums see ---------------------------------------------------------------

def _train_one_middle_tensor(model_dir) -> str:
    """What a fine-tune that trained one middle layer does to the weight file: every value of that tensor changes;
    the file's size, its header and both of its ends (embeddings, final norm, head) stay as they were."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = os.path.join(model_dir, "model.safetensors")
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    name = next(k for k in sorted(tensors) if "layers.3." in k and "down_proj" in k)
    tensors[name] = tensors[name] + 1e-3 * torch.randn(tensors[name].shape, generator=torch.Generator().manual_seed(1))
    save_file(tensors, path, metadata=metadata)
    return name


def _as_earlier_releases(current):
    """model_checksums as earlier releases made them: large files by size and first and last MiB."""
    def hashed(model_path, recorded=None):
        return {name: {**entry, "sha256": file_hashes.file_sha256(os.path.join(model_path, name), 1 << 20),
                       "hashed": file_hashes.HASHED_ENDS} if entry["hashed"] == file_hashes.HASHED_TENSORS else entry
                for name, entry in current(model_path).items()}
    return hashed


def test_a_fine_tune_of_a_large_weight_file_is_not_taken_for_its_base(model, dataset, tmp_path, fake_engine,
                                                                      monkeypatch):
    """Weights over the full-hash limit (1 GiB; 1 KiB here) are hashed by their header and each tensor's ends. The
    hash of earlier releases (size, first and last MiB) took a fine-tune of one middle layer for its base, and
    `--resume` would have added its states to the base's."""
    monkeypatch.setattr(file_hashes, "FULL_HASH_LIMIT", 1024)
    weights = str(tmp_path / "model")
    shutil.copytree(model, weights)
    out = tmp_path / "out"
    job.run(_opts(weights, dataset, out, shard=(0, 2)))
    recorded = json.load(open(out / "manifest.json"))["settings"]["model_checksums"]["model.safetensors"]
    assert recorded["hashed"] == file_hashes.HASHED_TENSORS
    base_ends = file_hashes.file_sha256(os.path.join(weights, "model.safetensors"), 1 << 20)
    _train_one_middle_tensor(weights)
    assert file_hashes.file_sha256(os.path.join(weights, "model.safetensors"), 1 << 20) == base_ends  # the old gap
    before = _snapshot(out)
    with pytest.raises(InvalidInput, match=r"(?s)other settings.*model_checksums"):
        job.run(_opts(weights, dataset, out, shard=(1, 2)))
    assert _snapshot(out) == before


def test_a_record_made_with_the_earlier_hash_is_continued_with_it(model, dataset, tmp_path, fake_engine,
                                                                  monkeypatch, capsys):
    """A directory whose record hashed the weights by size and first and last MiB (earlier releases) is continued:
    its files' stamps depend on those checksums, so the run hashes the files the way the record says."""
    monkeypatch.setattr(file_hashes, "FULL_HASH_LIMIT", 1024)
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(file_hashes, "model_checksums", _as_earlier_releases(file_hashes.model_checksums))
        job.run(_opts(model, dataset, out, shard=(0, 2)))
    capsys.readouterr()
    job.run(_opts(model, dataset, out, shard=(1, 2)))
    assert ("made by an earlier release, which hashed large weight files by size and first and last MiB "
            "(model.safetensors); it is continued that way") in capsys.readouterr().err
    record = json.load(open(out / "manifest.json"))
    assert record["status"] == "complete"
    assert record["settings"]["model_checksums"]["model.safetensors"]["hashed"] == file_hashes.HASHED_ENDS
    clean = tmp_path / "clean"
    job.run(_opts(model, dataset, clean))
    _equal_dirs(out, clean)


def test_a_large_weight_file_that_is_not_safetensors_is_hashed_across_its_length(tmp_path, monkeypatch):
    monkeypatch.setattr(file_hashes, "FULL_HASH_LIMIT", 1024)
    path = tmp_path / "pytorch_model.bin"
    content = bytearray(os.urandom(5 << 20))
    path.write_bytes(content)
    first = file_hashes.model_checksums(str(tmp_path))["pytorch_model.bin"]
    content[(5 << 20) // 2] ^= 0xFF  # one byte in the middle: inside one of the 64 spread MiB
    path.write_bytes(content)
    second = file_hashes.model_checksums(str(tmp_path))["pytorch_model.bin"]
    assert first["hashed"] == file_hashes.HASHED_SPREAD and first["sha256"] != second["sha256"]


@pytest.mark.parametrize("header, why", [
    (b"[]", "its header is not a JSON object"),
    (b"{not json", "its header is not JSON"),
    (json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 40]}}).encode(),
     "data_offsets [0, 1099511627776] are not within"),
    (json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [16, 15]}}).encode(), "are not within"),
    (None, "its header length 18446744073709551615 exceeds the file or 100 MB"),
])
def test_a_large_weight_file_whose_header_does_not_describe_it_is_named(tmp_path, monkeypatch, header, why):
    monkeypatch.setattr(file_hashes, "FULL_HASH_LIMIT", 1024)
    path = tmp_path / "model.safetensors"
    length = (1 << 64) - 1 if header is None else len(header)
    path.write_bytes(length.to_bytes(8, "little") + (header or b"") + bytes(4096))
    with pytest.raises(InvalidInput, match=re.escape(f"--model file {path}: not a readable safetensors file (") + ".*"
                       + re.escape(why)):
        file_hashes.model_checksums(str(tmp_path))


def test_only_a_directory_holding_files_of_the_earlier_hash_keeps_it(model, dataset, tmp_path, fake_engine,
                                                                     monkeypatch):
    """A record naming the earlier hash counts only for a large file of the recorded size, and only while the
    directory holds files stamped with it: a record without files gives way, and the new run hashes each tensor."""
    monkeypatch.setattr(file_hashes, "FULL_HASH_LIMIT", 1024)
    small = {"config.json": {"size": os.path.getsize(os.path.join(model, "config.json")), "sha256": "x",
                             "hashed": file_hashes.HASHED_ENDS}}
    assert file_hashes.model_checksums(model, small)["config.json"]["hashed"] == file_hashes.HASHED_FULL

    out = tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(file_hashes, "model_checksums", _as_earlier_releases(file_hashes.model_checksums))
        job.run(_opts(model, dataset, out, shard=(0, 2)))
    for name in writer.sample_files(str(out)):
        os.unlink(out / name)
    job.run(_opts(model, dataset, out))
    record = json.load(open(out / "manifest.json"))
    assert record["status"] == "complete"
    assert record["settings"]["model_checksums"]["model.safetensors"]["hashed"] == file_hashes.HASHED_TENSORS


def test_what_the_input_gives_but_the_samples_do_not_use_is_said(model, tmp_path, fake_engine, capsys):
    """Message keys that vLLM's chat endpoint does not pass to the chat template never reach it (a source tag, a
    per-turn weight), and input_ids without loss_mask train on every token: both were silent."""
    data = _write_lines(tmp_path / "d.jsonl", [
        {"conversations": [{"role": "user", "content": "w1 w2", "weight": None},
                           {"role": "assistant", "content": "w3", "source": "w9 w9", "weight": 0}]},
        {"input_ids": [5, 6, 7]},
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}])
    job.run(_opts(model, data, tmp_path / "out"))
    err = capsys.readouterr().err
    assert "conversations carry keys the chat template is not given ('source' in 1)" in err
    assert "1 messages carry a 'weight', which is not applied" in err  # the null one says nothing
    assert "1 lines give input_ids without loss_mask: every token of them is in the loss mask" in err
    notes = json.load(open(tmp_path / "out" / "manifest.json"))["input_notes"]
    assert notes == {"message_keys_not_passed_to_the_template": {"source": 1, "weight": 1},
                     "token_lines_without_loss_mask": 1}


def test_the_record_describes_the_set_the_completing_run_read(model, tmp_path, fake_engine, monkeypatch):
    """A conversation an earlier run left out (--skip-uncovered; an older transformers rendered it otherwise) is
    covered now: the set completes with it, and the record's counts say so (they stayed the first run's, and
    `convert` then refused the complete set as incomplete)."""
    data = _write_lines(tmp_path / "d.jsonl", [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]},
                                               {"conversations": [{"role": "user", "content": "w1"},
                                                                  {"role": "assistant", "content": "w2"}]}])
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        def uncovered(*args, **kwargs):
            raise inputs.UncoveredConversation("assistant message 1 is not in the chat-templated text")
        m.setattr(inputs, "tokenize_conversation", uncovered)
        import transformers  # that older release: its tokenized input kept in --out is not this one's
        m.setattr(transformers, "__version__", "4.0.0")
        job.run(_opts(model, data, out, skip_uncovered=True, batch_size=1, shard=(0, 3)))
    first = json.load(open(out / "manifest.json"))
    assert first["num_samples"] == 2 and len(first["skipped_uncovered"]) == 1
    for k in (1, 2):
        job.run(_opts(model, data, out, skip_uncovered=True, batch_size=1, shard=(k, 3)))
    record = json.load(open(out / "manifest.json"))
    assert record["status"] == "complete" and record["num_samples"] == 3 and record["skipped_uncovered"] == []
    from eagle_compat.extract import convert
    convert.convert(str(out), str(tmp_path / "arrow"), "arrow")
