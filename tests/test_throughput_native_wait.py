"""benchmarks/throughput.py's native phase waits for each of vLLM's hidden-states files by the connector's own lock:
a file is written once it exists and its PATH.lock (vLLM 0.25.1+) is not held; the .lock itself stays behind."""
import fcntl
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("throughput", os.path.join(ROOT, "benchmarks", "throughput.py"))
throughput = importlib.util.module_from_spec(spec)
spec.loader.exec_module(throughput)


def test_a_file_counts_as_written_only_once_the_connector_releases_its_lock(tmp_path):
    path = str(tmp_path / "req-0.safetensors")
    lock = os.open(path + ".lock", os.O_CREAT | os.O_RDWR)  # as the connector does when it schedules the request
    fcntl.flock(lock, fcntl.LOCK_EX)
    assert not throughput.native_file_written(path)  # neither written nor released
    with open(path, "wb") as f:
        f.write(b"partial")
    assert not throughput.native_file_written(path)  # being written: the lock is still held
    os.close(lock)  # the write is done: the lock is released, its file stays (vLLM never deletes it)
    assert os.path.exists(path + ".lock")
    assert throughput.native_file_written(path)


def test_without_a_lock_file_the_file_existing_is_enough(tmp_path):
    path = str(tmp_path / "req-1.safetensors")  # vLLM < 0.25.1: written before the request's output returns
    assert not throughput.native_file_written(path)
    open(path, "wb").close()
    assert throughput.native_file_written(path)


def test_native_is_also_timed_to_written_durability(tmp_path, monkeypatch):
    """vLLM's connector never fsyncs; `written` fsyncs each file: fsync_all puts every native file on disk."""
    paths = [str(tmp_path / f"req-{k}.safetensors") for k in range(3)]
    for path in paths:
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    assert throughput.fsync_all(paths) >= 0
    assert sorted(synced) == sorted(map(os.path.realpath, paths))


def test_a_failed_phase_is_kept_in_the_results_before_the_run_ends(tmp_path, monkeypatch):
    """The results JSON is rewritten after every phase, failed ones too, with the phases asked: a run its call cuts
    off later still shows which phase failed and which never ran (compat_matrix/render.py's throughput table)."""
    import json
    import sys
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    out = tmp_path / "run.json"

    class CutOff(Exception):
        pass

    def run_phase(cmd, stdout, stderr):  # stands in for each phase's process
        name = cmd[cmd.index("--phase") + 1]
        if name == "plain":
            stdout.write("PHASE " + json.dumps({"seconds": 2.0, "tokens": 100}) + "\n")
        elif name == "delivered":
            stdout.write("Traceback (most recent call last):\nRuntimeError: engine died\n")
        else:
            raise CutOff  # the call's time limit ends the run here
    monkeypatch.setattr(throughput.subprocess, "run", run_phase)
    monkeypatch.setattr(throughput.tempfile, "tempdir", str(tmp_path))  # the run's work folder, left by the cut-off
    monkeypatch.setattr(sys, "argv", ["throughput.py", "--model", str(model), "--phases", "plain,delivered,written",
                                      "--write-dir", str(tmp_path), "--out", str(out)])
    with pytest.raises(CutOff):
        throughput.main()
    results = json.loads(out.read_text())
    assert results["complete"] is False and results["phases_asked"] == ["plain", "delivered", "written"]
    assert results["phases"]["plain"]["tokens_per_s"] == 50.0
    assert "RuntimeError: engine died" in results["phases"]["delivered"]["error"]
    assert "written" not in results["phases"]


def test_the_disk_phase_writes_what_written_writes_without_an_engine(tmp_path, monkeypatch):
    """`disk` times the writer alone on the run's folder: every prompt's file, the model's hidden size and dtype, each
    fsynced, so `disk_over_plain` says whether the disk alone can keep up with plain prefill."""
    import argparse
    import json
    import time

    import torch

    from eagle_compat.extract import atomic_io, writer
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 32, "torch_dtype": "bfloat16"}))
    synced = []
    real_fsync, real_save = atomic_io.fsync_file, writer.save_sample
    monkeypatch.setattr(atomic_io, "fsync_file", lambda path: (synced.append(path), real_fsync(path)))
    monkeypatch.setattr(writer, "save_sample", lambda *a: (time.sleep(0.1), real_save(*a))[1])  # a slow disk
    args = argparse.Namespace(phase="disk", model_path=str(model), dummy=False, prompts=6, tokens=10, layers="1,3",
                              writer_threads=2, write_dir=str(tmp_path), keep_files=False)
    kept = []
    monkeypatch.setattr("shutil.rmtree", lambda path, ignore_errors=False: kept.append(path))  # look at the files
    result = throughput.phase(args)
    assert result["files"] == 6 and result["tokens"] == 60
    assert result["seconds"] >= 0.3  # 6 writes of 0.1 s on 2 threads: the clock waits for the last one
    sample = torch.load(os.path.join(kept[0], "data_5.pt"))  # the last one submitted is there, whole
    assert [tuple(h.shape) for h in sample["hidden_states"]] == [(10, 32), (10, 32)]
    assert sample["hidden_states"][0].dtype == torch.bfloat16
    assert result["bytes"] >= 6 * 2 * 10 * 32 * 2 and len(synced) >= 6
