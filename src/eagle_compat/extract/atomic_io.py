"""Writing files whole or not at all: atomic replace, fsync of files and of the renames, no symlink followed, and the
content digest a file is written with."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
from typing import Any

from ..errors import EagleCompatError, OutputDirectoryConflict


class OutputWriteError(EagleCompatError, OSError):
    """Writing to --out failed (disk full, permissions, I/O error); what was written before is complete."""


def atomic_write_bytes(path: str, data: bytes) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
    atomic_write_file(path, write)


def fsync_file(path: str) -> None:
    """The file's data on disk, not only in the page cache (a machine crash keeps it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_renames(out_dir: str) -> None:
    """The renames in `out_dir` (and its hidden_states/) on disk: called once after the last sample file and once
    after data_config.json or the Arrow dataset, before status "complete", so that after a machine crash no record
    says complete for a directory whose last renames were lost. Per set, not per file (speed)."""
    for folder in (out_dir, os.path.join(out_dir, "hidden_states")):
        if not os.path.isdir(folder):
            continue
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError as exc:  # a file system that cannot sync a directory (some network ones): nothing to do;
            if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):  # any other error is a real loss
                raise
        finally:
            os.close(fd)


def atomic_write_file(path: str, write: Any) -> None:
    """`write(tmp_path)` makes the file under a temporary name; then fsync and rename: a reader sees the whole file
    or none. Nothing is left behind on failure (disk full, Ctrl-C), not even under the temporary name."""
    # no dot from the host name: torch.save names its archive after the file name up to the last dot, and a file
    # must be the same bytes whichever host wrote it
    tmp = f"{path}.tmp-{socket.gethostname().replace('.', '-')}-{os.getpid()}-{os.urandom(4).hex()}"
    # made new here, never through a link another user planted under that name; `write` then reopens our own file
    os.close(open_no_follow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    try:
        try:
            write(tmp)
        except RuntimeError as exc:  # torch.save's C++ stream reports a failed write as a RuntimeError
            raise _write_error(exc, tmp) from exc
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:  # disk full, Ctrl-C: leave no partial file behind, not even under the temporary name
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _write_error(exc: RuntimeError, tmp: str) -> BaseException:
    """The OSError behind a failed torch.save ("basic_ios::clear: iostream error", "PytorchStreamWriter failed
    writing file"): ENOSPC when the file system is full, EIO otherwise; any other RuntimeError as it was."""
    import errno
    text = f"{exc} {exc.__context__ or ''}"
    try:
        st = os.statvfs(os.path.dirname(tmp) or ".")
        full = st.f_bavail * st.f_frsize < (1 << 20)
    except OSError:
        full = False
    if not full and not any(m in text for m in ("iostream error", "failed writing", "unexpected pos")):
        return exc
    code = errno.ENOSPC if full else errno.EIO
    return OSError(code, os.strerror(code) if full else f"{os.strerror(code)} ({text.strip()[:200]})")


def atomic_write_json(path: str, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n").encode())


# The index records a digest of each sample file's bytes as written (written_index.INDEX_FILE): a file whose inode
# or change time moved since is opened and its bytes hashed again, so an edit in place is told even where its size
# and modification time were put back. sha256 (hashlib's fastest here, about 1 GB/s a core, the GIL let go), 128 bits
# kept: no one who may write in the folder can make other bytes of the same digest.
CONTENT_DIGEST_CHARS = 32


def content_digest(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()[:CONTENT_DIGEST_CHARS]


def file_content_digest(path: str) -> str:
    """`content_digest` of a file's bytes, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:CONTENT_DIGEST_CHARS]


class DigestingFile:
    """A file torch.save writes to, each block hashed on its way (the bytes are never read back)."""

    def __init__(self, f: Any):
        self.f, self.hash = f, hashlib.sha256()

    def write(self, data: Any) -> int:
        self.hash.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()

    def hexdigest(self) -> str:
        return self.hash.hexdigest()[:CONTENT_DIGEST_CHARS]


class WrittenFile(str):
    """The path of a sample file just written (a str: callers that want the path have it), with the digest of the
    bytes written there (`content`), which the index records."""
    content: str | None = None

    @classmethod
    def at(cls, path: str, content: str) -> "WrittenFile":
        written = cls(path)
        written.content = content
        return written


class SymlinkRefused(OutputDirectoryConflict):
    """A lock or temporary file of the run is a symbolic link (planted by another user on a shared host)."""


def open_no_follow(path: str, flags: int, mode: int = 0o644) -> int:
    """os.open that never follows a symbolic link at `path` itself: on a shared host another user who can create
    files there (a shared scratch folder) could point a lock or temporary file of this run at a file of yours."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP or exc.errno == errno.EEXIST and os.path.islink(path):
            raise SymlinkRefused(
                f"{path} is a symbolic link (to {os.readlink(path)!r}); refusing to follow it: on a shared host it "
                "can make this run write over another file. Remove the link, or choose a folder of your own") from None
        raise
