"""A layer whose states are one vector at every token (all zeros, say) while the tokens differ is refused, never
written: what a broken capture of a hybrid verifier gave peers (vllm#46301, Qwen3.5-35B-A3B: all-zero states,
validation looked fine, the drafter accepted ~0% of its tokens). In every format, through `extract`, with the sample's
input line named; a sample of one token repeated (whose states are equal by right) is written.
"""
from __future__ import annotations

import json
import re
import os

import pytest

import eagle_compat.generator
from eagle_compat import tiny_models
from eagle_compat.extract import job, writer

from helpers import FakeEngine, prompts


class ZeroLayerEngine(FakeEngine):
    """The stand-in engine, with its second layer all zeros in every sample (what vllm#46301's capture returned)."""

    def generate(self, token_ids):
        out = super().generate(token_ids)
        for r in out:
            r["hidden_states"][1] = r["hidden_states"][1] * 0
        return out


@pytest.fixture(scope="module")
def model():
    return tiny_models.build_tiny_model("llama")


def _opts(model, data, out, **kw):
    return job.ExtractOptions(model=model, data=data, out=str(out), progress=False, layers=[0, 5], batch_size=4, **kw)


def _data(tmp_path, rows):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("fmt", ["pt", "safetensors", "arrow"])
def test_an_all_zero_layer_stops_the_run_naming_the_layer_and_line(tmp_path, model, monkeypatch, fmt):
    FakeEngine.started, FakeEngine.block = 0, None
    monkeypatch.setattr(eagle_compat.generator, "VllmHiddenStatesGenerator", ZeroLayerEngine)
    data, out = _data(tmp_path, prompts(6, 10, 30, seed=2)), tmp_path / "out"
    # the first sample a writer thread checks is named (threads write a batch's samples side by side)
    with pytest.raises(writer.DegenerateStates,
                       match=r"data.jsonl:(\d+): sample (\d+): layer id 5 is all zeros at all \d+ tokens.*vllm#46301"
                       ) as raised:
        job.run(_opts(model, data, out, format=fmt))
    line, sample = (int(x) for x in re.search(r"data.jsonl:(\d+): sample (\d+)", str(raised.value)).groups())
    assert line == sample + 1
    assert not [f for f in os.listdir(out) if f.startswith(("data_", "hs_"))]


def test_one_token_repeated_has_equal_states_by_right_and_is_written(tmp_path, model, monkeypatch):
    """Equal rows are refused only where the tokens differ: one token repeated attends to equal values."""
    class Constant(FakeEngine):
        def generate(self, token_ids):
            out = super().generate(token_ids)
            for ids, r in zip(token_ids, out):
                if len(set(ids)) == 1:
                    r["hidden_states"] = [h * 0 + h[0] for h in r["hidden_states"]]
            return out

    FakeEngine.started, FakeEngine.block = 0, None
    monkeypatch.setattr(eagle_compat.generator, "VllmHiddenStatesGenerator", Constant)
    data, out = _data(tmp_path, [[7] * 12, *prompts(3, 10, 30, seed=2)]), tmp_path / "out"
    job.run(_opts(model, data, out))
    written = sorted(f for f in os.listdir(out) if f.startswith("data_") and f.endswith(".pt"))
    assert written == [f"data_{i}.pt" for i in range(4)]


def test_require_varying_tells_a_repeated_vector_from_varying_rows():
    import torch

    h = torch.arange(12.0).reshape(4, 3)
    writer.require_varying(0, [1, 2, 3, 4], [h])  # rows differ: nothing raised
    with pytest.raises(writer.DegenerateStates, match="one vector repeated"):
        writer.require_varying(0, [1, 2, 3, 4], [h[:1].expand(4, 3) + 1])
