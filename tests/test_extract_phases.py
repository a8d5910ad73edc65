"""The extract job in named phases (extract/job.py): `plan` decides everything from the options, the model and the
input and writes nothing; `claim` takes the directory (the batches to do, the record of this run); `run_batches`
hands the batches to a runner; `finish` checks and describes the set. `job.run` is these four, in order."""
from __future__ import annotations

import json

import pytest

from eagle_compat.errors import InvalidInput
from eagle_compat.extract import directory_lock, file_hashes, job, writer

from helpers import extract_options, token_lines

N = 24


@pytest.fixture
def dataset(tmp_path):
    return token_lines(tmp_path / "data.jsonl", N, seed=5)


_opts = extract_options


def test_a_plan_writes_nothing_and_holds_what_the_run_will_do(tiny_llama, dataset, tmp_path):
    out = tmp_path / "new" / "out"
    plan = job.plan(_opts(tiny_llama, dataset, out, shard=(1, 2), gpu_memory_utilization=None))
    assert not (tmp_path / "new").exists()  # nothing written: not even the folder
    assert isinstance(plan, job.RunPlan)
    assert plan.layer_ids == [0, 5] and plan.settings["layer_ids"] == [0, 5]
    assert [s.index for s in plan.placed] == list(range(N)) and [s.row for s in plan.placed] == list(range(N))
    # shard 1 of 2: the odd batches, fixed by position
    assert [[s.index for s in b] for b in plan.mine] == [list(range(4 * k, 4 * k + 4)) for k in (1, 3, 5)]
    assert plan.settings["data_sha256"] == file_hashes.file_sha256(dataset)
    assert plan.opts.gpu_memory_utilization is not None  # the device's default, resolved by the plan
    assert plan.path_of(plan.placed[3]).endswith("data_3.pt")


def test_a_refused_plan_names_the_value_and_leaves_out_as_it_was(tiny_llama, dataset, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(InvalidInput, match="layer id 99 out of range; this model has layers 0..5"):
        job.plan(_opts(tiny_llama, dataset, out, layers=[0, 99]))
    assert not out.exists()


def test_run_is_its_four_phases_in_order(tiny_llama, dataset, tmp_path, fake_engine, monkeypatch):
    calls = []
    for name in ("plan", "claim", "run_batches", "finish"):
        def spy(*args, _real=getattr(job, name), _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(job, name, spy)
    summary = job.run(_opts(tiny_llama, dataset, tmp_path / "out"))
    assert calls == ["plan", "claim", "run_batches", "finish"]
    assert summary["complete"] and summary["written_this_run"] == N


def test_a_claim_takes_the_batches_without_files_and_records_this_run(tiny_llama, dataset, tmp_path, fake_engine):
    out = tmp_path / "out"
    job.run(_opts(tiny_llama, dataset, out, shard=(0, 2)))  # the even batches: a set half done
    plan = job.plan(_opts(tiny_llama, dataset, out, resume=True))
    with directory_lock.DirectoryLock(plan.out):
        claim = job.claim(plan)
    assert isinstance(claim, job.Claim)
    assert [[s.index for s in b] for b in claim.todo] == [list(range(4 * k, 4 * k + 4)) for k in (1, 3, 5)]
    assert claim.manifest["runs"][-1] is claim.this_run
    assert claim.this_run["batches_to_do"] == 3 and claim.this_run["status"] == "running"
    on_disk = json.loads((out / writer.MANIFEST).read_text())  # written before any sample is
    assert on_disk["status"] == "running" and on_disk["runs"][-1]["batches_to_do"] == 3
    assert not claim.was_complete and claim.states.stamp == writer.states_stamp(plan.settings)


def test_layers_checked_by_the_job_are_not_checked_again_by_the_generator(tiny_llama, dataset, tmp_path, monkeypatch):
    # --layers is checked once in the driver (options.py): the plan's ids say so, and the generator takes them as
    # they are; a plain list (the generator's own API) is checked as before
    from eagle_compat import options
    plan = job.plan(_opts(tiny_llama, dataset, tmp_path / "out"))
    assert options.checked_for(plan.layer_ids, plan.num_layers) and plan.layer_ids == [0, 5]
    assert not options.checked_for(plan.layer_ids, plan.num_layers + 1) and not options.checked_for([0, 5], 6)
    assert json.loads(json.dumps(plan.settings))["layer_ids"] == [0, 5]  # recorded as a plain list
    import pickle
    again = pickle.loads(pickle.dumps(plan.layer_ids))  # as the Ray actors receive it
    assert options.checked_for(again, plan.num_layers) and again == [0, 5]


def test_the_record_is_typed_and_its_checker_names_what_it_does_not_declare(tiny_llama, dataset, tmp_path,
                                                                             fake_engine):
    # every record a test writes is checked against extract/record.py (tests/conftest.py); the checker itself:
    from eagle_compat.extract import record
    out = tmp_path / "out"
    job.run(_opts(tiny_llama, dataset, out))
    written = json.loads((out / writer.MANIFEST).read_text())
    assert record.problems(written) == [] and written["runs"] and written["status"] == "complete"
    assert record.problems({**written, "num_sample": 3}) == [
        "manifest: 'num_sample' is not declared in extract/record.py:Manifest"]
    assert record.problems({**written, "num_samples": "24"}) == [
        "manifest: 'num_samples' is str, declared <class 'int'>"]
    assert record.problems({**written, "runs": [{**written["runs"][0], "pid": True}]}) == [
        "manifest.runs[0]: 'pid' is bool, declared <class 'int'>"]
    assert record.problems({**written, "settings": {**written["settings"], "batch_size": "4", "shard": "0/2"}}) == [
        "manifest.settings: 'batch_size' is str, declared <class 'int'>",
        "manifest.settings: 'shard' is not declared in extract/record.py:Settings"]


# ---- the path of --layers, from the command line to the worker that hooks them ----------------------------------

LAYERS_PATH_SCRIPT = r"""
import json, os, sys, traceback
from eagle_compat import cli, generator, options
from eagle_compat.capture import worker

SRC = os.path.dirname(os.path.abspath(generator.__file__)) + os.sep
checks = {"validate_layer_ids": 0, "default_layer_ids": 0, "check_training_layers": 0}
for name in checks:
    def counted(*args, _real=getattr(options, name), _name=name, **kwargs):
        checks[_name] += 1
        return _real(*args, **kwargs)
    for module in (options, generator):
        if hasattr(module, name):
            setattr(module, name, counted)

class InProcess(generator.VllmHiddenStatesGenerator):  # its worker in this process: one stack, driver to worker
    def __init__(self, *args, **kwargs):
        super().__init__(*args, in_process=True, **kwargs)
generator.VllmHiddenStatesGenerator = InProcess

taken = {}
class Capture(worker.CaptureSession):  # what hooks the layers, made by the worker's set-up call
    def __init__(self, owner, layer_ids, *args, **kwargs):
        taken["stack"] = [f.filename[len(SRC):] for f in traceback.extract_stack()[:-1] if f.filename.startswith(SRC)]
        taken["layer_ids"] = list(layer_ids)
        super().__init__(owner, layer_ids, *args, **kwargs)
worker.CaptureSession = Capture

code = cli.main(["extract", "--model", sys.argv[1], "--data", sys.argv[2], "--out", sys.argv[3], "--layers", "0,5",
                 "--batch-size", "4", "--max-len", "64"])
print("PATH " + json.dumps({"code": code, "checks": checks, **taken}))
"""


# what every call to the workers passes through, whatever it carries: the error wrappers of the driver
# (`translate`: a worker's failure said as the worker raised it) and of the worker (`reported`)
PASSED_THROUGH = {"remote_errors.py"}


def layers_path(stack: list[str]) -> list[str]:
    """The files of a stack, in order, each run of frames in one file counted once, the error wrappers left out."""
    files = [f for f in stack if f not in PASSED_THROUGH]
    return [f for k, f in enumerate(files) if k == 0 or files[k - 1] != f]


def test_layers_path_check():
    # job entered twice: the test below fails
    assert (layers_path(["cli.py", "cli.py", "extract/job.py", "remote_errors.py", "generator.py", "extract/job.py"])
            == ["cli.py", "extract/job.py", "generator.py", "extract/job.py"])


@pytest.mark.engine
def test_layers_go_from_the_command_line_to_the_worker_through_six_files_and_are_checked_once(tmp_path):
    """`--layers` of `eagle-compat extract` reach the worker that hooks them through at most six files, none entered
    twice (the frames on the stack when the worker takes them, its worker in the driver's process), and each check of
    them runs once in the process (docs/architecture.md: the extract job)."""
    import subprocess
    import sys

    from eagle_compat import tiny_models
    model = tiny_models.build_tiny_model("llama")
    data = token_lines(tmp_path / "data.jsonl", 4, seed=3)
    proc = subprocess.run([sys.executable, "-c", LAYERS_PATH_SCRIPT, model, data, str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PATH ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = json.loads(lines[-1][len("PATH "):])
    assert found["code"] == 0 and found["layer_ids"] == [0, 5], found
    path = layers_path(found["stack"])
    assert path[0] == "cli.py" and path[-1] == "capture/worker.py", path
    assert len(path) <= 6 and len(set(path)) == len(path), path
    assert found["checks"] == {"validate_layer_ids": 1, "default_layer_ids": 0, "check_training_layers": 1}, found
