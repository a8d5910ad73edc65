"""One sample whose states hold NaN must not end a job for good.

Before: the message said to try `--dtype float32`, `--resume` refused other settings, and every resume redid the
failing batch first and stopped on it again, so the set was never finished. Now `--skip-non-finite` (which changes no
state written, so a `--resume` may add it) leaves such samples out, lists them in manifest.json and the summary, and
completes the set; `convert` and speculators' readers see a set without them.
"""
from __future__ import annotations

import json
import os

import pytest

import eagle_compat.generator
from eagle_compat import tiny_models
from eagle_compat.extract import convert, job, writer

from helpers import FakeEngine, prompts

POISON = 11  # a token whose sequences come back with NaN states (an overflow in the engine's dtype)


class NanEngine(FakeEngine):
    def generate(self, token_ids):
        out = super().generate(token_ids)
        for ids, r in zip(token_ids, out):
            if POISON in ids:
                r["hidden_states"][0][ids.index(POISON)] = float("nan")
        return out


@pytest.fixture
def nan_engine(monkeypatch):
    FakeEngine.started, FakeEngine.block = 0, None
    monkeypatch.setattr(eagle_compat.generator, "VllmHiddenStatesGenerator", NanEngine)


@pytest.fixture(scope="module")
def model():
    return tiny_models.build_tiny_model("llama")


def _data(tmp_path, poisoned=(3, 9)):
    rows = [[t for t in ids if t != POISON] for ids in prompts(12, 10, 30, seed=3)]
    for i in poisoned:
        rows[i] = rows[i][:4] + [POISON] + rows[i][4:]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    return str(path)


def _opts(model, data, out, **kw):
    kw.setdefault("layers", [0, 5])
    kw.setdefault("batch_size", 4)
    return job.ExtractOptions(model=model, data=data, out=str(out), progress=False, **kw)


def test_a_stopped_set_is_finished_by_a_resume_that_adds_skip_non_finite(tmp_path, model, nan_engine):
    data, out = _data(tmp_path), tmp_path / "out"
    with pytest.raises(writer.NonFiniteStates, match=r"data.jsonl:4: sample 3: .* --skip-non-finite"):
        job.run(_opts(model, data, out))
    with pytest.raises(writer.NonFiniteStates):  # the same command stops on it again: the dead end it was
        job.run(_opts(model, data, out, resume=True))
    summary = job.run(_opts(model, data, out, resume=True, skip_non_finite=True))
    assert summary["complete"] and summary["samples"] == 10
    assert [(e["index"], e["line"]) for e in summary["left_out_non_finite"]] == [(3, 4), (9, 10)]
    assert "NaN/Inf" in summary["left_out_non_finite"][0]["why"]
    record = writer.read_manifest(str(out))
    assert record["status"] == "complete" and record["num_samples"] == 10
    assert [e["index"] for e in record["left_out_non_finite"]] == [3, 9]
    assert not os.path.exists(out / "data_3.pt") and not os.path.exists(out / "data_9.pt")
    with open(out / "data_config.json") as f:
        assert json.load(f)["data"]["num_samples"] == 10
    # a later resume keeps them out without the flag (the record says so) and finds nothing to do
    again = job.run(_opts(model, data, out, resume=True))
    assert again["complete"] and again["written_this_run"] == 0
    # and the set converts as a whole, without them
    convert.convert(str(out), str(tmp_path / "arrow"), to="arrow")
    assert writer.read_manifest(str(tmp_path / "arrow"))["status"] == "complete"


def test_arrow_refuses_the_option_naming_the_way_that_works(tmp_path, model, no_engine):
    with pytest.raises(job.InvalidInput, match=r"--skip-non-finite with --format arrow: .* --format pt .* convert"):
        job.run(_opts(model, _data(tmp_path), tmp_path / "out", format="arrow", skip_non_finite=True))
    assert not os.path.exists(tmp_path / "out")


def test_a_corrected_line_of_a_sample_left_out_for_non_finite_states_is_redone(tmp_path, model, nan_engine, capsys):
    """A --resume with a corrected input keeps a sample out for non-finite states only where the input still gives
    it the tokens it had then: line 4 without its poisoned token is another sample, whose states were never judged,
    and is extracted; line 10, unchanged, stays out."""
    data, out = _data(tmp_path), tmp_path / "out"
    job.run(_opts(model, data, out, skip_non_finite=True))
    with open(data) as f:
        lines = f.readlines()
    lines[3] = json.dumps({"input_ids": [t for t in json.loads(lines[3])["input_ids"] if t != POISON]}) + "\n"
    with open(data, "w") as f:
        f.write("".join(lines))
    summary = job.run(_opts(model, data, out, resume=True, skip_non_finite=True))
    assert summary["complete"] and [e["index"] for e in summary["left_out_non_finite"]] == [9]
    assert os.path.exists(out / "data_3.pt") and not os.path.exists(out / "data_9.pt")
    record = writer.read_manifest(str(out))
    assert [e["index"] for e in record["left_out_non_finite"]] == [9] and record["num_samples"] == 11
    assert record["input_corrections"][0]["non_finite_redone"] == 1
    assert "1 sample left out for non-finite states is redone" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_require_finite_finds_any_nan_or_inf_and_passes_huge_finite_values(dtype):
    """The check reads a float32 sum first (one pass): each kind of non-finite value must still be found, wherever
    it is, and finite values whose sum overflows float32 must still pass (the element-wise check decides)."""
    import torch

    from eagle_compat.extract import writer
    dt = getattr(torch, dtype)
    base = torch.randn(64, 32).to(dt)
    for bad in ([float("nan")], [float("inf")], [float("-inf")], [float("inf"), float("-inf")]):
        h = base.clone()
        for k, value in enumerate(bad):
            h[40 + k, 7] = value
        with pytest.raises(writer.NonFiniteStates, match=r"sample 3: layer id 9 has .* at tokens \[40"):
            writer.require_finite(3, [base, h], [2, 9])
    huge = torch.full((64, 32), torch.finfo(dt).max, dtype=dt)  # its float32 sum is inf for every dtype here
    writer.require_finite(3, [huge, -huge], [2, 9])
    writer.require_finite(3, torch.stack([base, base], dim=1), [2, 9])  # one [T, L, H] tensor too
