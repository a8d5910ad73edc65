"""The input's values are taken as the JSON types they must be: token ids and loss-mask values exactly JSON integers,
roles and contents exactly strings, each key given once. Anything else is an `InvalidInput` naming the file, the
line and what is allowed, raised while the input is read, before any engine starts."""
from __future__ import annotations

import json
import re

import pytest

from eagle_compat import InvalidInput, tiny_models
from eagle_compat.extract import inputs, job

GOOD = {"input_ids": [5, 6, 7]}
CHAT = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4"}]


@pytest.fixture(scope="module")
def model():
    return tiny_models.build_tiny_model("llama")


def _write(path, bad) -> str:
    """Three good lines around `bad` (the third line), written as given where it is a string."""
    with open(path, "w") as f:
        for record in (GOOD, GOOD, bad, GOOD):
            f.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return str(path)


BAD_LINES = [
    # what pandas or numpy exports write for a 0/1 column: a TypeError (exit 1, no line) after the check took them
    ({"input_ids": [5, 6, 7], "loss_mask": [1.0, 0.0, 1.0]}, "got loss_mask[0] = 1.0: write the JSON integers 0 and 1"),
    ({"input_ids": [5, 6, 7], "loss_mask": [1, 0, 0.0]}, "got loss_mask[2] = 0.0"),
    ({"input_ids": [5, 6, 7], "loss_mask": [True, False, True]}, "got loss_mask[0] = true"),
    ({"input_ids": [5, 6, 7], "loss_mask": [1, 2, 0]}, "got loss_mask[1] = 2"),
    ({"input_ids": [5, 6.0, 7]}, "input_ids must be a list of ints, got input_ids[1] = 6.0"),
    ({"input_ids": [True, 6, 7]}, "input_ids must be a list of ints, got input_ids[0] = true"),
    # a key given twice: json.loads kept the last value without a word
    ('{"input_ids": [5, 6, 7], "input_ids": [8, 9]}', "the key 'input_ids' appears twice in one object"),
    ('{"input_ids": [5, 6], "loss_mask": [1, 1], "loss_mask": [0, 1]}', "the key 'loss_mask' appears twice"),
    ('{"conversations": [{"role": "user", "content": "w1", "content": "w2"}, '
     '{"role": "assistant", "content": "w3"}]}', "the key 'content' appears twice in one object"),
    # both spellings of one field, meaning different things: one of them was taken silently
    ({"conversations": [{"role": "user", "from": "gpt", "content": "w1"}, CHAT[1]]},
     "a message gives both 'role' (\"user\") and 'from' (\"gpt\"), which differ"),
    ({"conversations": [{"role": "user", "content": "w1", "value": "w9"}, CHAT[1]]},
     "a message gives both 'content' (\"w1\") and 'value' (\"w9\"), which differ"),
    ({"conversations": CHAT, "messages": CHAT[:1]}, "the line gives both 'conversations' ("),
]


@pytest.mark.parametrize("bad, message", BAD_LINES)
def test_a_value_of_another_json_type_is_named_before_any_engine(model, tmp_path, no_engine, bad, message):
    data = _write(tmp_path / "data.jsonl", bad)
    out = tmp_path / "out"
    with pytest.raises(InvalidInput, match=r"data\.jsonl:3: .*" + re.escape(message)):
        job.run(job.ExtractOptions(model=model, data=data, out=str(out), progress=False, layers=[0, 5]))
    assert not out.exists()  # refused while the input is read: nothing written, not even the directory


@pytest.mark.parametrize("bad", [case[0] for case in BAD_LINES] + [
    '{"input_ids": [5, 6, 7', b'{"input_ids": [5], "x": "\xff"}', "[5, 6]", '{"text": "w1"}', '{"input_ids": []}',
    {"input_ids": [5, 6000]}, {"conversations": []}, {"conversations": [{"role": "user"}]},
    {"conversations": [{"role": "moderator", "content": "w1"}]}, {"input_ids": [5, 6], "loss_mask": [1]},
])
def test_the_check_before_the_engine_refuses_a_line_as_the_reading_does(model, tmp_path, bad):
    """inputs.check_lines (every line, before the engine starts) and read_dataset refuse a line the same way: the
    same message, naming the same file and line."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    path = tmp_path / "data.jsonl"
    with open(path, "wb") as f:
        for record in (GOOD, GOOD, bad, GOOD):
            line = record if isinstance(record, bytes) else (
                record if isinstance(record, str) else json.dumps(record)).encode()
            f.write(line + b"\n")
    with pytest.raises(InvalidInput) as read:
        inputs.read_dataset(str(path), tok, 256, vocab_size=512)
    with pytest.raises(InvalidInput) as checked:
        inputs.check_lines(str(path), 256, vocab_size=512)
    assert str(checked.value) == str(read.value) and ":3: " in str(read.value)


def test_the_check_before_the_engine_takes_what_the_reading_takes(tmp_path):
    """Lines only a tokenizer can judge (a conversation beside its own input_ids) pass the check, and ids past
    --max-len are cut away before the vocabulary is asked, as when the input is read."""
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (
        GOOD, {"conversations": CHAT, "input_ids": [1.5]}, {"input_ids": [5, 6, 9999]}, {"messages": CHAT})) + "\n\n")
    assert inputs.check_lines(str(path), 2, vocab_size=512) == 5


def test_a_float_loss_mask_exits_2_naming_the_line(model, tmp_path, capsys):
    """The command line: exit 2 and one line naming the file and line (was exit 1 and a TypeError traceback)."""
    from eagle_compat import cli
    data = _write(tmp_path / "data.jsonl", {"input_ids": [5, 6, 7], "loss_mask": [1.0, 0.0, 1.0]})
    code = cli.main(["extract", "--model", model, "--data", data, "--out", str(tmp_path / "out"), "--layers", "0,5"])
    err = capsys.readouterr().err
    assert code == 2 and "data.jsonl:3: loss_mask must be a list of 0/1 values" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("line", [
    {"conversations": [{"role": "user", "from": "human", "content": "w1 w2"}, CHAT[1]]},  # the same role twice
    {"conversations": [{"role": "user", "content": "w1 w2", "value": None}, CHAT[1]]},  # a null says nothing
    {"conversations": [{"from": "human", "value": "w1 w2"}, {"from": "gpt", "value": "w3 w4"}]},
    {"messages": CHAT, "conversations": CHAT},
])
def test_both_spellings_that_agree_are_taken(model, tmp_path, line):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(line) + "\n")
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"conversations": CHAT}) + "\n")
    got, want = (inputs.read_dataset(str(p), tok, 256, vocab_size=512).samples[0] for p in (path, plain))
    assert (list(got.input_ids), list(got.loss_mask)) == (list(want.input_ids), list(want.loss_mask))


def test_integer_masks_and_ids_are_read_as_before(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}) + "\n"
                    + json.dumps({"input_ids": [8, 9]}) + "\n")
    samples = inputs.read_dataset(str(path), None, 256, vocab_size=512).samples
    assert [(list(s.input_ids), list(s.loss_mask)) for s in samples] == [([5, 6, 7], [0, 1, 1]), ([8, 9], [1, 1])]
