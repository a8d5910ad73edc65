"""eagle-compat extract on real CPU vLLM: files load in speculators' own dataset class with tensors equal to HF
(bf16 tolerance: the engine runs dtype auto), a killed-and-resumed run equals an uninterrupted one tensor for
tensor, so does a run stopped with Ctrl-C, a resume with other settings is refused, shards 0/2 + 1/2 equal the
unsharded run."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from eagle_compat import InvalidInput, tiny_models
from eagle_compat.extract import job, job_options, writer

from helpers import assert_matches_hf, in_newest_pass_only, write_dataset

pytestmark = [pytest.mark.engine, in_newest_pass_only(
    "extract drives the generator, which the other suites test on every release (8 engine starts: CI time)")]

LAYERS = [0, 2, 4, 5]


@pytest.fixture(scope="module")
def model():
    return tiny_models.build_tiny_model("llama")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Pre-tokenized samples (with loss masks) and conversations mixed, as a JSONL file."""
    return write_dataset(tmp_path_factory.mktemp("data") / "data.jsonl", 60, 20, 200, seed=21)


def _cli(*args):
    return [sys.executable, "-m", "eagle_compat.cli", "extract", *args, "--gpu-memory-utilization", "0.3",
            "--no-progress"]


def _run(model, data, out, *extra):
    proc = subprocess.run(_cli("--model", model, "--data", data, "--out", str(out), "--layers",
                               ",".join(map(str, LAYERS)), "--batch-size", "8", "--max-len", "256", *extra),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _files(out):
    return sorted(f for f in os.listdir(out) if f.startswith("data_") and f.endswith((".pt", ".safetensors")))


RUN_STDERR: dict[str, str] = {}  # what each run of the module's fixtures said, by its --out


@pytest.fixture(scope="module")
def full_run(model, dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    RUN_STDERR[str(out)] = _run(model, dataset, out, "--validate").stderr
    return out


def test_a_quiet_run_says_its_stages_in_order_and_nothing_of_vllm(full_run):
    """The command line's default (quiet): one line per stage from the first second, every line its own."""
    lines = [ln for ln in RUN_STDERR[str(full_run)].splitlines() if ln.strip()]
    stages = ["extract: input read: 60 samples, ", "extract: engine starting (vLLM ", "extract: engine ready in "]
    at = [next((i for i, ln in enumerate(lines) if ln.startswith(stage)), None) for stage in stages]
    assert None not in at and at == sorted(at), lines
    assert all(ln.startswith("extract: ") for ln in lines), [ln for ln in lines if not ln.startswith("extract: ")]


def test_files_load_in_speculators_dataset_and_equal_hf(full_run, model):
    import eagle_compat
    eagle_compat.install()  # speculators 0.3.0 imports under transformers 5 only with it
    from speculators.train.data import Eagle3SampleFileDataset

    assert len(_files(full_run)) == 60
    ds = Eagle3SampleFileDataset(max_len=256, datapath=str(full_run))
    assert len(ds) == 60
    item = ds[3]
    assert set(item) >= {"hidden_states", "input_ids", "verifier_last_hidden_states", "loss_mask"}
    for index in (0, 1, 17, 59):
        sample = writer.load_sample(writer.sample_path(str(full_run), index, "pt"))
        assert_matches_hf([sample], model, [sample["input_ids"].tolist()], LAYERS, precision="bf16")
    manifest = json.load(open(os.path.join(full_run, "manifest.json")))
    assert manifest["status"] == "complete" and manifest["layer_ids"] == LAYERS
    assert "leaving decoder layer" in manifest["layer_convention"]
    assert manifest["settings"]["model_checksums"]["model.safetensors"]["sha256"]
    config = json.load(open(os.path.join(full_run, "data_config.json")))
    assert config["hidden_states"]["layer_ids"] == LAYERS and config["data"]["num_samples"] == 60
    conv = writer.load_sample(writer.sample_path(str(full_run), 0, "pt"))  # a conversation: mask on the reply
    assert 0 < int(conv["loss_mask"].sum()) < conv["loss_mask"].numel()


def _equal_dirs(a, b):
    assert _files(a) == _files(b)
    for name in _files(a):
        x, y = writer.load_sample(os.path.join(a, name)), writer.load_sample(os.path.join(b, name))
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        for h, g in zip(x["hidden_states"], y["hidden_states"], strict=True):
            assert torch.equal(h, g), name


PAUSED = 12  # files a paused run writes before it holds (one batch of 8 whole, the next half)


def _start_until(model, dataset, out) -> subprocess.Popen:
    """Start an extract run in its own process group; return once exactly PAUSED sample files are complete, its
    further writes held (tests/data/pause_writes.py: a fault point, not a timing window) until `_release(proc)`.
    Its output goes to files (a pipe nobody reads could fill and stall it); `_finish` returns it."""
    logs = out.parent / f"{out.name}.log"
    pause = out.parent / f"{out.name}.pause"
    pause.mkdir()
    cli = _cli("--model", model, "--data", dataset, "--out", str(out), "--layers", ",".join(map(str, LAYERS)),
               "--batch-size", "8", "--max-len", "256")
    hooked = [sys.executable, "-c", "import sys, pause_writes; from eagle_compat.cli import main; sys.exit(main())",
              *cli[cli.index("extract"):]]
    env = {**os.environ, "PAUSE_WRITES_AFTER": str(PAUSED), "PAUSE_WRITES_DIR": str(pause),
           "PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(__file__), "data"),
                                          *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen(hooked, stdout=open(f"{logs}.out", "w"), stderr=open(f"{logs}.err", "w"),
                            start_new_session=True, env=env)
    proc.logs, proc.pause = logs, pause
    deadline = time.time() + 600  # an upper bound on a stuck start, not a window the test depends on
    while time.time() < deadline and not (pause / "ready").exists() and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None and len(_files(out)) == PAUSED, open(f"{logs}.err").read()[-3000:]
    return proc


def _release(proc) -> None:
    (proc.pause / "release").touch()


def _finish(proc, timeout: float) -> tuple[str, str]:
    proc.wait(timeout=timeout)
    return open(f"{proc.logs}.out").read(), open(f"{proc.logs}.err").read()


def _resumes_to_a_clean_run(full_run, model, dataset, out, *, driver_killed: bool = False) -> None:
    written = len(_files(out))
    assert PAUSED <= written < 60, f"the fault came too late to test resume ({written} files)"
    temps = [f for f in os.listdir(out) if ".tmp-" in f]
    # a live driver removes partial files itself; after SIGKILL one may remain under its temporary name (never
    # counted) until the next run sweeps it
    assert driver_killed or not temps, temps
    _run(model, dataset, out, "--resume")
    assert not [f for f in os.listdir(out) if ".tmp-" in f]
    _equal_dirs(full_run, out)


def test_a_killed_driver_leaves_no_worker_behind_and_resume_equals_a_clean_run(full_run, model, dataset, tmp_path):
    """SIGKILL to the driver alone (an OOM kill): its vLLM workers must exit, not spin on the cores. With more calls
    queued than vLLM's message rings hold, an orphaned worker blocked writing a reply spun at 100% CPU for good (seen
    here); the driver keeps fewer in flight, so the worker's own parent-death check ends it. Then --resume completes
    the run to the bytes of an uninterrupted one. (One test for both: each engine start costs CI time, and a kill of the
    whole process group leaves the same files as this one.)"""
    import psutil
    out = tmp_path / "driver-killed"
    proc = _start_until(model, dataset, out)
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if "VLLM" in p.name()]
    assert workers and proc.poll() is None
    os.kill(proc.pid, signal.SIGKILL)
    _finish(proc, 60)
    gone, alive = psutil.wait_procs(workers, timeout=60)
    for p in alive:
        p.kill()
    assert not alive, f"vLLM workers outlived their driver by 60 s: {[p.pid for p in alive]}"
    assert len(_files(out)) == PAUSED  # exactly the files complete at the kill
    _resumes_to_a_clean_run(full_run, model, dataset, out, driver_killed=True)


def test_a_killed_worker_stops_the_run_with_the_cause_and_resume_equals_a_clean_run(full_run, model, dataset,
                                                                                      tmp_path):
    """SIGKILL to vLLM's worker alone (the driver lives): a clear WorkerDied error within seconds, no hang."""
    import psutil
    out = tmp_path / "worker-killed"
    proc = _start_until(model, dataset, out)
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if "VLLM" in p.name()]
    assert workers and proc.poll() is None
    killed_at = time.time()
    os.kill(workers[0].pid, signal.SIGKILL)
    _release(proc)  # the held writes go on; the engine's next call meets the dead worker
    stdout, stderr = _finish(proc, 120)
    assert time.time() - killed_at < 60 and proc.returncode == 1, stderr[-3000:]
    assert re.search(rf"WorkerDied in a vLLM worker during '\w+': vLLM worker 0 \(pid {workers[0].pid}\) killed by "
                     "SIGKILL", stderr), stderr[-3000:]
    assert "rerun the same command with --resume to continue" in stderr
    _resumes_to_a_clean_run(full_run, model, dataset, out)


def test_ctrl_c_stops_cleanly_and_resume_equals_a_clean_run(full_run, model, dataset, tmp_path):
    """Ctrl-C reaches the whole foreground process group: the driver and vLLM's workers."""
    out = tmp_path / "interrupted"
    proc = _start_until(model, dataset, out)
    os.killpg(proc.pid, signal.SIGINT)
    _release(proc)  # the writes in progress finish (a clean stop waits for them)
    stdout, stderr = _finish(proc, 300)
    written = len(_files(out))
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stdout + stderr, (stdout + stderr)[-5000:]
    assert stderr.strip().splitlines()[-1] == (
        f"eagle-compat extract: interrupted; {written} of this run's 60 files are complete in {out} (no partial file "
        "is left); rerun the same command with --resume to continue")
    assert json.load(open(out / "manifest.json"))["runs"][-1]["status"] == "interrupted"
    _resumes_to_a_clean_run(full_run, model, dataset, out)


def test_resume_with_other_settings_is_refused(full_run, model, dataset):
    before = {f: os.path.getmtime(os.path.join(full_run, f)) for f in os.listdir(full_run)}
    proc = subprocess.run(_cli("--model", model, "--data", dataset, "--out", str(full_run), "--layers", "1,5",
                               "--batch-size", "4", "--max-len", "256", "--resume"), capture_output=True, text=True)
    assert proc.returncode == 2
    assert "other settings" in proc.stderr and "layer_ids: was [0, 2, 4, 5], now [1, 5]" in proc.stderr
    assert "batch_size: was 8, now 4" in proc.stderr
    after = {f: os.path.getmtime(os.path.join(full_run, f)) for f in os.listdir(full_run)}
    assert after == before  # nothing already written was touched
    again = subprocess.run(_cli("--model", model, "--data", dataset, "--out", str(full_run)), capture_output=True,
                           text=True)
    assert again.returncode == 2 and "--resume" in again.stderr


def test_two_shards_equal_the_unsharded_run(full_run, model, dataset, tmp_path):
    out = tmp_path / "sharded"
    _run(model, dataset, out, "--shard", "0/2")
    _run(model, dataset, out, "--shard", "1/2")
    _equal_dirs(full_run, out)
    # one settings record for both shards; the run that completed the set described it for speculators
    assert sorted(f for f in os.listdir(out) if f.endswith(".json")) == ["data_config.json", "manifest.json"]
    assert json.load(open(out / "data_config.json"))["data"]["num_samples"] == 60


@pytest.mark.parametrize("args, message", [
    ({"format": "npz"}, "--format 'npz'; allowed: pt, safetensors"),
    ({"batch_size": 0}, "--batch-size 0; must be >= 1"),
    ({"data": "/nonexistent.jsonl"}, "no such file"),
])
def test_bad_options_are_refused_before_the_engine(model, dataset, tmp_path, args, message):
    opts = job.ExtractOptions(model=model, data=dataset, out=str(tmp_path / "x"), progress=False)
    for k, v in args.items():
        setattr(opts, k, v)
    with pytest.raises(InvalidInput, match=message.replace("(", r"\(").replace(")", r"\)")):
        job.run(opts)


def test_bad_shard_and_layers_text():
    with pytest.raises(InvalidInput, match="need 0 <= I < N"):
        job_options.parse_shard("2/2")
    with pytest.raises(InvalidInput, match="expected I/N"):
        job_options.parse_shard("half")
    with pytest.raises(InvalidInput, match="comma-separated ints"):
        job_options.parse_layers("2,x")
