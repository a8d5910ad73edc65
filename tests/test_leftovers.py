"""What a command started, it ends: a hung (stopped) worker and its children do not outlive `eagle-compat`.

Reproduced from outside before: `extract` with its vLLM workers stopped (SIGSTOP) ended on Ctrl-C, and its worker
and multiprocessing's resource tracker were still alive minutes later (on a GPU such an orphan keeps its memory).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from eagle_compat import leftovers

# a child that starts a grandchild, then both stop themselves (hung: not dead, not answering)
HUNG_TREE = r"""
import os, signal, subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"])
print(grandchild.pid, flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _wait_until(check, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_stopped_process_tree_started_after_the_mark_is_ended():
    keep = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # there before: not ours to end
    try:
        before = leftovers.descendants()
        child = subprocess.Popen([sys.executable, "-c", HUNG_TREE], stdout=subprocess.PIPE, text=True)
        grandchild = int(child.stdout.readline())
        _wait_until(lambda: _stopped(child.pid) and _stopped(grandchild))
        ended = leftovers.end_new_descendants(before, grace_s=2.0)
        assert {int(e.split()[0]) for e in ended} == {child.pid, grandchild}
        assert child.wait(timeout=10) is not None
        _wait_until(lambda: not leftovers._alive(grandchild))
        assert keep.poll() is None  # the process that was there before the mark runs on
        assert leftovers.end_new_descendants(before) == []  # nothing left: nothing said
    finally:
        keep.kill()
        keep.wait()


# the command line's own path: a command that leaves a hung child and ends on Ctrl-C
CLI_WITH_HUNG_CHILD = r"""
import subprocess, sys, time
from eagle_compat import cli
def command(argv):
    child = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"])
    print(child.pid, flush=True)
    time.sleep(1.0)
    raise KeyboardInterrupt("interrupted")
cli._main = command
sys.argv = ["eagle-compat", "extract"]
sys.exit(cli.main())
"""


def test_the_command_line_ends_what_it_left_running_and_says_so():
    out = subprocess.run([sys.executable, "-c", CLI_WITH_HUNG_CHILD], capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.split()[0])
    assert "ended 1 process(es) this command started and left running" in out.stderr
    assert not os.path.exists(f"/proc/{pid}") or not leftovers._alive(pid)
    assert out.returncode != 0


def test_called_from_python_nothing_of_the_callers_is_touched(monkeypatch):
    from eagle_compat import cli
    calls = []
    monkeypatch.setattr(leftovers, "end_new_descendants", lambda before, **kw: calls.append(before) or [])
    monkeypatch.setattr(cli, "_main", lambda argv: 0)
    assert cli.main(["doctor"]) == 0 and calls == []
    monkeypatch.setattr(sys, "argv", ["eagle-compat", "doctor"])
    assert cli.main() == 0 and len(calls) == 1
