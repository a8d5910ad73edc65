"""--format arrow and `eagle-compat convert` on real CPU vLLM 0.32.0, read back by speculators 0.9.0's own
`ArrowDataset(..., on_missing="raise")` and `check_hidden_states`, in its own environment (no vLLM; built by
scripts/test.sh through scripts/_env.sh `ensure_reader_env`), run as a subprocess: tests/data/read_with_speculators_arrow.py.

Two extract runs of 12 short samples (the 0.3.0 files and the Arrow layout) feed every test; the conversions are
made from them. Values are compared with HF transformers in the convention the manifest records: the
`entering_vllm_native` ids (HF `output_hidden_states[k]` for k < N, the final norm's input for N), not through
the leaving ids the run was given."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from eagle_compat.extract import arrow, writer

from helpers import assert_matches_hf, in_newest_pass_only, write_dataset

pytestmark = [pytest.mark.engine, in_newest_pass_only(
    "the formats do not depend on the vLLM release (the generator is tested on every release)")]

LAYERS = [0, 2, 4, 5]  # leaving (speculators 0.3.0); 5 = N-1, the final pre-norm state
SAMPLES = 12


def reader_python() -> str | None:
    path = os.environ.get("EAGLE_COMPAT_READER_PY") or os.path.join(
        os.environ.get("EAGLE_COMPAT_VENVS", os.path.expanduser("~/.cache/eagle-compat/venvs")),
        "speculators-0.9.0", "bin", "python")
    return path if os.path.exists(path) else None


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("data") / "data.jsonl", SAMPLES, 20, 120, seed=14)


def _extract(model, data, out, fmt):
    proc = subprocess.run([sys.executable, "-m", "eagle_compat.cli", "extract", "--model", model, "--data", data,
                           "--out", str(out), "--layers", ",".join(map(str, LAYERS)), "--batch-size", "4",
                           "--max-len", "256", "--format", fmt, "--validate", "--gpu-memory-utilization", "0.3",
                           "--no-progress"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _convert(src, dst, *extra):
    proc = subprocess.run([sys.executable, "-m", "eagle_compat.cli", "convert", str(src), str(dst), *extra],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def runs(model, dataset, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    d = {"pt": _extract(model, dataset, root / "pt", "pt"), "arrow": _extract(model, dataset, root / "arrow", "arrow")}
    d["stdout_pt2arrow"] = _convert(d["pt"], root / "pt2arrow")
    d["pt2arrow"] = root / "pt2arrow"
    _convert(d["pt"], root / "pt2fp8", "--to", "arrow-fp8")
    d["pt2fp8"] = root / "pt2fp8"
    _convert(d["arrow"], root / "arrow2pt")
    d["arrow2pt"] = root / "arrow2pt"
    return d


@pytest.fixture(scope="module")
def reader_py():
    py = reader_python()
    if py is None:  # checked before the extract runs: a missing environment costs no engine start
        pytest.skip("the reader environment (speculators 0.9.0) is missing: scripts/test.sh builds it "
                    "(scripts/_env.sh ensure_reader_env), or set EAGLE_COMPAT_READER_PY")
    return py


@pytest.fixture(scope="module")
def read_back(reader_py, runs, tmp_path_factory):
    """What speculators 0.9.0's ArrowDataset gives the trainer, for the direct, the converted and the fp8 run."""
    py = reader_py
    out = tmp_path_factory.mktemp("read") / "read.pt"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "EAGLE_COMPAT_INSTALLED")}
    proc = subprocess.run([py, os.path.join(os.path.dirname(__file__), "data", "read_with_speculators_arrow.py"),
                           str(out), str(runs["arrow"]), str(runs["pt2arrow"]), f"{runs['pt2fp8']}:fp8"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = torch.load(out, weights_only=False)
    return {"arrow": result["dirs"][str(runs["arrow"])], "pt2arrow": result["dirs"][str(runs["pt2arrow"])],
            "fp8": result["dirs"][f"{runs['pt2fp8']}:fp8"], "version": result["speculators"]}


def test_speculators_0_9_reads_every_sample_of_an_arrow_run_equal_to_hf_in_the_recorded_convention(
        read_back, runs, model, dataset):
    got = read_back["arrow"]
    assert read_back["version"] == "0.9.0"
    assert got["count"] == got["hs_files"] == SAMPLES
    manifest = json.load(open(runs["arrow"] / "manifest.json"))
    entering = manifest["layers"]["entering_vllm_native"]
    assert manifest["layers"]["eagle_aux_hidden_state_layer_ids"] == entering[:-1] == [1, 3, 5]
    assert entering[-1] == manifest["num_layers"] == 6  # the verifier's last hidden state: final pre-norm
    lines = [json.loads(x) for x in open(dataset)]
    results, batch = [], []
    for r, item in enumerate(got["items"]):
        ids = item["input_ids"].tolist()
        if "input_ids" in lines[r]:
            assert ids == lines[r]["input_ids"] and item["loss_mask"].tolist() == lines[r]["loss_mask"]
        else:  # a conversation: the mask covers the reply, not the prompt
            assert 0 < int(item["loss_mask"].sum()) < len(ids)
        t, h = len(ids), item["verifier_last_hidden_states"].shape[-1]
        states = torch.cat([item["hidden_states"].view(t, -1, h), item["verifier_last_hidden_states"][:, None]], 1)
        assert states.shape == (t, len(entering), h)
        results.append({"hidden_states": [states[:, j] for j in range(len(entering))]})
        batch.append(ids)
    # entering id k is the residual stream leaving layer k-1: HF's reference in that (speculators 0.3.0) convention
    worst = max(assert_matches_hf(results, model, batch, [k - 1 for k in entering], precision="bf16").values())
    print(f"arrow run vs HF (entering ids {entering}): worst relative error {worst:.2e}")


def test_a_converted_0_3_0_run_equals_the_direct_arrow_run_and_speculators_reads_it(read_back, runs):
    assert "eagle_aux_hidden_state_layer_ids [1, 3, 5]" in runs["stdout_pt2arrow"]
    a, b = runs["arrow"], runs["pt2arrow"]
    assert arrow.read_rows(str(a)).to_dict() == arrow.read_rows(str(b)).to_dict()
    assert arrow.hs_files(str(a)) == arrow.hs_files(str(b)) and len(arrow.hs_files(str(a))) == SAMPLES
    for name in arrow.hs_files(str(a)):
        x, y = (arrow.load_hs(os.path.join(d, "hidden_states", name)) for d in (a, b))
        assert torch.equal(x["token_ids"], y["token_ids"]) and torch.equal(x["hidden_states"], y["hidden_states"])
    direct, converted = read_back["arrow"], read_back["pt2arrow"]
    assert converted["count"] == converted["hs_files"] == SAMPLES
    for x, y in zip(direct["items"], converted["items"], strict=True):
        assert all(torch.equal(x[k], y[k]) for k in x)


def test_the_arrow_run_converted_to_0_3_0_files_equals_the_direct_pt_run(runs):
    a, b = runs["pt"], runs["arrow2pt"]
    assert writer.sample_files(str(a)) == writer.sample_files(str(b)) and len(writer.sample_files(str(a))) == SAMPLES
    for name in writer.sample_files(str(a)):
        x, y = writer.load_sample(os.path.join(a, name)), writer.load_sample(os.path.join(b, name))
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        assert len(x["hidden_states"]) == len(y["hidden_states"]) == len(LAYERS)
        assert all(torch.equal(h, g) for h, g in zip(x["hidden_states"], y["hidden_states"])), name
    cfg = json.load(open(b / "data_config.json"))
    assert cfg["hidden_states"]["layer_ids"] == LAYERS and cfg["data"]["num_samples"] == SAMPLES


def test_fp8_files_are_read_back_by_speculators_with_e4m3_error(read_back, runs):
    """hs-connectors' FP8 format through its FP8Transfer: the error against the bf16 states is that of e4m3 rounding
    (3 mantissa bits: at most 2^-4 of each value, plus bf16's 2^-8 when dequantized to bf16) with one scale per
    token over all layers, so small values of a token whose other layers are large lose most (subnormals)."""
    bf16, fp8 = read_back["arrow"], read_back["fp8"]
    assert fp8["count"] == fp8["hs_files"] == SAMPLES
    sizes = {k: sum(os.path.getsize(os.path.join(runs[k], "hidden_states", f)) for f in arrow.hs_files(str(runs[k])))
             for k in ("arrow", "pt2fp8")}
    assert sizes["pt2fp8"] < 0.6 * sizes["arrow"], sizes  # e4m3: one byte per value, bf16 two (+ scales, ids)
    rel, per_layer = [], {}
    for x, y in zip(bf16["items"], fp8["items"], strict=True):
        assert torch.equal(x["input_ids"], y["input_ids"])
        t, h = x["input_ids"].numel(), x["verifier_last_hidden_states"].shape[-1]
        a = torch.cat([x["hidden_states"].view(t, -1, h), x["verifier_last_hidden_states"][:, None]], 1).float()
        b = torch.cat([y["hidden_states"].view(t, -1, h), y["verifier_last_hidden_states"][:, None]], 1).float()
        token_amax = a.abs().amax(dim=(1, 2), keepdim=True)
        err = (a - b).abs()
        # e4m3: half an ulp is 2^-4 of the value for normals; below the smallest normal (2^-6 * scale) the step is
        # 2^-9 * scale (scale = token amax / 448); the bf16 dequantization adds 2^-8 of the value
        bound = (2 ** -4 + 2 ** -8) * a.abs() + 2 ** -9 * token_amax / 448 * 1.01
        assert bool((err <= bound).all()), float((err - bound).max())
        rel.append((err.amax(dim=(0, 2)) / a.abs().amax(dim=(0, 2))))
    worst = torch.stack(rel).amax(0)
    print("fp8 vs bf16, worst error relative to the layer's max |value|, per slot:",
          [f"{v:.2e}" for v in worst.tolist()])
    assert float(worst.max()) < 0.07
