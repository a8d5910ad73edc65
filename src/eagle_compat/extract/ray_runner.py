"""`eagle-compat extract --ray [ADDRESS]`: the extract job's batches run on a pool of Ray actors.

The driver (`job.run`) keeps everything that makes a directory consistent: the settings record, the lock, the sweep
of temporary files, which batches are to do (`--resume`), and the manifest. This module only replaces the loop that
turns those batches into files: each actor owns one `VllmHiddenStatesGenerator` for its life, receives whole
batches (the same batches, with the same composition, as a local run), and writes the batch's sample files itself,
atomically (temporary name in the same directory, then rename), to the shared output path. The driver receives
only counts, so it is never the data path.

Faults: actors are created with `max_restarts` (Ray restarts a dead actor; the engine starts again lazily) and
`max_task_retries=0`: the driver itself requeues a batch whose actor died or whose call raised, and stops the run
with the worker's error after `MAX_TRIES` failures of one batch. Files are written by whole batches: a batch that
failed may have left some of its files (complete ones: every write is atomic); its retry rewrites them with the
same bytes.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from .. import detect, engine, settings
from ..errors import EagleCompatError, InvalidInput
from . import atomic_io, directory_lock, formats, pipeline, placement, stages, writer
from .batch_job import EngineArgs, SampleWriting

MAX_TRIES = 3  # a batch that fails this many times stops the run
MAX_RESTARTS = 4  # per actor; past it the actor leaves the pool (the run stops when the pool is empty)
MAX_UNAVAILABLE = 10  # ActorUnavailableError replies for one batch before the run stops
WAIT_POLL_S = 30.0  # how often the driver looks for hung actors while no batch finishes
LOAD_DEADLINE_S, LOAD_DEADLINE_ENV = 3600.0, "EAGLE_COMPAT_LOAD_DEADLINE_S"  # an actor's engine start
# node-local: which cores an actor's engine binds its threads to; one folder per user (another user's would refuse
# our lock files, and a folder of links planted in a shared /tmp would be followed)
CORE_LOCKS = "/tmp/eagle-compat-cpu-cores-{uid}"


def core_locks_dir() -> str:
    """This user's folder of core locks: made private (0700), and refused where it is a link or another user's."""
    import stat
    path = CORE_LOCKS.format(uid=os.geteuid())
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise writer.OutputDirectoryConflict(
            f"{path} (this user's CPU core locks for --ray) is not a folder of yours (a link, a file or another "
            "user's): another user of this host may have made it. Remove it and run again")
    return path


# where this eagle_compat is imported from (src/eagle_compat): the actors are given its parent first on PYTHONPATH
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class EngineDtypeMismatch(InvalidInput):
    """An actor's engine resolved another dtype than the directory's files (a cluster of mixed GPUs)."""


class RayExtractError(EagleCompatError, RuntimeError):
    """A batch failed MAX_TRIES times, or every actor died; the message carries the worker's error."""
    run_failed = True  # the CLI exits 1 and says how to continue (refusals exit 2)


def require_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise InvalidInput("--ray needs Ray: pip install 'eagle-compat[ray]' (ray 2.60.0)") from None
    return ray


def check_options(opts: Any) -> None:
    """Before anything is read or written: Ray is importable and the pool options make sense."""
    require_ray()
    for name in ("ray_actors", "ray_cpus_per_actor"):
        value = getattr(opts, name)
        if value is not None and value < 1:
            raise InvalidInput(f"--{name.replace('_', '-')} {value}; must be >= 1")


# what makes the states: an actor on a node with other releases of these would add states of another computation
STATES_VERSIONS = ("vllm", "torch", "transformers", "eagle_compat")


def states_versions() -> dict:
    from .._version import __version__
    return {**{k: v for k, v in detect.installed_versions().as_dict().items() if k in STATES_VERSIONS},
            "eagle_compat": __version__}


def versions_refusal(rank: int, host: str, actor: dict, driver: dict) -> str | None:
    """Why an actor's node may not add to this run's set (None: it may): the releases that differ."""
    differ = [f"{k} {actor.get(k)} (the driver: {driver.get(k)})" for k in STATES_VERSIONS
              if actor.get(k) != driver.get(k)]
    if not differ:
        return None
    return (f"actor {rank} on {host} runs " + ", ".join(differ) + ": its states would be computed by other code than "
            "the rest of the set. Install the same releases on every node (or run where they are); its batch's "
            "files were removed")


def actor_runtime_env() -> dict:
    """The actors import eagle_compat where the driver does: a source checkout's `src` first on their PYTHONPATH (a
    shared checkout). An installed eagle_compat sits in site-packages, which must not be put before each node's own
    packages: there the actors import the node's install."""
    src = os.path.dirname(PACKAGE_DIR)
    if os.path.basename(src) in ("site-packages", "dist-packages"):
        return {}
    pythonpath = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    return {"env_vars": {"PYTHONPATH": pythonpath}}


def connect(address: str | None) -> tuple[Any, str]:
    """`address` None: RAY_ADDRESS if set, else a new local cluster, always (Ray's own default joins whatever cluster
    this host last recorded in /tmp/ray, another user's or a stale one); 'auto': a running cluster on this node;
    'host:port' / 'ray://…': that cluster. Returns (ray, what was connected to)."""
    global _connected
    ray = require_ray()
    if ray.is_initialized():
        return ray, _connected or ray.get_runtime_context().gcs_address
    kwargs: dict[str, Any] = {"logging_level": "WARNING", "log_to_driver": True}
    local = address is None and not settings.raw("RAY_ADDRESS")
    if local:
        kwargs["include_dashboard"] = False
    try:
        ray.init(address="local" if local else address, **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise InvalidInput(f"--ray {address or ''}: could not connect to a Ray cluster: {exc}".replace("  ", " ")
                           ) from None
    _connected = ray.get_runtime_context().gcs_address
    if local:
        _connected += " (a local cluster started by this run)"
    return ray, _connected


_connected: str | None = None


def claim_cores(count: int, tp: int) -> tuple[str | None, list[int], list[int]]:
    """On CPU, `count` cores of this node that no other actor's engine uses: flock'ed lock files (one per core,
    released by the kernel when the actor dies). Returns vLLM's VLLM_CPU_OMP_THREADS_BIND for `tp` ranks, the cores,
    and the open lock fds (kept for the actor's life)."""
    locks = core_locks_dir()
    got, fds = [], []
    for core in sorted(os.sched_getaffinity(0)):
        if len(got) == count:
            break
        fd = directory_lock.try_flock(os.path.join(locks, f"core-{core}.lock"), 0o600)
        if fd is None:  # another actor's engine runs there
            continue
        got.append(core)
        fds.append(fd)
    if len(got) < max(tp, 1):
        for fd in fds:
            os.close(fd)
        return None, [], []
    return engine.process_env.thread_binding(got, tp), got, fds


@dataclass
class ActorSpec:
    """What each actor is given: the run's engine and sample writing (the same records a local run uses), and where
    the actor runs."""
    engine: EngineArgs
    writing: SampleWriting
    cpus: int
    on_gpu: bool
    env: dict = field(default_factory=dict)  # the driver's VLLM_* and EAGLE_COMPAT_* settings


class ExtractActor:
    """One engine for the actor's life (started on the first batch, again after a restart)."""

    def __init__(self, spec: ActorSpec, rank: int):
        self.spec, self.rank = spec, rank
        out = spec.writing.out
        if not os.path.exists(os.path.join(out, writer.MANIFEST)):  # the driver wrote it before any actor
            raise InvalidInput(f"actor {rank} on {socket.gethostname()} does not see {out}/{writer.MANIFEST}, "
                               "which the driver wrote: --out must be a folder every Ray node shares (files written "
                               "where the driver cannot see them would be lost)")
        driver_uid = os.stat(os.path.join(out, writer.MANIFEST)).st_uid
        if driver_uid != os.geteuid():  # its files would be another user's: no run of the driver's user trusts them
            raise InvalidInput(f"actor {rank} on {socket.gethostname()} runs as uid {os.geteuid()}, and the driver "
                               f"that wrote {out}/{writer.MANIFEST} as {directory_lock.user_named(driver_uid)}: a "
                               "run trusts only its own user's files, so this actor's would be refused. Start the Ray "
                               "cluster as the user who runs the driver")
        # held for the actor's life: a later driver of this directory waits for it
        # (directory_lock.wait_for_other_writers)
        self.writers_fd = directory_lock.hold_as_writer(out)
        self.gen = None
        self.core_fds: list[int] = []
        self.binding: str | None = None
        self.engine_seconds = 0.0

    def where(self) -> dict:
        import ray
        return {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                "node": ray.get_runtime_context().get_node_id(), "binding": self.binding}

    def _start(self) -> None:
        spec = self.spec
        os.environ.update(spec.env)
        if not spec.on_gpu and not settings.is_set("VLLM_CPU_OMP_THREADS_BIND"):
            # two engines on one node must not bind their threads to the same cores ("auto" takes the whole node)
            deadline = time.time() + 30  # a killed actor's engine workers hold its cores until they notice
            while True:
                self.binding, cores, self.core_fds = claim_cores(spec.cpus, spec.engine.tensor_parallel_size)
                if self.binding is not None or time.time() > deadline:
                    break
                time.sleep(0.5)
            if self.binding is None:
                raise InvalidInput(f"actor {self.rank}: no {spec.cpus} free cores on {socket.gethostname()} for its "
                                   "engine (others hold them); lower --ray-actors or --ray-cpus-per-actor, or set "
                                   "VLLM_CPU_OMP_THREADS_BIND")
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = self.binding
            os.sched_setaffinity(0, cores)
        from .. import generator
        t = time.time()
        self.gen = generator.VllmHiddenStatesGenerator(**spec.engine.keywords())
        self.engine_seconds += time.time() - t

    def engine_dtype(self) -> str | None:
        config = getattr(self.gen, "vllm_config", None)  # (a stand-in engine in tests has none)
        return str(config.model_config.dtype) if config is not None else None

    def describe(self) -> dict:
        if self.gen is None:
            self._start()
        return {"decoder_contract": self.gen.describe(), "engine_dtype": self.engine_dtype()}

    def close(self) -> None:
        if self.gen is not None:
            gen, self.gen = self.gen, None
            gen.close()

    def run_batch(self, batch: list[formats.Placed], expected_dtype: str | None = None) -> dict:
        """Extract and write one batch, in the run's format (a local run's writing: batch_job.SampleWriting). Returns
        counts and timings. `expected_dtype`: the engine dtype of the directory's files (the record's, or the first
        actor's): an engine of another one writes nothing."""
        started = time.time()
        if self.gen is None:
            self._start()
        writing = self.spec.writing
        if expected_dtype and self.engine_dtype() and self.engine_dtype() != expected_dtype:
            raise EngineDtypeMismatch(writer.two_precisions(
                f"the engine of actor {self.rank} on {socket.gethostname()}", self.engine_dtype(),
                self.spec.engine.dtype, expected_dtype, writing.out))
        t = time.time()
        try:
            results = self.gen.generate([s.input_ids for s in batch])
        except BaseException:
            # an engine that failed mid-batch (a dead vLLM worker) is not reused: the next batch starts a new one
            gen, self.gen = self.gen, None
            try:
                gen.close()
            except Exception:  # noqa: BLE001
                pass
            raise
        forward = time.time() - t
        tokens = 0
        left_out = []
        for s, r in zip(batch, results, strict=True):
            try:  # temp file + rename, as a local run writes it
                entry = writing.write(s, r)
            except OSError as exc:
                raise atomic_io.OutputWriteError(f"could not write {writing.path(s)} on "
                                              f"{socket.gethostname()}: {exc.strerror or exc}") from exc
            if entry is not None:
                left_out.append(entry)
            tokens += len(s.input_ids)
        import ray

        return {"samples": len(batch) - len(left_out), "tokens": tokens, "left_out_non_finite": left_out,
                "versions": states_versions(),
                "seconds": time.time() - started, "forward": forward,
                "eagle_compat": PACKAGE_DIR, "engine_dtype": self.engine_dtype(),
                "pid": os.getpid(), "host": socket.gethostname(), "binding": self.binding,
                "engine_seconds": self.engine_seconds,
                # a restarted incarnation (the previous one died): how the driver counts deaths that Ray reported
                # only as ActorUnavailableError
                "restarted": bool(ray.get_runtime_context().was_current_actor_reconstructed)}


@dataclass
class _Item:
    number: int
    batches: Any  # the run's batches: batch `number` is made when asked for (read from the spool: a view)
    tries: int = 0
    unavailable: int = 0  # ActorUnavailableError replies (not failures: the batch is retried on the same actor)
    errors: list = field(default_factory=list)
    sent_at: float = 0.0
    ended: bool = False  # its actor was ended as hung

    @property
    def batch(self) -> list:
        return self.batches[self.number]


def batch_deadline(engine_may_start: bool) -> float:
    """How long one batch may run on an actor before the actor counts as hung (stopped, deadlocked): a safety net
    above the engine's own deadlines (every call inside the actor has the step deadline, engine.rpc.call_deadline, and
    fails there first): twice the step deadline, plus the engine's start where the actor's engine may be starting
    (its first batch, and the first after any failure: a failed engine is not reused; its model loads again)."""
    load = settings.value(LOAD_DEADLINE_ENV) if engine_may_start else 0.0
    return 2 * engine.rpc.call_deadline() + load


def _end_hung_actors(ray: Any, actors: list, in_flight: dict, stats: list[dict]) -> None:
    """An actor whose batch is past its deadline is ended (Ray restarts it); its call then fails as a dead actor's,
    and the batch is redone like any other. Looked at on every turn of the driver's loop, so one hung actor is found
    while the others keep finishing batches."""
    now = time.time()
    for rank, item in list(in_flight.values()):
        limit = batch_deadline(stats[rank]["engine_may_start"])
        if not item.ended and now - item.sent_at > limit:
            item.ended = True
            print(f"extract: actor {rank} has run batch {item.number} for {now - item.sent_at:.0f} s, past its "
                  f"deadline of {limit:.0f} s (hung?): ending it; Ray restarts it and the batch is redone",
                  file=sys.stderr, flush=True)
            ray.kill(actors[rank], no_restart=False)


def _error_text(ray: Any, exc: BaseException) -> tuple[str, BaseException | None]:
    """What the worker raised (its type, message and traceback), and the exception itself where Ray kept it."""
    cause = getattr(exc, "cause", None) if isinstance(exc, ray.exceptions.RayTaskError) else None
    if cause is not None:
        return f"{type(cause).__name__}: {cause}", cause
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}", None


def _pool_size(opts: Any, resources: dict, connected: str, batches: int) -> tuple[int, int, bool]:
    """How many actors, with how many CPUs each, and whether they run on GPUs: as many as the cluster fits (or
    --ray-actors), never more than there are batches."""
    tp = opts.tensor_parallel_size
    on_gpu = resources.get("GPU", 0) > 0
    cpus = opts.ray_cpus_per_actor or (1 if on_gpu else tp)
    fit = int(resources.get("GPU", 0)) // tp if on_gpu else int(resources.get("CPU", 0)) // cpus
    if fit < 1:
        raise InvalidInput(f"--ray: the cluster ({connected}) has "
                           f"{resources.get('GPU', 0) if on_gpu else resources.get('CPU', 0)} "
                           f"{'GPUs' if on_gpu else 'CPUs'}; one actor needs {tp if on_gpu else cpus}")
    return max(1, min(opts.ray_actors or fit, batches)), cpus, on_gpu


def _actor_spec(engine_args: EngineArgs, writing: SampleWriting, cpus: int, on_gpu: bool) -> ActorSpec:
    # the driver's vLLM settings travel to the actors (the cluster's nodes may have been started with others)
    env = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "EAGLE_COMPAT_"))}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # N engines' start-up logs would bury the one progress bar
    # an actor's working directory is not the driver's: the model and --out by their absolute paths
    return ActorSpec(engine=dataclasses.replace(engine_args, model=os.path.abspath(engine_args.model)),
                     writing=dataclasses.replace(writing, out=os.path.abspath(writing.out)),
                     cpus=cpus, on_gpu=on_gpu, env=env)


def _actor_stats(rank: int) -> dict:
    return {"rank": rank, "batches": 0, "samples": 0, "tokens": 0, "busy_s": 0.0, "forward_s": 0.0, "failures": 0,
            "deaths": 0, "died_errors": 0, "restarts_seen": 0, "unavailable": 0, "engine_may_start": True,
            "pids": [], "hosts": [], "binding": None, "engine_start_s": 0.0, "eagle_compat": None}


class _Pool:
    """The driver's side of one --ray run: batches handed to idle actors, failed ones retried (on the same actor
    where it was only unavailable), replies checked and counted."""

    def __init__(self, ray: Any, opts: Any, spec: ActorSpec, actors: list, stats: list[dict], manifest: dict,
                 this_run: dict, todo: list[list[formats.Placed]]):
        self.ray, self.opts, self.actors, self.stats = ray, opts, actors, stats
        self.writing, self.dtype = spec.writing, spec.engine.dtype
        self.manifest, self.this_run = manifest, this_run
        self.total = placement.sample_count(todo)
        self.todo = todo
        # batch numbers not yet sent, or a failed batch's item to send again (an item is made when first sent)
        self.pending: collections.deque = collections.deque(range(len(todo)))
        self.alive = set(range(len(actors)))
        self.idle = collections.deque(range(len(actors)))
        self.in_flight: dict[Any, tuple[int, _Item]] = {}
        self.done_samples = self.done_tokens = 0
        self.progress: pipeline.Progress | None = None
        self.t_work = 0.0
        self.described = False
        self.driver_versions = states_versions()
        # the directory's engine precision: its files' (the record's), else the first actor's to reply
        self.expected_dtype = manifest.get("engine_dtype") if writer.any_sample_file(self.writing.out) else None

    def send(self, rank: int, item: _Item) -> None:
        directory_lock.check_lock_held(self.writing.out)  # its lock file removed: another run may write here now
        self.in_flight[self.actors[rank].run_batch.remote(item.batch, self.expected_dtype)] = (rank, item)
        item.sent_at, item.ended = time.time(), False

    def run(self) -> None:
        while self.pending or self.in_flight:
            while self.idle and self.pending:
                rank = self.idle.popleft()
                if rank in self.alive:
                    item = self.pending.popleft()
                    self.send(rank, item if isinstance(item, _Item) else _Item(item, self.todo))
            if not self.in_flight:
                raise RayExtractError(f"every actor of the pool died ({MAX_RESTARTS} restarts each); "
                                      f"{len(self.pending)} batches not done")
            ready, _ = self.ray.wait(list(self.in_flight), num_returns=1, timeout=WAIT_POLL_S)
            _end_hung_actors(self.ray, self.actors, self.in_flight, self.stats)
            for ref in ready:
                rank, item = self.in_flight.pop(ref)
                try:
                    reply = self.ray.get(ref)
                except (self.ray.exceptions.RayTaskError, self.ray.exceptions.RayActorError) as exc:
                    if not self.failed(rank, item, exc):
                        continue  # sent back to the same actor, which stays busy
                else:
                    self.replied(rank, item, reply)
                if rank in self.alive:
                    self.idle.append(rank)

    def failed(self, rank: int, item: _Item, exc: BaseException) -> bool:
        """A batch's call raised: retried (False: on the same, still busy actor) or the run stops."""
        ray = self.ray
        text, cause = _error_text(ray, exc)
        if isinstance(exc, getattr(ray.exceptions, "ActorUnavailableError", ())):
            # not a death: the actor may still be running the batch (Ray: "the task may or may not have been
            # executed"), or it is restarting. The batch goes back to the same actor, whose calls run one at a
            # time: never a second writer of the same files on another actor.
            item.unavailable += 1
            self.stats[rank]["unavailable"] += 1
            self.stats[rank]["engine_may_start"] = True  # it may be a restarted incarnation
            if item.unavailable > MAX_UNAVAILABLE:
                raise RayExtractError(f"batch {item.number}: actor {rank} stayed unavailable through "
                                      f"{MAX_UNAVAILABLE} retries: {text.splitlines()[0][:300]}") from cause
            print(f"extract: actor {rank} unavailable during batch {item.number} ({text.splitlines()[0][:200]}); "
                  "the batch goes back to the same actor", file=sys.stderr, flush=True)
            time.sleep(min(0.5 * item.unavailable, 5.0))  # let a restarting actor come back
            self.send(rank, item)
            return False
        if isinstance(cause, EngineDtypeMismatch):  # no retry helps: the cluster's GPUs differ
            raise RayExtractError(str(cause)) from cause
        died = isinstance(exc, ray.exceptions.RayActorError)  # ActorDiedError and the like
        st = self.stats[rank]
        st["failures"] += 1
        st["engine_may_start"] = True  # restarted, or its failed engine is not reused
        st["died_errors"] += died
        st["deaths"] = max(st["died_errors"], st["restarts_seen"])
        # dead for good: more deaths than restarts, however Ray reported them; or ActorDiedError twice in a row (a
        # restarting actor answers ActorUnavailableError, a live one answers)
        st["died_in_a_row"] = st.get("died_in_a_row", 0) + 1 if died else 0
        if died and (st["died_errors"] > MAX_RESTARTS or st["restarts_seen"] >= MAX_RESTARTS
                     or st["died_in_a_row"] >= 2):
            self.alive.discard(rank)  # however Ray reported its earlier deaths
        else:  # a dead-for-good actor's refusal says nothing about the batch: not a try
            item.tries += 1
        item.errors.append(f"actor {rank}: {text}")
        print(f"extract: batch {item.number} failed on actor {rank} (try {item.tries} of {MAX_TRIES}): "
              f"{text.splitlines()[0][:300] if text else type(exc).__name__}"
              f"{'; Ray restarts the actor' if died else ''}", file=sys.stderr, flush=True)
        if item.tries >= MAX_TRIES:
            raise RayExtractError(
                f"batch {item.number} (samples {item.batch[0].index}..{item.batch[-1].index}) failed "
                f"{item.tries} times; the worker's errors:\n" + "\n".join(item.errors)) from cause
        self.pending.appendleft(item)  # redone whole, first (its files, if any were written, are complete)
        return True

    def _refuse_batch(self, item: _Item, message: str) -> None:
        """A batch whose files must not stay (another precision, other versions): they go, and the run stops."""
        for s in item.batch:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.writing.path(s))
        raise RayExtractError(message)

    def replied(self, rank: int, item: _Item, r: dict) -> None:
        """A batch's files are written: checked against the directory's precision and versions, then counted."""
        if r.get("engine_dtype") and self.expected_dtype is None:  # the first reply sets the directory's
            self.expected_dtype = self.manifest["engine_dtype"] = r["engine_dtype"]
        elif r.get("engine_dtype") and r["engine_dtype"] != self.expected_dtype:
            # sent before any actor had replied: its files are of another precision
            self._refuse_batch(item, writer.two_precisions(
                f"the engine of actor {rank} on {r['host']}", r["engine_dtype"], self.dtype,
                self.expected_dtype, self.writing.out) + " (its batch's files were removed)")
        refusal = versions_refusal(rank, r["host"], r["versions"], self.driver_versions) if r.get("versions") else None
        if refusal:
            self._refuse_batch(item, refusal)
        if self.progress is None:  # rates count from the first engine's first batch, as a local run's
            self.progress = pipeline.Progress(self.total, self.opts.progress)
            self.t_work = time.time() - r["forward"]
        self._count(self.stats[rank], r)
        self.this_run.setdefault("left_out_non_finite", []).extend(r.get("left_out_non_finite") or [])
        self.done_samples += r["samples"]
        self.done_tokens += r["tokens"]
        elapsed = max(time.time() - self.t_work, 1e-9)
        self.progress.update(r["samples"] + len(r.get("left_out_non_finite") or []), self.done_samples / elapsed,
                             self.done_tokens / elapsed)
        if not self.described:  # the engine's own description, as a local run records it
            self.described = True
            try:
                self.manifest.update(self.ray.get(self.actors[rank].describe.remote(), timeout=120))
            except Exception:  # noqa: BLE001 - a description must not stop the run
                pass

    @staticmethod
    def _count(st: dict, r: dict) -> None:
        st["batches"] += 1
        st["engine_may_start"], st["died_in_a_row"] = False, 0
        st["samples"] += r["samples"]
        st["tokens"] += r["tokens"]
        st["busy_s"] = round(st["busy_s"] + r["seconds"], 3)
        st["forward_s"] = round(st["forward_s"] + r["forward"], 3)
        st["engine_start_s"] = round(r["engine_seconds"], 2)
        st["binding"] = r["binding"]
        st["eagle_compat"] = r["eagle_compat"]  # where the actor imported it from (actor_runtime_env)
        st["engine_dtype"] = r.get("engine_dtype")
        st["versions"] = r.get("versions")  # each node's, recorded (the run's own are the driver's)
        if r["pid"] not in st["pids"]:
            st["pids"].append(r["pid"])
            # one death per restarted incarnation, however Ray reported it (ActorDiedError, or only
            # ActorUnavailableError: "Socket closed", then "The actor is restarting"); seen on AMD EPYC
            st["restarts_seen"] += bool(r.get("restarted"))
            st["deaths"] = max(st["died_errors"], st["restarts_seen"])
        if r["host"] not in st["hosts"]:
            st["hosts"].append(r["host"])

    def close(self, started: float) -> None:
        """The pool's times recorded, the engines closed in order (their workers exit), the actors ended, and what
        an actor killed mid-write left swept (the driver still holds the lock)."""
        if self.progress is not None:
            self.progress.close()
        elapsed = time.time() - started
        record = self.this_run["ray"]
        record["seconds"] = round(elapsed, 2)  # with the engines' start
        if self.progress is not None:  # from the first batch's start to the last batch's end: the steady rate's clock
            record["work_seconds"] = round(time.time() - self.t_work, 3)
            record["tokens_per_s"] = round(self.done_tokens / max(time.time() - self.t_work, 1e-9), 1)
        try:
            self.ray.get([a.close.remote() for a in self.actors], timeout=60)
        except Exception:  # noqa: BLE001 - dead or busy actors are killed below
            pass
        for a in self.actors:
            try:
                self.ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        record["temp_files_swept_at_end"] = len(writer.sweep_temp_files(self.writing.out))
        print(summary_lines(self.stats, elapsed), file=sys.stderr, flush=True)


def extract(opts: Any, todo: list[list[formats.Placed]], engine_args: EngineArgs, writing: SampleWriting,
            manifest: dict, this_run: dict) -> tuple[int, int]:
    """Runs `todo` (the batches job.run chose) on the pool; records the engine's description in `manifest` and the
    pool's in `this_run`; returns (samples written, tokens)."""
    ray, connected = connect(opts.ray or None)
    actors_n, cpus, on_gpu = _pool_size(opts, ray.cluster_resources(), connected, len(todo))
    tp = engine_args.tensor_parallel_size
    spec = _actor_spec(engine_args, writing, cpus, on_gpu)
    # the actors import eagle_compat where the driver does (a shared checkout or the same install on every node)
    remote = ray.remote(ExtractActor).options(
        num_cpus=cpus, num_gpus=tp if on_gpu else 0, max_restarts=MAX_RESTARTS, max_task_retries=0,
        runtime_env=actor_runtime_env())
    actors = [remote.remote(spec, rank) for rank in range(actors_n)]
    stages.say(f"{actors_n} engine{'s' if actors_n != 1 else ''} starting on the Ray cluster (each loads the weights "
               "and builds its KV cache before its first batch)")
    stats = [_actor_stats(r) for r in range(actors_n)]
    this_run["ray"] = {"cluster": connected, "actors": actors_n, "cpus_per_actor": None if on_gpu else cpus,
                       "gpus_per_actor": tp if on_gpu else None, "per_actor": stats}
    pool = _Pool(ray, opts, spec, actors, stats, manifest, this_run, todo)
    started = time.time()
    try:
        pool.run()
    finally:
        pool.close(started)
    return pool.done_samples, pool.done_tokens


def summary_lines(stats: list[dict], elapsed: float) -> str:
    lines = [f"extract --ray: {len(stats)} actors, {elapsed:.1f} s"]
    for st in stats:
        rate = st["tokens"] / st["forward_s"] if st["forward_s"] else 0.0
        lines.append(f"  actor {st['rank']}: {st['batches']} batches, {st['samples']} samples, {st['tokens']} tokens, "
                     f"{rate:,.0f} tok/s in forward, engine start {st['engine_start_s']:.1f} s, {st['failures']} failed "
                     f"tries ({st['deaths']} deaths, {st.get('unavailable', 0)} unavailable), pid {','.join(map(str, st['pids'])) or '-'} on "
                     f"{','.join(st['hosts']) or '-'}, cores {st['binding'] or 'vLLM default'}")
    return "\n".join(lines)
