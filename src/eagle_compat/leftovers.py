"""The processes a command started, ended when it ends, whatever the path out.

vLLM's workers are processes of their own. A worker that hangs (stopped, or stuck in a collective) outlives the
command that started it when that command ends on Ctrl-C or an error: it keeps its GPU memory, and the next run on the
machine fails to start. multiprocessing's resource tracker stays with it (the hung worker holds its pipe). The command
line records which processes it had before it ran (`started_before`), and on its way out ends every descendant that
appeared since (`end_new_descendants`): SIGCONT and SIGTERM, then SIGKILL after a short grace. Read from /proc
(Linux; elsewhere nothing is done).
"""
from __future__ import annotations

import os
import signal
import time

RESOURCE_TRACKER = "multiprocessing.resource_tracker"


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: the fields after its last ')' are fixed
    return int(stat[stat.rindex(")") + 2:].split()[1])


def descendants(root: int | None = None) -> set[int]:
    """Every live process below `root` (default: this one)."""
    root = os.getpid() if root is None else root
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return set()
    children: dict[int, list[int]] = {}
    for pid in pids:
        parent = _parent_of(pid)
        if parent is not None:
            children.setdefault(parent, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has ended; its parent (us) reaps it


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while True:
        for pid in pids:  # reap our own children so they do not linger as zombies
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        left = [p for p in pids if _alive(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def end_new_descendants(before: set[int], grace_s: float = 3.0) -> list[str]:
    """End every descendant not in `before`; returns "pid (command)" of each one that had to be ended. The resource
    tracker alone is no leftover (it ends with this process): it is ended only after others were, if still there."""
    new = sorted(descendants() - before)
    trackers = [p for p in new if RESOURCE_TRACKER in _cmdline(p)]
    others = [p for p in new if p not in trackers and _alive(p)]
    if not others:
        return []
    said = [f"{p} ({_cmdline(p)[:80] or '?'})" for p in others]
    _signal(others, signal.SIGCONT)  # a stopped process keeps a SIGTERM pending until continued
    _signal(others, signal.SIGTERM)
    left = _wait_gone(others, grace_s)
    _signal(left, signal.SIGKILL)
    _wait_gone(left, grace_s)
    # the tracker exits by itself once no ended process holds its pipe; it cleans leaked shared memory as it goes
    _signal(_wait_gone(trackers, grace_s), signal.SIGKILL)
    return said
