"""What a command started, it ends: a hung (stopped) worker and its children do not outlive `eagle-compat`, on any
way out (a normal end, an error, Ctrl-C once or twice, SIGTERM), and a generator in a user's process ends its
engine's processes only.

Reproduced from outside before: `extract` with its vLLM worker and multiprocessing's resource tracker stopped
(SIGSTOP) ended on Ctrl-C, and both were still there afterwards, stopped, children of init (on a GPU such an orphan
keeps its memory). The test of that scenario starts a real engine; the others use small Python processes.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from eagle_compat import leftovers

from helpers import in_newest_pass_only

DATA = os.path.join(os.path.dirname(__file__), "data")

# a child that starts a grandchild, then both stop themselves (hung: not dead, not answering)
HUNG_TREE = r"""
import os, signal, subprocess, sys
grandchild = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"])
print(grandchild.pid, flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""
# a child that leaves a stopped grandchild and exits: the grandchild is an orphan
ORPHAN_MAKER = r"""
import subprocess, sys
grandchild = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(grandchild.pid, flush=True)
"""


# -- /proc read here, not through the module under test -----------------------------------------------------------

def _stat(pid: int) -> tuple[int, str, int] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[0], int(fields[19])  # parent, state, start time


def _key(pid: int) -> tuple[int, int]:
    stat = _stat(pid)
    return pid, -1 if stat is None else stat[2]  # -1: already gone


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _running(key) -> bool:
    stat = _stat(key[0])
    return stat is not None and stat[2] == key[1] and stat[1] not in ("Z", "X")


def _stopped(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[1] == "T"


def _wait_until(check, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _kill_all(keys) -> None:
    """The test's own clean-up: what a failed assertion left is not left on the machine."""
    for pid, start in keys:
        if _running((pid, start)):
            os.kill(pid, signal.SIGKILL)


def test_a_stopped_process_tree_and_an_orphan_started_by_the_command_are_ended():
    keep = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # there before: not ours to end
    processes = leftovers.CommandProcesses()
    made = []
    try:
        child = subprocess.Popen([sys.executable, "-c", HUNG_TREE], stdout=subprocess.PIPE, text=True)
        grandchild = int(child.stdout.readline())
        orphan = int(subprocess.run([sys.executable, "-c", ORPHAN_MAKER], capture_output=True, text=True).stdout)
        made = [_key(child.pid), _key(grandchild), _key(orphan)]
        _wait_until(lambda: all(_stopped(pid) for pid, _ in made))
        # the orphan's parent exited: it is reparented to the command (its subreaper), not to init
        assert _stat(orphan)[0] == os.getpid()
        ended = processes.end(grace_s=2.0)
        assert {int(e.split()[0]) for e in ended} == {child.pid, grandchild, orphan}
        assert child.wait(timeout=10) is not None
        _wait_until(lambda: not any(_running(k) for k in made))
        assert keep.poll() is None  # the process that was there before runs on
        assert processes.end() == []  # ended once
    finally:
        processes.end()
        _kill_all(made)
        keep.kill()
        keep.wait()


def test_a_generator_ends_its_engines_processes_only():
    """A generator may live in a user's process: its close() ends the workers it recorded and what runs below them,
    also a worker's child orphaned when vLLM's shutdown kills the worker, and never the user's own children."""
    engine = leftovers.EngineProcesses()
    worker = subprocess.Popen([sys.executable, "-c", HUNG_TREE], stdout=subprocess.PIPE, text=True)
    users = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # started while it runs
    made = [_key(worker.pid), _key(users.pid)]
    try:
        engine.record([worker.pid])
        grandchild = int(worker.stdout.readline())
        made.append(_key(grandchild))
        _wait_until(lambda: _stopped(worker.pid) and _stopped(grandchild))
        engine.record()  # close() records what runs below the workers before vLLM's shutdown
        worker.kill()  # vLLM's shutdown kills the worker: its child goes to init
        worker.wait()
        _wait_until(lambda: _stat(grandchild)[0] != worker.pid)
        ended = engine.end(grace_s=2.0)
        assert [int(e.split()[0]) for e in ended] == [grandchild]
        _wait_until(lambda: not _running(made[2]))
        assert users.poll() is None
    finally:
        _kill_all(made)
        users.wait()


def test_a_pid_given_to_another_process_is_never_signalled():
    """A process is named by its pid and start time: where the start time is not the recorded one, the pid belongs
    to another process now, and nothing is sent to it."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pid, start = _key(other.pid)
        leftovers.send((pid, start + 1), signal.SIGKILL)
        assert leftovers.end_processes([(pid, start - 1)], grace_s=0.5) == []
        time.sleep(0.2)
        assert other.poll() is None and _running((pid, start))
        leftovers.send((pid, start), signal.SIGKILL)  # the recorded pair reaches it
        assert other.wait(timeout=10) == -signal.SIGKILL
    finally:
        other.kill()
        other.wait()


# the command line's own path, with a command that leaves hung processes (a fake `_main`)
COMMAND = r"""
import os, signal, subprocess, sys, time
from eagle_compat import cli
from eagle_compat.extract import job
HOW, ORPHAN_MAKER = sys.argv[1:3]
signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as in a terminal, whatever the test runner was started under
def command(argv):
    child = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # the test reads to the end
    orphan = subprocess.run([sys.executable, "-c", ORPHAN_MAKER], capture_output=True, text=True).stdout.strip()
    print(child.pid, orphan, flush=True)
    if HOW == "error":
        raise RuntimeError("failed")
    if HOW == "ctrl-c":
        raise KeyboardInterrupt("interrupted")
    if HOW == "second ctrl-c":  # extract's handlers: the first stops cleanly, the second (while closing) ends at once
        signal.signal(signal.SIGINT, job._stop_on_first_sigint)
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except KeyboardInterrupt:
            os.kill(os.getpid(), signal.SIGINT)
    time.sleep(120)  # SIGTERM, SIGHUP: sent by the test
    return 0
cli._main = command
sys.argv = ["eagle-compat", "extract"]
sys.exit(cli.main())
"""


@pytest.mark.parametrize("how, code", [("error", 1), ("ctrl-c", -signal.SIGINT), ("second ctrl-c", 130),
                                       ("SIGTERM", -signal.SIGTERM), ("SIGHUP", -signal.SIGHUP)])
def test_the_command_line_ends_what_it_left_running_and_says_so(how, code):
    """os._exit (a second Ctrl-C) and the default SIGTERM or SIGHUP skip `finally`: the processes are ended first."""
    proc = subprocess.Popen([sys.executable, "-c", COMMAND, how, ORPHAN_MAKER], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    made = []
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        made = [_key(p) for p in pids]
        if how.startswith("SIG"):
            _wait_until(lambda: all(_stopped(p) for p in pids))
            proc.send_signal(getattr(signal, how))
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == code, stderr
        assert "ended 2 process(es) this command started and left running" in stderr, stderr
        _wait_until(lambda: not any(_running(k) for k in made))
    finally:
        _kill_all(made)
        proc.kill()
        proc.wait()


def test_called_from_python_nothing_of_the_callers_is_touched(monkeypatch):
    from eagle_compat import cli
    made = []

    class Recorded(leftovers.CommandProcesses):
        def __init__(self):
            super().__init__()
            made.append(self)
    monkeypatch.setattr(leftovers, "CommandProcesses", Recorded)
    monkeypatch.setattr(cli, "_main", lambda argv: 0)
    handler = signal.getsignal(signal.SIGTERM)
    assert cli.main(["doctor"]) == 0 and made == []
    monkeypatch.setattr(sys, "argv", ["eagle-compat", "doctor"])
    assert cli.main() == 0 and len(made) == 1
    assert signal.getsignal(signal.SIGTERM) == handler  # the caller's handlers are put back


# -- the scenario seen, on a real engine ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def extract_input(tmp_path_factory):
    from eagle_compat import tiny_models
    from helpers import write_dataset
    data = write_dataset(tmp_path_factory.mktemp("data") / "data.jsonl", 200, 20, 60, seed=5, conversations_every=0)
    return tiny_models.build_tiny_model("llama"), data


def _marked(variable: str, value: str) -> set[tuple[int, int]]:
    """Processes that started with `variable=value` in their environment (a process that rewrote its environment
    block, as vLLM's worker does to set its title, is found by ancestry instead)."""
    found = set()
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if f"{variable}={value}".encode() in f.read().split(b"\0"):
                    found.add(_key(int(name)))
        except (OSError, ValueError, TypeError):
            continue
    return found


def _below(root: int) -> set[tuple[int, int]]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        stat = _stat(int(name)) if name.isdigit() else None
        if stat is not None:
            children.setdefault(stat[0], []).append(int(name))
    out, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if _stat(child) is not None:
                out.add(_key(child))
                todo.append(child)
    return out


@pytest.mark.engine
@in_newest_pass_only("the process tree is ended by the command's own code (leftovers.py reads /proc, not vLLM), the "
                     "same on every release")
@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_extract_whose_engine_is_stopped_leaves_no_process_when_it_ends(extract_input, tmp_path, how):
    """`extract` on a tiny Llama; once a sample file is written (tests/data/pause_writes.py: a fault point, not a
    timing window) every process below the command is stopped with SIGSTOP, then the command gets Ctrl-C (SIGINT)
    or SIGTERM. Before: it exited and left the vLLM worker and multiprocessing's resource tracker stopped, children
    of init. Ctrl-C stops cleanly: the engine's calls end at their deadline (30 s here), then the engine is closed."""
    model, data = extract_input
    mark, pause = uuid.uuid4().hex, tmp_path / "pause"
    pause.mkdir()
    env = {**os.environ, "LEFTOVERS_TEST_RUN": mark, "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "30",
           "PAUSE_WRITES_AFTER": "1", "PAUSE_WRITES_DIR": str(pause),
           "PYTHONPATH": os.pathsep.join([DATA, *filter(None, [os.environ.get("PYTHONPATH")])])}
    command = [sys.executable, "-c", "import sys, pause_writes; from eagle_compat.cli import main; sys.exit(main())",
               "extract", "--model", model, "--data", data, "--out", str(tmp_path / "out"), "--layers", "0,5",
               "--batch-size", "1", "--max-len", "128", "--gpu-memory-utilization", "0.3", "--no-progress"]
    log = open(tmp_path / "log", "w+")
    proc = subprocess.Popen(command, stdout=log, stderr=log, env=env, start_new_session=True)
    tree: set[tuple[int, int]] = set()
    try:
        _wait_until(lambda: (pause / "ready").exists() or proc.poll() is not None, seconds=900)
        assert proc.poll() is None, open(tmp_path / "log").read()[-3000:]
        tree = _below(proc.pid) | (_marked("LEFTOVERS_TEST_RUN", mark) - {_key(proc.pid)})
        names = {_cmdline(pid) for pid, _ in tree}
        assert any("VLLM::Worker" in n for n in names) and any(leftovers.RESOURCE_TRACKER in n for n in names), names
        for pid, _ in tree:
            os.kill(pid, signal.SIGSTOP)
        (pause / "release").touch()  # the written files go on; the engine's processes stay stopped
        proc.send_signal(getattr(signal, how))
        proc.wait(timeout=300)
        said = open(tmp_path / "log").read()
        assert proc.returncode == (130 if how == "SIGINT" else -signal.SIGTERM), said[-3000:]
        deadline = time.monotonic() + 60  # how long the command's own tracker may take to read its end and exit
        while time.monotonic() < deadline and any(_running(k) for k in tree | _marked("LEFTOVERS_TEST_RUN", mark)):
            time.sleep(0.1)
        left = {k for k in tree | _marked("LEFTOVERS_TEST_RUN", mark) if _running(k)}
        assert not left, [f"{pid} {_stat(pid)} {_cmdline(pid)[:80]}" for pid, _ in left]
    finally:
        _kill_all(tree | _marked("LEFTOVERS_TEST_RUN", mark))
        if proc.poll() is None:
            proc.kill()
            proc.wait()
