"""The index of written files (`.eagle-compat-index.jsonl`): what each sample file was written for (its tokens' digest,
the states' stamp, the file's identity), so a resume vouches for a file without opening it."""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from typing import Any

from .atomic_io import CONTENT_DIGEST_CHARS, open_no_follow


# Append-only record of the sample files written, a JSON line each: its sample, size, modification time, inode and
# change time, a digest of the tokens and mask it was written for, the states' stamp, and a digest of the bytes
# written. A --resume (and the completion of a set) trusts a file whose line still matches it instead of opening it
# (1.5-3 ms a file: most of a million-file restart). The inode and change time are what os.utime cannot put back: a
# file edited in place, its size and modification time restored, no longer matches; it is opened, and its bytes are
# compared with the digest (as every kept file's are under --verify-kept). A line cut short by a killed writer is
# skipped, and a line of an earlier release (no inode, change time or digest) vouches for nothing: their files are
# opened and checked as before.
INDEX_FILE = ".eagle-compat-index.jsonl"


def tokens_digest(ids: Any, mask: Any) -> str:
    h = hashlib.blake2b(digest_size=12)
    h.update(_int64_bytes(ids))
    if mask is not None:
        h.update(b"|" + _bit_bytes(mask))
    return h.hexdigest()


def _int64_bytes(ids: Any) -> bytes:
    """The ids as int64 bytes; a list of ints is converted in C (a resume digests every kept sample: a per-token
    Python loop was most of the check's time)."""
    from array import array
    if type(ids) in (list, array):  # extract's samples hold array("i")
        try:
            return array("q", ids).tobytes()
        except TypeError:  # not all ints: converted one by one, as before
            pass
    return array("q", [int(t) for t in ids]).tobytes()


def _bit_bytes(mask: Any) -> bytes:
    """One byte per mask value, its lowest bit; a list of 0/1 ints is converted in C (the same bytes)."""
    from array import array
    if type(mask) is list or (type(mask) is array and mask.typecode in "bB"):  # one byte a value
        try:
            fast = bytes(mask)
            if not fast.translate(None, b"\x00\x01"):  # only 0 and 1: equal to each value's lowest bit
                return fast
        except (TypeError, ValueError):
            pass
    return bytes(int(m) & 1 for m in mask)


def index_written(out_dir: str, index: int, path: str, ids: Any, mask: Any, stamp: str | None,
                  content: str | None = None) -> None:
    """One line for a file just written (whole: renamed into place; its change time is the rename's), `content` the
    digest of its bytes. One write of an O_APPEND descriptor: lines of concurrent writers (threads, Ray actors,
    shards) do not interleave on a local file system."""
    st = os.stat(path)
    entry = {"i": index, "f": os.path.relpath(path, out_dir), "n": st.st_size, "m": st.st_mtime_ns,
             "ino": st.st_ino, "c": st.st_ctime_ns, "d": tokens_digest(ids, mask), "s": stamp}
    if content:
        entry["h"] = content
    line = json.dumps(entry, separators=(",", ":")) + "\n"
    fd = open_no_follow(os.path.join(out_dir, INDEX_FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def index_entries(out_dir: str) -> Iterator[dict]:
    """The index's lines in the order they were written (a sample's later line is a later write of it: a batch
    redone); a line cut short is left out (its file is read instead)."""
    try:
        fd = open_no_follow(os.path.join(out_dir, INDEX_FILE), os.O_RDONLY)
    except FileNotFoundError:
        return
    f = open(fd, encoding="utf-8", errors="replace")
    with f:
        if os.fstat(fd).st_uid != os.geteuid():  # another user's lines vouch for nothing: every file is opened
            return
        for line in f:
            try:
                entry = json.loads(line)
                entry["i"] = int(entry["i"])
            except (ValueError, KeyError, TypeError):
                continue
            yield entry


def drop_index_of_another_user(out_dir: str) -> None:
    """Removes the index where another user owns it (it vouches for nothing: `index_entries`), so that this run's
    lines start one of this user's; only the lock holder calls this."""
    path = os.path.join(out_dir, INDEX_FILE)
    try:
        if os.lstat(path).st_uid != os.geteuid():
            os.unlink(path)
    except OSError:  # none, or one this user may not remove (a sticky folder): its lines are not read either way
        pass


def read_index(out_dir: str) -> dict[int, dict]:
    """The index's lines by sample index (the last line of a sample wins: a batch redone wrote it again)."""
    return {entry["i"]: entry for entry in index_entries(out_dir)}


def trusted_by_index(entries: dict[int, dict], out_dir: str, index: int, path: str, ids: Any, mask: Any,
                     stamp: str | None) -> bool:
    """Whether the index vouches for `path` as sample `index` with these tokens and mask and states of `stamp`: the
    same file (name, size, modification time to the nanosecond) that was written for them."""
    entry = entries.get(index)
    return entry is not None and entry_vouches(entry, out_dir, path, ids, mask, stamp)


def entry_vouches(entry: dict, out_dir: str, path: str, ids: Any, mask: Any, stamp: str | None) -> bool:
    """Whether one index line vouches for `path` (see trusted_by_index)."""
    return entry_matches_file(entry, out_dir, path, stamp) and entry.get("d") == tokens_digest(ids, mask)


def entry_matches_file(entry: dict, out_dir: str, path: str, stamp: str | None) -> bool:
    """Whether one index line is `path`'s as it is now (name, size, modification time, inode, change time) with
    states of `stamp`: the part of `entry_vouches` that needs no tokens. A line without inode or change time (an
    earlier release's) matches no file."""
    if not entry_names_file(entry, out_dir, path, stamp):
        return False
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (st.st_size == entry.get("n") and st.st_mtime_ns == entry.get("m") and st.st_uid == os.geteuid()
            and st.st_ino == entry.get("ino") and st.st_ctime_ns == entry.get("c"))


def entry_names_file(entry: dict, out_dir: str, path: str, stamp: str | None) -> bool:
    """Whether one index line is of a write of `path`, with states of `stamp` (the file may have changed since)."""
    return stamp is not None and entry.get("s") == stamp and entry.get("f") == os.path.relpath(path, out_dir)


class IndexVerdicts:
    """What the directory's index says of each row's file: `vouched[row]` (one byte a row) where the file is the one
    a run of the directory wrote for these tokens, unchanged since (not opened), and, for a file to open, the digest
    of the bytes that run wrote there (16 bytes a row, held only once a line gives one; zeros: none to compare)."""
    DIGEST_BYTES = CONTENT_DIGEST_CHARS // 2

    def __init__(self, rows: int):
        self.rows, self.vouched, self._digests = rows, bytearray(rows), None

    def forget(self, row: int) -> None:
        """A later line of the sample: what the earlier ones said no longer holds (a batch redone)."""
        self.vouched[row] = 0
        if self._digests is not None:
            self._digests[row * self.DIGEST_BYTES:(row + 1) * self.DIGEST_BYTES] = bytes(self.DIGEST_BYTES)

    def note(self, row: int, vouched: bool, content: Any) -> None:
        self.vouched[row] = vouched
        if vouched or not isinstance(content, str) or len(content) != CONTENT_DIGEST_CHARS:
            return
        try:
            raw = bytes.fromhex(content)
        except ValueError:  # not ours: nothing to compare
            return
        if self._digests is None:
            self._digests = bytearray(self.rows * self.DIGEST_BYTES)
        self._digests[row * self.DIGEST_BYTES:(row + 1) * self.DIGEST_BYTES] = raw

    def content_of(self, row: int) -> str | None:
        """The digest of the bytes written to the row's file, where a line of this directory's index gives one."""
        if self._digests is None:
            return None
        raw = self._digests[row * self.DIGEST_BYTES:(row + 1) * self.DIGEST_BYTES]
        return raw.hex() if any(raw) else None
