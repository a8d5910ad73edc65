"""The processes a run started, ended when it ends, whatever the path out.

vLLM's workers are processes of their own. A worker that hangs (stopped, or stuck in a collective) outlives the
command that started it when that command ends on Ctrl-C, SIGTERM or an error: it keeps its GPU memory, and the next
run on the machine fails to start. A stopped process keeps a SIGTERM pending until it is continued, and once its
parent has gone it is a child of init, where no walk down from the command finds it.

Each owner keeps a `ProcessTree`, ended by `end()` and, where that is never reached, at exit or by
`end_every_tree()` on the paths that end the process at once (a second Ctrl-C, SIGTERM, SIGHUP):
* the command line (`CommandProcesses`) makes itself the subreaper of what it starts (PR_SET_CHILD_SUBREAPER): an
  orphan below it is reparented to it, not to init, so every process of its tree stays below it, and it ends every
  process below it that was not there when it began;
* a generator (`EngineProcesses`), which may live in a user's process, ends only its engine's processes: the workers
  it records and everything below them, walked again before vLLM's shutdown (a worker that shutdown kills leaves
  its children to init). The user's own children are never below a worker.
A process is known by its pid and start time and is signalled through a pidfd opened before that pair is checked
again: a pid given to another process since is never signalled. Read from /proc (Linux; elsewhere nothing is done).
"""
from __future__ import annotations

import atexit
import os
import signal
import threading
import time
from typing import Callable, Iterable

RESOURCE_TRACKER = "multiprocessing.resource_tracker"
GRACE_S = 3.0  # from SIGTERM to SIGKILL
PF_EXITING = 0x4  # /proc/PID/stat's flags: the process is exiting

Key = tuple[int, int]  # (pid, start time in clock ticks after boot): a pid given out again has another start time
Stat = tuple[int, str, int]  # (parent pid, state, start time)


def _stat(pid: int) -> Stat | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: the fields after its last ')' are fixed
    fields = stat[stat.rindex(")") + 2:].split()
    # a process whose exit is under way (PF_EXITING: killed by vLLM's shutdown a moment ago) counts as dead ("X")
    state = "X" if int(fields[6]) & PF_EXITING else fields[0]
    return int(fields[1]), state, int(fields[19])


def _parent(pid: int) -> int | None:
    stat = _stat(pid)
    return None if stat is None else stat[0]


def _table() -> dict[int, Stat]:
    """Every process there is now, by pid."""
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    table = {}
    for pid in pids:
        stat = _stat(pid)
        if stat is not None:
            table[pid] = stat
    return table


def _below(roots: Iterable[int], table: dict[int, Stat]) -> set[int]:
    """The pids below `roots` in `table`, the roots not included."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    out, todo = set(), list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _keys(pids: Iterable[int], table: dict[int, Stat]) -> set[Key]:
    return {(pid, table[pid][2]) for pid in pids if pid in table}


def descendants(root: int | None = None) -> set[int]:
    """Every process below `root` (default: this one)."""
    return _below([os.getpid() if root is None else root], _table())


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def running(key: Key) -> bool:
    """Whether the process `key` names still runs (a zombie has ended: its parent reaps it)."""
    stat = _stat(key[0])
    return stat is not None and stat[2] == key[1] and stat[1] not in ("Z", "X")


def send(key: Key, sig: int) -> None:
    """Signal the process `key` names, never another one given its pid since."""
    pid, start = key
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd (Linux before 5.3): the start time read just before the signal
        handle = None
    try:
        stat = _stat(pid)
        if stat is None or stat[2] != start:  # read after the pidfd was opened: that pidfd is this process's
            return
        if handle is None:
            os.kill(pid, sig)
        else:
            signal.pidfd_send_signal(handle, sig)
    except (ProcessLookupError, PermissionError):
        pass
    finally:
        if handle is not None:
            os.close(handle)


def _wait_gone(keys: list[Key], seconds: float) -> list[Key]:
    deadline = time.monotonic() + seconds
    while True:
        left = [k for k in keys if running(k)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def end_processes(keys: Iterable[Key], grace_s: float = GRACE_S) -> list[str]:
    """End these processes: SIGCONT and SIGTERM, SIGKILL for those still there after `grace_s`. Returns
    "pid (command)" of each one that was running, multiprocessing's resource tracker aside: it ignores SIGTERM and
    exits by itself once the last process holding its pipe has gone, cleaning up the shared memory they leaked. It
    is continued (a stopped one reads nothing), and killed only if it outlives them; this process's own tracker
    goes when this process does (it holds that pipe)."""
    keys = set(keys)
    trackers = [k for k in keys if RESOURCE_TRACKER in _cmdline(k[0])]
    others = sorted(k for k in keys - set(trackers) if running(k))
    said = [f"{pid} ({_cmdline(pid)[:80] or '?'})" for pid, _ in others]
    for sig in (signal.SIGCONT, signal.SIGTERM):  # a stopped process keeps a SIGTERM pending until continued
        for key in others:
            send(key, sig)
    for key in _wait_gone(others, grace_s):
        send(key, signal.SIGKILL)
    _wait_gone(others, grace_s)
    for key in trackers:
        send(key, signal.SIGCONT)
    not_ours = [k for k in trackers if _parent(k[0]) != os.getpid()]
    for key in _wait_gone(not_ours, grace_s):
        send(key, signal.SIGKILL)
    return said


# ---------------------------------------------------------------------------------------------------------------
# Owners, and the ways out that skip them

_trees: dict[int, "ProcessTree"] = {}
_trees_lock = threading.RLock()  # reentrant: a signal handler may run in a thread that holds it
_at_exit_registered = False


class ProcessTree:
    """The processes one owner started, ended by `end()`, at the latest at this process's exit."""

    def __init__(self) -> None:
        global _at_exit_registered
        self.owner = os.getpid()  # a forked copy of this object ends nothing: the tree is its parent's
        with _trees_lock:
            _trees[id(self)] = self
            if not _at_exit_registered:
                atexit.register(end_every_tree)
                _at_exit_registered = True

    def members(self, table: dict[int, Stat]) -> set[Key]:
        raise NotImplementedError

    def released(self) -> None:
        """Called once, when the tree is ended."""

    def end(self, grace_s: float = GRACE_S) -> list[str]:
        """End every process of the tree still running; returns "pid (command)" of each one (see end_processes)."""
        return _end([self], grace_s)


def _end(trees: list[ProcessTree], grace_s: float) -> list[str]:
    with _trees_lock:
        mine = [t for t in trees if _trees.pop(id(t), None) is not None and t.owner == os.getpid()]
    table = _table()
    members = set().union(*(t.members(table) for t in mine))
    try:
        return end_processes(members, grace_s)
    finally:
        for tree in mine:
            tree.released()


def end_every_tree(grace_s: float = GRACE_S) -> list[str]:
    """End what every owner in this process started and has not ended: at exit, and before the process ends at once
    (os._exit, a deadly signal) without reaching their own ends."""
    with _trees_lock:
        trees = list(_trees.values())
    return _end(trees, grace_s)


class EngineProcesses(ProcessTree):
    """One engine's processes: the workers `record()` was given, and everything below them."""

    def __init__(self) -> None:
        super().__init__()
        self.known: set[Key] = set()

    def record(self, worker_pids: Iterable[int] = ()) -> None:
        """Remember these workers, and what runs below every worker remembered so far (a worker killed later leaves
        its children to init, out of a walk from it)."""
        table = _table()
        self.known |= _keys((p for p in worker_pids if p and p != os.getpid()), table)
        self.known |= _keys(_below(self._alive(table), table), table)

    def _alive(self, table: dict[int, Stat]) -> set[int]:
        return {pid for pid, start in self.known if pid in table and table[pid][2] == start}

    def members(self, table: dict[int, Stat]) -> set[Key]:
        alive = self._alive(table)
        return _keys(alive | _below(alive, table), table)


PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37


def _subreaper(on: bool) -> bool | None:
    """Make this process the subreaper of its descendants (or stop); returns what it was, None where it cannot."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        was, zero = ctypes.c_int(0), ctypes.c_ulong(0)  # prctl takes unsigned longs: no int of undefined upper bits
        if libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(was), zero, zero, zero) != 0:
            return None
        if libc.prctl(PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(int(on)), zero, zero, zero) != 0:
            return None
        return bool(was.value)
    except (OSError, AttributeError):  # no prctl (not Linux)
        return None


class CommandProcesses(ProcessTree):
    """Everything a command line starts: every process below it that was not there when it began. Being their
    subreaper keeps below it the orphans that would go to init (a hung worker's child, Ray's daemons)."""

    def __init__(self) -> None:
        super().__init__()
        self._was_subreaper = _subreaper(True)
        table = _table()
        self.before = _keys(_below([os.getpid()], table), table)

    def members(self, table: dict[int, Stat]) -> set[Key]:
        return _keys(_below([os.getpid()], table), table) - self.before

    def released(self) -> None:
        if self._was_subreaper is False:  # a caller's own setting stays (pytest calling main(), say)
            _subreaper(False)


def ended_line(said: list[str]) -> str:
    return f"eagle-compat: ended {len(said)} process(es) this command started and left running: " + "; ".join(said)


def end_on_deadly_signals() -> Callable[[], None]:
    """The command line, on SIGTERM or SIGHUP: end every tree at once, then die of the signal as before. No clean
    stop: it could wait on a hung worker, and whoever sent SIGTERM may send SIGKILL next. A signal the caller ignores
    (nohup) stays ignored. Returns what puts the handlers back."""
    owner = os.getpid()

    def on_signal(signum: int, frame: object) -> None:
        if os.getpid() == owner:  # not in a forked child that still has this handler
            said = end_every_tree()
            if said:
                os.write(2, (ended_line(said) + "\n").encode())
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():  # the only thread that may set handlers
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) == signal.SIG_DFL:
                previous[sig] = signal.signal(sig, on_signal)

    def put_back() -> None:
        for sig, handler in previous.items():
            if signal.getsignal(sig) is on_signal:
                signal.signal(sig, handler)
    return put_back
