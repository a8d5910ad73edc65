"""One writer per output directory: the folder's lock (flock, with what it cannot do on shared file systems said), the
writers' lock a resume waits on, and refusals of another user's folder."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from datetime import datetime, timezone
from typing import Any

from .. import settings
from ..errors import OutputDirectoryBusy, OutputDirectoryConflict
from .atomic_io import OutputWriteError, open_no_follow


LOCK_FILE = ".eagle-compat.lock"


# Held shared (flock) by every process other than the driver that writes into the directory (`--ray` actors) for its
# life; a driver waits to take it exclusively before it sweeps temporary files or redoes batches, so a `--resume`
# right after a killed driver cannot overlap the dead driver's orphaned actors still writing.
WRITERS_LOCK = ".eagle-compat-writers.lock"


WRITERS_WAIT_ENV = "EAGLE_COMPAT_WRITERS_WAIT_S"


def hold_as_writer(out_dir: str) -> int:
    """A descriptor holding the directory's writers lock shared (kept for the writer's life; the kernel releases it
    when the process dies)."""
    path = os.path.join(out_dir, WRITERS_LOCK)
    fd = open_no_follow(path, os.O_RDWR | os.O_CREAT)
    flock_or_explain(fd, fcntl.LOCK_SH, path)
    return fd


def wait_for_other_writers(out_dir: str, timeout: float | None = None, on_wait: Any = None) -> float:
    """Block until no other process holds the directory's writers lock (orphaned writers of a dead run end: Ray ends
    a dead driver's actors within seconds); returns the seconds waited. Past `timeout` (default 120 s,
    EAGLE_COMPAT_WRITERS_WAIT_S) raises OutputDirectoryBusy. `on_wait(seconds)` is called on every retry."""
    import time
    timeout = settings.value(WRITERS_WAIT_ENV) if timeout is None else timeout
    path = os.path.join(out_dir, WRITERS_LOCK)
    if not os.path.exists(path):
        return 0.0
    try:  # for writing: on NFS flock is emulated with POSIX locks, whose exclusive lock needs it
        fd = open_no_follow(path, os.O_RDWR)
    except PermissionError:
        fd = open_no_follow(path, os.O_RDONLY)
    start = time.monotonic()
    try:
        while True:
            try:
                flock_or_explain(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, path)
                return time.monotonic() - start
            except OSError as exc:
                if isinstance(exc, OutputWriteError) or exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN,
                                                                          errno.EACCES):
                    raise OutputWriteError(f"cannot lock {path} to check for writers of an earlier run: "
                                           f"{exc.strerror or exc}") from exc
                waited = time.monotonic() - start
                if waited > timeout:
                    raise OutputDirectoryBusy(
                        f"{out_dir} is still being written by processes of an earlier run (they hold {WRITERS_LOCK}: "
                        f"e.g. Ray actors of a driver that was killed) after {timeout:.0f} s; end them (ray stop, or "
                        f"kill the holders: fuser {path}) and rerun, or wait longer ({WRITERS_WAIT_ENV})") from None
                if on_wait is not None:
                    on_wait(waited)
                time.sleep(0.5)
    finally:
        os.close(fd)  # the lock (if taken) goes with it: this run's own writers take it shared next


def try_flock(path: str, mode: int = 0o644, read_only_ok: bool = False) -> int | None:
    """A descriptor holding an exclusive flock on `path` (created if missing), or None while another process holds
    it. The kernel releases the lock when its holder dies. `read_only_ok`: a file another user made is locked through
    a read-only descriptor (flock allows it)."""
    try:
        fd = open_no_follow(path, os.O_RDWR | os.O_CREAT, mode)
    except PermissionError:
        if not read_only_ok:
            raise
        fd = open_no_follow(path, os.O_RDONLY)
    try:
        flock_or_explain(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, path)
    except OSError as exc:
        os.close(fd)
        if isinstance(exc, OutputWriteError) or exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        return None
    return fd


# errno values a filesystem without flock answers with (Lustre mounted without -o flock: ENOSYS; NFS without a lock
# manager: ENOLCK)
NO_FLOCK = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


def mount_of(path: str) -> tuple[str, str, str]:
    """(mount point, filesystem type, options) of the mount holding `path`, from /proc/mounts ("?" where unknown):
    the longest mount point that contains it."""
    best, best_point = ("?", "?", "?"), ""
    try:
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 4:
                    continue
                point = parts[1].replace("\\040", " ")
                inside = point == "/" or real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best_point):
                    best, best_point = (point, parts[2], parts[3]), point
    except OSError:
        pass
    return best


def flock_or_explain(fd: int, operation: int, path: str) -> None:
    """fcntl.flock, with a filesystem that has no flock named (mount, type) and the way out, instead of a raw
    OSError: every guarantee about one writer per folder rests on it."""
    try:
        fcntl.flock(fd, operation)
    except OSError as exc:
        if exc.errno not in NO_FLOCK:
            raise
        point, fstype, options = mount_of(path)
        raise OutputWriteError(
            f"cannot lock {path}: the filesystem has no flock ({fstype} mounted at {point}, options {options}; "
            f"{exc.strerror or exc}). eagle_compat's one-writer-per-folder guarantee needs it: mount with flock "
            "support (Lustre: -o flock), or write --out to a filesystem that has it (a local disk) and copy the "
            "finished folder") from None


# filesystems whose flock, as mounted, holds on one machine only: two machines can each take it
LOCAL_ONLY_LOCKS = {"beegfs": "BeeGFS takes flock per client unless tuneUseGlobalFileLocks is set",
                    "lustre:localflock": "Lustre mounted with localflock takes flock per client"}


def lock_scope_note(path: str) -> str | None:
    """Where locks on `path` hold on this machine only, what that means for --shard across machines (else None)."""
    _, fstype, options = mount_of(path)
    why = LOCAL_ONLY_LOCKS.get(fstype) or (
        LOCAL_ONLY_LOCKS["lustre:localflock"] if fstype == "lustre" and "localflock" in options.split(",") else None)
    if why is None:
        return None
    return (f"{path} is on {fstype} ({why}): the one-writer lock does not hold across machines, so run each --shard "
            "of one folder on one machine, or give each machine its own --out and merge them (README)")


def user_named(uid: int) -> str:
    """'user NAME (uid N)', or 'uid N' where the system knows no name for it."""
    try:
        import pwd
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def refuse_others_folder(path: str, what: str = "--out") -> None:
    """A folder this run writes must be the user's own: not another user's (who could plant links or files there),
    not writable by every user unless sticky (where anyone could replace its files). A folder its group may write
    (a team's project folder, or umask 002) is taken, and so is one under a folder others may write (which could
    swap it for theirs): in it a run trusts only this user's files (the record, the index, the tokenized input, each
    sample file it keeps; `user_named` names the owner of any other), so another user can remove files but never
    have theirs taken for this run's."""
    import stat
    st = os.stat(path)
    me = os.geteuid()
    if st.st_uid != me:
        try:
            import pwd
            owner = pwd.getpwuid(st.st_uid).pw_name
        except (KeyError, ImportError):
            owner = str(st.st_uid)
        raise OutputDirectoryConflict(
            f"{what} {path!r} belongs to another user ({owner}, uid {st.st_uid}; you are uid {me}): they could "
            "plant links or files there that this run would write through or train on. Choose a folder of your own")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise OutputDirectoryConflict(
            f"{what} {path!r} is writable by every user (mode {stat.S_IMODE(st.st_mode):o}) without the sticky bit: "
            f"anyone could replace its files. chmod o-w {path}, or choose another folder")


# The lock is held twice. On --out itself (flock on a descriptor of the folder): a clean-up of files (`rm *.lock`)
# cannot remove a folder that holds files, so a second run is refused for as long as the first lives. And on
# `.eagle-compat.lock`, which earlier releases lock (a run of either kind refuses the other) and which holds across
# the machines of a network file system (NFS locks a folder per machine only). That file's lock counts only while the
# file is at its path: a run whose lock file was removed or replaced stops at its next batch (`check_lock_held`),
# since a run on another machine, or of an earlier release, may have made and locked a new one.
LOCK_ATTEMPTS = 5


class LockFileRemoved(OutputDirectoryBusy):
    """The run's `.eagle-compat.lock` was removed or replaced while the run held it."""
    run_failed = True


def is_file_at(fd: int, path: str) -> bool:
    """Whether the open file `fd` is the one at `path` (a link at `path` is not followed: it is another file)."""
    try:
        at_path = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (at_path.st_dev, at_path.st_ino)


_HELD_LOCKS: dict[str, "DirectoryLock"] = {}  # this process's locks, by the folder's real path


def check_lock_held(out_dir: str) -> None:
    """Raises LockFileRemoved where this process holds `out_dir`'s lock and its lock file is no longer at its path;
    the runners call it before each batch's files are written."""
    lock = _HELD_LOCKS.get(os.path.realpath(out_dir))
    if lock is not None:
        lock.check_held()


class DirectoryLock:
    """One writer per output directory: flock on the folder and on `.eagle-compat.lock`, released by the kernel if
    the run dies."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, LOCK_FILE)
        self.fd: int | None = None
        self.folder_fd: int | None = None

    def busy(self) -> OutputDirectoryBusy:
        return OutputDirectoryBusy(f"{os.path.dirname(self.path) or '.'} is being written by another run "
                                   f"({self.holder()}); two runs writing one directory could mix their files. "
                                   "Wait for it to finish, or choose another --out")

    def __enter__(self) -> "DirectoryLock":
        self.folder_fd = self._lock_folder()
        try:
            fd = self._lock_file_at_path()
        except BaseException:
            self._release()
            raise
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": datetime.now(timezone.utc).isoformat()}).encode())
        self.fd = fd
        _HELD_LOCKS[os.path.realpath(self.out_dir)] = self
        return self

    def _lock_folder(self) -> int | None:
        """A descriptor of the folder holding its flock; None on a file system that locks no folder (the lock
        file's lock and `check_held` remain)."""
        fd = os.open(self.out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise self.busy() from None
            if exc.errno in (*NO_FLOCK, errno.EBADF):
                return None
            raise
        return fd

    def _lock_file_at_path(self) -> int:
        """The lock file's descriptor, locked, and the file at its path: one removed or replaced between its open and
        its flock is let go and the one at the path taken instead."""
        for _ in range(LOCK_ATTEMPTS):
            fd = try_flock(self.path)
            if fd is None:
                raise self.busy() from None
            if is_file_at(fd, self.path):
                return fd
            os.close(fd)
        raise OutputDirectoryBusy(f"{self.path} was removed or replaced each of the {LOCK_ATTEMPTS} times this run "
                                  "locked it: another process keeps removing it. Stop that process (a clean-up of "
                                  "*.lock files?) and run again, or choose another --out")

    def check_held(self) -> None:
        if self.fd is None or is_file_at(self.fd, self.path):
            return
        raise LockFileRemoved(
            f"{self.path} was removed or replaced while this run held it (a clean-up of *.lock files?): a run on "
            "another machine, or of an earlier release, may now write this directory too. This run stopped before "
            "writing more; its files so far are complete. When no other run writes it, rerun the same command "
            "with --resume")

    def holder(self) -> str:
        try:
            with open(self.path) as f:
                info = json.load(f)
            return f"pid {info['pid']} on {info['host']}, since {info['since']}"
        except FileNotFoundError:
            return (f"holder unknown: its {LOCK_FILE} was removed; `fuser -v {os.path.dirname(self.path) or '.'}` "
                    "lists the processes that have the folder open")
        except (OSError, ValueError, KeyError):
            return "holder unknown"

    def _release(self) -> None:
        for fd in (self.fd, self.folder_fd):
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
        self.fd = self.folder_fd = None

    def __exit__(self, *exc: Any) -> None:
        if _HELD_LOCKS.get(os.path.realpath(self.out_dir)) is self:
            del _HELD_LOCKS[os.path.realpath(self.out_dir)]
        self._release()
