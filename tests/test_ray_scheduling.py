"""The `--ray` driver's scheduling decisions against a scripted stand-in for Ray (no cluster, no engine): which
failure counts as a death, where a batch goes after each kind of failure. Runs in every environment.

Found on an AVX2-only AMD EPYC: one SIGKILLed actor was reported as `deaths: 2`. There Ray 2.60 answered the killed
actor's batch with `ActorUnavailableError` ("Socket closed"), and the batch handed straight back to the restarting actor
again ("The actor is restarting"); the driver counted each as a death (the error subclasses `RayActorError`) and a
failed try. On Intel machines the same kill gave one `ActorDiedError`. Ray's own words for `ActorUnavailableError`: "the
task may or may not have been executed on the actor": handing the batch to *another* actor could leave two writers of
the same files. Deaths are now counted once per restarted incarnation, however Ray reports them."""
from __future__ import annotations

import types

import pytest

from eagle_compat.extract import formats, ray_runner
from eagle_compat.extract.batch_job import EngineArgs, SampleWriting


class RayError(Exception):
    pass


class RayTaskError(RayError):
    cause = None


class RayActorError(RayError):
    pass


class ActorDiedError(RayActorError):
    pass


class ActorUnavailableError(RayActorError):
    pass


class FakeRay:
    """Actors answer from a script: per rank, the outcome of each run_batch call in order: "ok"; "died"
    (ActorDiedError; the actor restarts); "killed" (ActorUnavailableError "Socket closed"; the actor restarts);
    "unavailable" (ActorUnavailableError "restarting": no new death). Calls complete in submission order. Records
    (rank, batch number) per call; replies carry the incarnation's pid and Ray's `was_current_actor_reconstructed`."""

    def __init__(self, script: dict[int, list[str]]):
        self.script = {rank: list(outcomes) for rank, outcomes in script.items()}
        self.calls: list[tuple[int, int]] = []
        self.kills: list[tuple[int, bool]] = []
        self.idle_waits = 0
        self.clock = [1000.0]  # the driver's time.time()
        self.seconds_per_batch = 0.0
        self.killed_after_calls: list[int] = []
        self.exceptions = types.SimpleNamespace(RayTaskError=RayTaskError, RayActorError=RayActorError,
                                                ActorDiedError=ActorDiedError,
                                                ActorUnavailableError=ActorUnavailableError)

    def cluster_resources(self):
        return {"CPU": 2.0}

    def remote(self, cls):
        fake = self

        class Options:
            def options(self, **kwargs):
                return self

            def remote(self, spec, rank):
                return FakeActor(fake, rank)
        return Options()

    def wait(self, refs, num_returns=1, timeout=None):
        done = [r for r in refs if not getattr(r, "hung", False)]
        if not done:
            self.idle_waits += 1
            if timeout is None or self.idle_waits > 1000:
                raise AssertionError("the driver waits for a hung actor forever")
            self.clock[0] += timeout  # the wait's timeout passed
            return [], refs
        self.clock[0] += self.seconds_per_batch  # a batch takes this long
        return done[:num_returns], [r for r in refs if r not in done[:num_returns]]

    def get(self, ref, timeout=None):
        if isinstance(ref, list):
            return [self.get(r) for r in ref]
        return ref()

    def kill(self, actor, no_restart=True):
        self.kills.append((actor.rank, no_restart))
        self.killed_after_calls.append(len(self.calls))
        for reply in actor.hung:  # its hung call fails as a dead actor's; Ray restarts it
            reply.hung = False
            reply.outcome = "died"
        if actor.hung:
            actor.incarnation += 1
        actor.hung = []


class FakeActor:
    def __init__(self, ray: FakeRay, rank: int):
        self.ray, self.rank, self.incarnation = ray, rank, 0
        self.hung: list = []
        self.run_batch = types.SimpleNamespace(remote=self._run_batch)
        self.describe = types.SimpleNamespace(remote=lambda: (lambda: {}))
        self.close = types.SimpleNamespace(remote=lambda: (lambda: None))

    def _run_batch(self, batch, expected_dtype=None):
        number = batch[0].index // 10  # the test's batches hold samples 10k .. 10k+9
        self.ray.calls.append((self.rank, number))
        outcome = self.ray.script[self.rank].pop(0) if self.ray.script[self.rank] else "ok"
        if outcome in ("died", "killed"):
            self.incarnation += 1  # Ray restarts it: later calls run in a new process
        actor = self

        def reply():
            outcome = reply.outcome
            pid, restarted = 100 * (actor.incarnation + 1) + actor.rank, actor.incarnation > 0
            if outcome == "died":
                raise ActorDiedError("The actor died unexpectedly before finishing this task.")
            if outcome == "killed":
                raise ActorUnavailableError("The actor is temporarily unavailable: RpcError: Socket closed. The "
                                            "task may or may not have been executed on the actor.")
            if outcome == "unavailable":
                raise ActorUnavailableError("The actor is temporarily unavailable: IOError: The actor is "
                                            "restarting. The task may or may not have been executed on the actor.")
            return {"samples": len(batch), "tokens": 10 * len(batch), "seconds": 0.01, "forward": 0.01,
                    "eagle_compat": "here", "pid": pid, "host": "h", "binding": None,
                    "engine_seconds": 0.0, "restarted": restarted}
        reply.outcome, reply.hung = outcome, outcome == "hang"
        if reply.hung:
            self.hung.append(reply)
        return reply


def _run(monkeypatch, tmp_path, script, batches=4, seconds_per_batch=0.0):
    fake = FakeRay(script)
    fake.seconds_per_batch = seconds_per_batch
    monkeypatch.setattr(ray_runner, "connect", lambda address: (fake, "fake cluster"))
    monkeypatch.setattr(ray_runner.time, "sleep", lambda s: None)
    monkeypatch.setattr(ray_runner.time, "time", lambda: fake.clock[0])
    opts = types.SimpleNamespace(ray="fake", tensor_parallel_size=1, ray_cpus_per_actor=1, ray_actors=2,
                                 model=str(tmp_path), data="data.jsonl", out=str(tmp_path), format="pt",
                                 validate=False,
                                 gpu_memory_utilization=0.3, kv_cache_memory_bytes=None, dtype="float32",
                                 trust_remote_code=False, progress=False)
    todo = [[formats.Placed(10 * k + j, 10 * k + j, 10 * k + j, [1, 2], [0, 1]) for j in range(10)]
            for k in range(batches)]
    this_run: dict = {}
    engine_args = EngineArgs(model=opts.model, layer_ids=[0], max_len=8, gpu_memory_utilization=0.3,
                             tensor_parallel_size=1, dtype="float32", trust_remote_code=False, kv_cache_memory_bytes=None)
    writing = SampleWriting(out=opts.out, format="pt", data=opts.data, layer_ids=[0], validate=False, vocab_size=32,
                            hidden_size=16, stamp=None, skip_non_finite=False)
    done, tokens = ray_runner.extract(opts, todo, engine_args, writing, {}, this_run)
    return fake, this_run["ray"]["per_actor"], done


def test_an_actor_is_given_the_model_and_out_by_their_absolute_paths(monkeypatch, tmp_path):
    """An actor's working directory is not the driver's: `extract --model ./m --out ./o --ray` must reach the same
    folders from every actor."""
    monkeypatch.chdir(tmp_path)
    engine_args = EngineArgs(model="m", layer_ids=[0], max_len=8, gpu_memory_utilization=0.3, tensor_parallel_size=1,
                             dtype="float32", trust_remote_code=False, kv_cache_memory_bytes=None)
    writing = SampleWriting(out="o", format="pt", data="data.jsonl", layer_ids=[0], validate=False, vocab_size=32,
                            hidden_size=16, stamp=None, skip_non_finite=False)
    spec = ray_runner._actor_spec(engine_args, writing, cpus=1, on_gpu=False)
    assert spec.engine.model == str(tmp_path / "m") and spec.writing.out == str(tmp_path / "o")
    assert spec.engine.max_model_len == 9 and spec.writing.fmt.name == "pt"


@pytest.mark.parametrize("kill", [["killed", "unavailable"], ["died", "unavailable"], ["died"], ["killed"]],
                         ids=["amd-epyc", "died-then-restarting", "intel", "socket-closed-only"])
def test_one_kill_is_one_death_however_ray_reports_it(monkeypatch, tmp_path, kill):
    fake, per_actor, done = _run(monkeypatch, tmp_path, {0: kill, 1: []})
    assert done == 40 and sum(a["samples"] for a in per_actor) == 40
    assert [a["deaths"] for a in per_actor] == [1, 0], per_actor
    # an ActorUnavailableError is not a failed try: the batch was not known to fail
    assert sum(a["failures"] for a in per_actor) == kill.count("died"), per_actor


def test_an_unavailable_actor_keeps_its_batch(monkeypatch, tmp_path):
    # the AMD EPYC sequence of one SIGKILL: "Socket closed", then "restarting"
    fake, per_actor, done = _run(monkeypatch, tmp_path, {0: ["killed", "unavailable"], 1: []})
    assert [a["unavailable"] for a in per_actor] == [2, 0], per_actor
    # after the call answered "unavailable", the batch went to the same actor, as that actor's next call, and to no
    # other actor
    unavailable_call = [i for i, c in enumerate(fake.calls) if c[0] == 0][0]
    rank, number = fake.calls[unavailable_call]
    later = fake.calls[unavailable_call + 1:]
    assert next(c for c in later if c[0] == rank) == (rank, number), fake.calls
    assert all(r == rank for r, n in later if n == number), fake.calls


def test_an_actor_that_stays_unavailable_stops_the_run_naming_it(monkeypatch, tmp_path):
    with pytest.raises(ray_runner.RayExtractError, match=r"actor 0 stayed unavailable"):
        _run(monkeypatch, tmp_path, {0: ["unavailable"] * (ray_runner.MAX_UNAVAILABLE + 1), 1: []})


def test_a_dead_actors_batch_is_redone_once_whole(monkeypatch, tmp_path):
    fake, per_actor, done = _run(monkeypatch, tmp_path, {0: ["died"], 1: []})
    assert done == 40 and sum(a["samples"] for a in per_actor) == 40
    assert [a["deaths"] for a in per_actor] == [1, 0]
    assert sorted(n for _, n in fake.calls) == [0, 0, 1, 2, 3]  # batch 0 twice (died, redone), the rest once


def test_a_hung_actor_is_ended_past_its_deadline_and_its_batch_redone(monkeypatch, tmp_path):
    """An actor that hangs without dying (stopped, deadlocked) used to stall `ray.wait` forever. The driver polls; a
    batch running past its deadline (the step deadline, plus the engine's start for an actor's first batch) ends its
    actor, which Ray restarts, and the batch is redone."""
    monkeypatch.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "60")
    monkeypatch.setenv(ray_runner.LOAD_DEADLINE_ENV, "120")
    fake, per_actor, done = _run(monkeypatch, tmp_path, {0: ["hang"], 1: []})
    assert done == 40 and sum(a["samples"] for a in per_actor) == 40
    assert fake.kills[0] == (0, False), fake.kills  # ended with a restart, not removed
    assert [a["deaths"] for a in per_actor] == [1, 0], per_actor
    assert fake.clock[0] - 1000.0 >= 240  # not before the first batch's deadline (2 x 60 s + 120 s of engine start)


def test_a_hung_actor_is_found_while_the_others_keep_finishing_batches(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "60")
    monkeypatch.setenv(ray_runner.LOAD_DEADLINE_ENV, "120")
    fake, per_actor, done = _run(monkeypatch, tmp_path, {0: ["hang"], 1: []}, batches=40, seconds_per_batch=10.0)
    assert done == 400 and fake.kills and fake.kills[0] == (0, False)
    assert fake.killed_after_calls[0] < len(fake.calls) - 10, (fake.killed_after_calls, len(fake.calls))


def test_an_actor_out_of_restarts_leaves_the_pool_without_using_up_the_batchs_tries(monkeypatch, tmp_path):
    # Ray reported each of its deaths as "Socket closed" (the AMD EPYC path): then it is dead for good
    kills = ["killed"] * ray_runner.MAX_RESTARTS + ["died"] * (ray_runner.MAX_TRIES + 2)
    fake, per_actor, done = _run(monkeypatch, tmp_path, {0: kills, 1: []}, batches=12)
    assert done == 120 and sum(a["samples"] for a in per_actor) == 120
