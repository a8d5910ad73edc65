"""The tokenized input, on disk: the driver holds each sample's place in a file, not its tokens, so its memory does not
grow with the input (`Builder` while the input is read, `Samples` to read it). Kept in --out (`.eagle-compat-input.bin`)
so that a `--resume` or another `--shard` of the same set reads it back in seconds instead of tokenizing the input
again (minutes for a million conversations).

It is used only where everything that made it is unchanged: the input's bytes (the SHA-256 of the bytes its samples
were read from, taken as they were read, not a digest taken before), the model folder's files other than weights
(tokenizer files, chat templates), the tokenizer as loaded, the transformers, tokenizers and jinja2 releases, the
reading code itself, and every option that changes how lines become samples (`key`). Anything else, a
file cut short or of another layout included, is read as "no spool": the input is then read and tokenized as if there
were none, and the spool written again. It holds exactly what `inputs.read_dataset` returned: the samples' ids, masks,
lines and cuts, the left-out lines, the input's notes, and the input's data report.

Layout, native byte order: MAGIC; per sample a record (index, line: int64; length, the cut's fields: int32) followed by
its ids (int32 x length) and mask (int8 x length); the records' offsets and the samples' input indices (int64 x n
each); the header (JSON: key, counts,
the payload's digest, left-out lines, notes, report); the header's length (int64); MAGIC again. Written front to back
as the input is read (the header last), into an unnamed temporary file beside --out that becomes the spool only when
the run claims --out."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import shutil
import struct
import sys
import tempfile
import threading
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import InvalidInput
from . import atomic_io, conversation, file_hashes, harmony, inputs, report, writer

SPOOL_FILE = writer.SPOOL_FILE
MAGIC = b"EGCSPL04"
_CUT_FIELDS = [f.name for f in dataclasses.fields(inputs.Cut)]
_RECORD = struct.Struct("=qqi" + "i" * len(_CUT_FIELDS))  # index, line, length, cut
_FOOTER = struct.Struct("=q8s")  # the header's length, MAGIC
_READ_CHUNK = 1 << 20
# files of a model folder that are weights; every other file (tokenizer files, chat templates, vocabularies, code)
# goes into the key
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt", ".pdparams")


def tokenizer_files_sha256(model: str) -> str:
    """One digest over every file of the model folder and its subfolders that is not weights: a changed chat
    template (`chat_template.jinja`, `additional_chat_templates/`), vocabulary or tokenizer code is another key."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(model):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # a deterministic walk; no .cache or .git
        for name in sorted(files):
            if not name.endswith(_WEIGHTS):
                path = os.path.join(root, name)
                h.update(os.path.relpath(path, model).encode() + b"\0" + file_hashes.file_sha256(path).encode() + b"\0")
    return h.hexdigest()


def reading_code_sha256() -> str:
    """The code that turns lines into samples (inputs.py, conversation.py), tallies their report (report.py, kept in
    the header) and lays the spool out (this file): a fix to any,
    in any release or checkout, is another key (eagle_compat's version number alone would not say so)."""
    h = hashlib.sha256()
    for module in (inputs, conversation, harmony, report, sys.modules[__name__]):
        with open(module.__file__, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def key(data_sha256: str, model: str, tokenizer: Any, reading: dict[str, Any]) -> dict[str, Any]:
    """What must be equal for a spool to stand for this run's read of the input: the input's bytes, the model
    folder's non-weight files, the tokenizer as loaded (its class and chat template), the releases and the code that
    tokenize, and `reading`, the options that change how lines become samples (max-len, vocabulary size,
    --skip-uncovered, --validate, --min-loss-tokens, --trust-remote-code)."""
    import jinja2
    import tokenizers
    import transformers
    template = getattr(tokenizer, "chat_template", None)
    return {"byteorder": sys.byteorder, "data_sha256": data_sha256,
            "tokenizer_files_sha256": tokenizer_files_sha256(model),
            "tokenizer_class": type(tokenizer).__name__ if tokenizer is not None else None,
            "chat_template_sha256": hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest(),
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "jinja2": jinja2.__version__, "reading_code_sha256": reading_code_sha256(), "reading": reading}


def chat_format_key(chat_format: str) -> dict[str, Any]:
    """What else a harmony (gpt-oss) rendering depends on: vLLM's and openai-harmony's releases and the pinned date
    (harmony.versions); nothing for a chat template, whose key is as it was."""
    return {"chat_format": chat_format, "harmony": harmony.versions()} if chat_format == "harmony" else {}


def _as(typecode: str, values: Any) -> array:
    return values if isinstance(values, array) and values.typecode == typecode else array(typecode, values)


class Samples(Sequence):
    """The samples of a spool, read from its file when asked for (each an `inputs.Sample` of its own arrays). In
    memory: each sample's offset and input index (16 bytes a sample), whatever the input's size."""

    def __init__(self, f: Any, offsets: array, indices: array, tokens: int):
        self._f, self._fd = f, f.fileno()
        self.offsets, self.indices, self.tokens = offsets, indices, tokens

    def __len__(self) -> int:
        return len(self.offsets)

    def _parse(self, head: bytes, body: bytes) -> inputs.Sample:
        index, line, length, *cut = _RECORD.unpack(head)
        ids, mask = array("i"), array("b")
        ids.frombytes(body[:4 * length])
        mask.frombytes(body[4 * length:5 * length])
        return inputs.Sample(index, ids, mask, line, inputs.Cut(*cut))

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(len(self)))]
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(k)
        head = os.pread(self._fd, _RECORD.size, self.offsets[k])
        length = _RECORD.unpack(head)[2]
        return self._parse(head, os.pread(self._fd, 5 * length, self.offsets[k] + _RECORD.size))

    def __iter__(self) -> Iterator[inputs.Sample]:
        """Front to back, a MiB at a time (positioned reads: threads may read other samples meanwhile)."""
        buf, at, pos = b"", 0, self.offsets[0] if len(self) else 0
        for _ in range(len(self)):
            if len(buf) - at < _RECORD.size:
                chunk = os.pread(self._fd, _READ_CHUNK, pos)
                buf, at = buf[at:] + chunk, 0
                pos += len(chunk)
            head = buf[at: at + _RECORD.size]
            if len(head) < _RECORD.size:
                raise EOFError("the spool ends inside a sample's record")
            need = _RECORD.size + 5 * _RECORD.unpack(head)[2]
            if len(buf) - at < need:
                chunk = os.pread(self._fd, max(_READ_CHUNK, need), pos)
                buf, at = buf[at:] + chunk, 0
                pos += len(chunk)
                if len(buf) < need:
                    raise EOFError(f"the spool ends inside a sample ({len(buf)} of {need} bytes)")
            yield self._parse(head, buf[at + _RECORD.size: at + need])
            at += need


class ReadingStopped(Exception):
    """Raised into a reading of the input that the run no longer needs (it stopped, or was refused)."""


class ReadingDied(RuntimeError):
    """The reading's thread is gone without having published its end (nothing else is left to wake its waiters)."""


class InputChanged(InvalidInput):
    """The input file was replaced, written to or removed between the start of its reading (its digest included)
    and its last byte: its samples may not be those of the bytes the run's record names."""


PUBLISH_EVERY = 64  # samples written before readers may see them (a flush each)
WAIT_S = 1.0  # a wait for the reading wakes this often to check that its thread still lives


class Builder:
    """The spool written as the input is read: `append` each sample (its tokens go to the file at once), then `done`.
    The file is unnamed (removed by the system when the run ends) until `keep` links it into --out.

    The reading may run on a thread of its own (`start`): `samples` then grows as it goes (every PUBLISH_EVERY
    samples, and at its end), and a reader waits for the samples it needs (`wait_samples`)."""

    def __init__(self, folder: str, tally: report.Tally | None = None):
        self.folder = folder
        try:  # unnamed, and linkable later (tempfile's O_TMPFILE adds O_EXCL: never linkable)
            self._f = os.fdopen(os.open(folder, os.O_TMPFILE | os.O_RDWR, 0o600), "w+b")
        except (AttributeError, OSError):  # no O_TMPFILE here (NFS, say): a named file, unlinked at once
            self._f = tempfile.TemporaryFile(dir=folder)
        self._tally = tally  # the data report, made as the samples go by
        self._out = io.BufferedWriter(io.FileIO(os.dup(self._f.fileno()), "w"), _READ_CHUNK)
        self._digest = hashlib.blake2b(digest_size=16)
        self._offsets, self._indices = array("q"), array("q")  # published: readers see these
        self._new_offsets, self._new_indices = array("q"), array("q")  # written, not yet flushed
        self._pos = self._tokens = 0
        self._put(MAGIC)
        self.header: dict | None = None
        self.samples = Samples(self._f, self._offsets, self._indices, 0)
        self._changed = threading.Condition()
        self.lines = 0  # input lines read so far
        self.finished = self.stopped = False
        self.error: BaseException | None = None
        self.result: inputs.Dataset | None = None
        self._thread: threading.Thread | None = None
        self._keep: tuple | None = None  # (out_dir, key): keep it there when read
        self._read_ended = False
        self.kept_at: str | None = None
        self.keep_error: OSError | None = None

    def _put(self, data: bytes, flush: bool = False, end: bool = False) -> None:
        try:
            self._out.write(data)
            if end:
                self._out.close()
            elif flush:
                self._out.flush()
        except OSError as exc:
            raise atomic_io.OutputWriteError(
                f"the tokenized input cannot be written in {self.folder} ({exc.strerror or exc}): a run keeps it on "
                f"--out's file system (5 bytes a token) instead of in memory; free space there") from None
        if self._pos and self._digest is not None:  # the payload: after the first MAGIC, before the header
            self._digest.update(data)
        self._pos += len(data)

    def append(self, s: inputs.Sample) -> None:
        if self.stopped:
            raise ReadingStopped()
        self._new_offsets.append(self._pos)
        self._new_indices.append(s.index)
        length = len(s.input_ids)
        self._put(_RECORD.pack(s.index, s.line, length, *(getattr(s.cut, f) for f in _CUT_FIELDS)))
        self._put(_as("i", s.input_ids).tobytes())
        self._put(_as("b", s.loss_mask).tobytes())
        self._tokens += length
        if self._tally is not None:
            self._tally.add(s)
        if len(self._new_offsets) >= PUBLISH_EVERY:
            self._publish()

    def _publish(self) -> None:
        """What was written becomes readable: flushed to the file, then its offsets join `samples`."""
        self._put(b"", flush=True)
        with self._changed:  # indices first: a reader counts samples by their offsets
            self._indices.extend(self._new_indices)
            self._offsets.extend(self._new_offsets)
            self.samples.tokens = self._tokens
            del self._new_offsets[:], self._new_indices[:]
            self._changed.notify_all()

    def __len__(self) -> int:
        return len(self._offsets) + len(self._new_offsets)

    def line_read(self) -> None:
        self.lines += 1

    def start(self, read: Any, *args: Any, on_line: Any = None, watched: tuple[str, tuple, str] | None = None,
              **kwargs: Any) -> None:
        """`read(*args, into=self, on_line=..., **kwargs)` (inputs.read_dataset) on a thread of its own; its result
        or its error is kept for `join`. `watched`: the input file, its `input_identity` from before it was read
        (its digest included) and that digest (the settings' data_sha256), judged once its last byte is read: another
        identity, or bytes read whose SHA-256 is not that digest, is the reading's error (InputChanged); a change
        after that cannot reach the samples, which are read from the spool."""
        def counted() -> None:
            if self.stopped:
                raise ReadingStopped()
            self.line_read()
            if on_line is not None:
                on_line()

        def reading() -> None:
            try:
                self.result = read(*args, into=self, on_line=counted, **kwargs)
                if watched is not None:
                    path, identity, sha256 = watched
                    check_unchanged(path, identity)
                    check_bytes_read(path, sha256, self.result)
                self._publish()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits (join, wait_samples)
                self.error = exc
            finally:  # whatever happened above, the end is published: nobody waits for a reading that is over
                self._end_reading()
        self._thread = threading.Thread(target=reading, name="eagle-compat-input", daemon=True)
        self._thread.start()

    def _end_reading(self) -> None:
        try:
            with self._changed:  # with keep_when_read's: exactly one of the two keeps the spool
                self._read_ended, keep = True, self._keep
            if keep is not None and self.error is None:
                self._keep_read(*keep)
        finally:
            with self._changed:
                self.finished = True
                self._changed.notify_all()

    def keep_when_read(self, out_dir: str, spool_key: dict) -> None:
        """The spool kept in `out_dir` as soon as the reading ends well (by the reading's thread, long before the
        batches end), so that a run stopped later leaves it for its resume; at once where the reading has ended. Not
        where the reading failed (an input that changed while it was read included)."""
        with self._changed:
            self._keep = (out_dir, spool_key)
            ended = self._read_ended
        if ended and self.error is None:
            self._keep_read(*self._keep)

    def _keep_read(self, out_dir: str, spool_key: dict) -> None:
        if self.kept_at is not None:
            return
        try:
            self.done(spool_key, self.result)
            self.kept_at = self.keep(out_dir)
        except OSError as exc:  # said by the run when the reading's end is recorded; the next run reads again
            self.keep_error = exc

    def _wait(self, done: Any, every_s: float = WAIT_S) -> None:
        """Waits (holding `_changed`) until `done()` or the reading's end; raises ReadingDied where its thread is
        gone without having published its end (a waiter would otherwise wait for ever)."""
        while not done() and not self.finished:
            if self._thread is not None and not self._thread.is_alive() and not self.finished:
                raise ReadingDied("the input's reading ended without a result or an error (its thread is gone); "
                                  "nothing of it is kept: rerun the same command with --resume")
            self._changed.wait(every_s)

    def wait_lines(self, lines: int | None) -> bool:
        """Waits until the reading has read `lines` lines (None: all) or ended; returns whether it ended."""
        with self._changed:  # lines are counted without a notification: looked at every 50 ms
            self._wait(lambda: lines is not None and self.lines >= lines, every_s=0.05)
            return self.finished

    def wait_samples(self, count: int) -> None:
        """Waits until `count` samples are readable or the reading ended (or was stopped); raises the reading's
        error where it ended on one before them."""
        with self._changed:
            self._wait(lambda: len(self._offsets) >= count or self.stopped)
        if len(self._offsets) < count and self.error is not None:
            raise self.error
        if len(self._offsets) < count and self.stopped and not self.finished:
            raise ReadingStopped()

    def join(self) -> inputs.Dataset:
        """The reading's result, once it ended (its error raised)."""
        self.wait_lines(None)
        if self.error is not None:
            raise self.error
        return self.result

    def stop(self) -> None:
        """The reading ends at its next line (the run no longer needs it); whoever waits for samples stops waiting."""
        with self._changed:
            self.stopped = True
            self._changed.notify_all()

    def done(self, spool_key: dict, data: inputs.Dataset, data_report: dict | None = None) -> Samples:
        """Ends the file (offsets, header, footer) and returns its samples, read from it. The header keeps the data
        report: `data_report`, or the tally's (with --max-len as `spool_key` says). Once: later calls return the
        samples."""
        if self.header is not None:
            return self.samples
        if not data.data_sha256:
            raise ValueError("a spool is keyed by the SHA-256 of the bytes its samples were read from; none given")
        # keyed by the bytes read, not by the digest the run planned with: a spool stands only for the bytes its
        # samples came from
        spool_key = {**spool_key, "data_sha256": data.data_sha256}
        if data_report is None and self._tally is not None:
            data_report = self._tally.report(spool_key.get("reading", {}).get("max_len"), {
                "--skip-uncovered": data.skipped, "--min-loss-tokens": data.few_loss_tokens})
        self._publish()
        self._put(self._offsets.tobytes() + self._indices.tobytes())
        payload_digest = self._digest.hexdigest()
        self.header = {"key": spool_key, "samples": len(self._offsets), "tokens": self._tokens,
                       "payload_blake2b": payload_digest, "skipped": data.skipped,
                       "few_loss_tokens": [{**e, "cut": dataclasses.asdict(e["cut"])} if "cut" in e else e
                                           for e in data.few_loss_tokens],
                       "notes": data.notes, "report": data_report or {}}
        header = json.dumps(self.header).encode()
        self._digest = None
        self._put(header + _FOOTER.pack(len(header), MAGIC), end=True)
        self._tally = None  # 16 bytes a sample, no longer needed
        return self.samples

    def close(self) -> None:
        """The file dropped (a read that failed, or a run that stopped: nothing of it is kept), its reading stopped
        first."""
        self.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with contextlib.suppress(OSError):
            self._out.close()
        self._f.close()

    def keep(self, out_dir: str) -> str:
        """The finished spool into `out_dir` under its name, whole or not at all: linked where the system can (no
        copy), copied otherwise."""
        path = os.path.join(out_dir, SPOOL_FILE)
        fd = self._f.fileno()
        os.fsync(fd)
        tmp = f"{SPOOL_FILE}.tmp-{os.getpid()}"
        folder = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:  # an O_TMPFILE file gets a name (linkat with AT_SYMLINK_FOLLOW: a dir fd makes Python call linkat)
            os.link(f"/proc/self/fd/{fd}", tmp, dst_dir_fd=folder, follow_symlinks=True)
        except OSError:
            os.close(folder)
            def copy(target: str) -> None:
                with open(target, "wb") as dst, os.fdopen(os.dup(fd), "rb") as src:
                    src.seek(0)
                    shutil.copyfileobj(src, dst, _READ_CHUNK)
            atomic_io.atomic_write_file(path, copy)
            return path
        try:
            os.replace(tmp, SPOOL_FILE, src_dir_fd=folder, dst_dir_fd=folder)
            os.fsync(folder)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=folder)
            raise
        finally:
            os.close(folder)
        return path


def input_identity(path: str) -> tuple[int, int, int]:
    """A file's inode, size and modification time: another value means it was replaced or written since."""
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


def check_unchanged(path: str, identity: tuple) -> None:
    """Raises InputChanged where `path` is no longer the file of `identity` (`input_identity` from before it was
    read): replaced, written to, renamed or removed."""
    try:
        now, gone = input_identity(path), ""
    except OSError as exc:  # renamed or removed: not the file the run read, as far as it can tell
        now, gone = None, f"; it cannot be found there now: {exc.strerror or exc}"
    if now == identity:
        return
    raise InputChanged(f"--data {path!r} changed while it was read (its inode, size or modification time differs "
                       f"from the start of the run{gone}): the samples would not be those of the input the record "
                       "names. Keep the input unchanged while a run reads it, then rerun the same command with it as "
                       "it was (--resume, where this run wrote files), or extract a changed input into a new --out")


def check_bytes_read(path: str, sha256: str, data: inputs.Dataset) -> None:
    """Raises InputChanged where the bytes `data` was read from (their SHA-256, taken as they were read, or the
    spool's) are not those of `sha256`, the digest the run's settings record: the file was rewritten between the two
    (in place, its inode, size and modification time put back, say)."""
    if data.data_sha256 == sha256:
        return
    raise InputChanged(f"--data {path!r} changed while it was read: the SHA-256 of the bytes read ("
                       f"{data.data_sha256[:16] or 'none'}...) is not the one the run's record holds ({sha256[:16]}...,"
                       " taken before the reading), so the samples would not be those of the input the record names. "
                       "Keep the input unchanged while a run reads it, then rerun the same command with it as it was "
                       "(--resume, where this run wrote files), or extract a changed input into a new --out")


def save(out_dir: str, spool_key: dict, data: inputs.Dataset, report: dict | None = None) -> str:
    """A read input (`inputs.read_dataset`) as the spool in `out_dir`."""
    b = Builder(out_dir)
    for s in data.samples:
        b.append(s)
    b.done(spool_key, data, report)
    return b.keep(out_dir)


def load(out_dir: str, spool_key: dict) -> inputs.Dataset | None:
    """The input as an earlier run of this set read it (its samples read from the file when asked for; its data
    report as `.report`), or None where there is no whole, undamaged spool made with `spool_key`. The payload's digest
    is checked here, in one pass that holds no sample."""
    path = os.path.join(out_dir, SPOOL_FILE)
    try:
        f = os.fdopen(atomic_io.open_no_follow(path, os.O_RDONLY), "rb")
    except OSError:
        return None
    if os.fstat(f.fileno()).st_uid != os.geteuid():  # another user's: the input is read again, not taken from it
        f.close()
        return None
    try:
        data = _opened(f, spool_key)
    except (OSError, EOFError, ValueError, KeyError, TypeError, IndexError, OverflowError, struct.error):
        data = None  # not one this release can read: the input is read again
    if data is None:
        f.close()
    return data


def header_of(f: Any) -> tuple[dict, int] | None:
    """A spool file's header and its length (None: not a spool of this layout)."""
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    if size < len(MAGIC) + _FOOTER.size or f.read(len(MAGIC)) != MAGIC:
        return None
    f.seek(size - _FOOTER.size)
    header_len, magic = _FOOTER.unpack(f.read(_FOOTER.size))
    if magic != MAGIC or not 0 < header_len <= size - len(MAGIC) - _FOOTER.size:
        return None
    f.seek(size - _FOOTER.size - header_len)
    return json.loads(f.read(header_len)), header_len


def _opened(f: Any, spool_key: dict) -> inputs.Dataset | None:
    size = os.fstat(f.fileno()).st_size
    found = header_of(f)
    if found is None or found[0].get("key") != spool_key:
        return None
    header, header_len = found
    n, tokens = int(header["samples"]), int(header["tokens"])
    table_at = size - _FOOTER.size - header_len - 16 * n
    if n < 0 or tokens < 0 or table_at != len(MAGIC) + n * _RECORD.size + 5 * tokens:
        return None
    digest = hashlib.blake2b(digest_size=16)
    f.seek(len(MAGIC))
    left = table_at + 16 * n - len(MAGIC)
    while left:
        chunk = f.read(min(left, 16 * _READ_CHUNK))
        if not chunk:
            return None
        digest.update(chunk)
        left -= len(chunk)
    if digest.hexdigest() != header["payload_blake2b"]:
        return None
    f.seek(table_at)
    offsets, indices = array("q"), array("q")
    offsets.fromfile(f, n)
    indices.fromfile(f, n)
    if n and (offsets[0] != len(MAGIC) or any(b <= a for a, b in zip(offsets, offsets[1:]))
              or any(b <= a for a, b in zip(indices, indices[1:]))):
        return None
    few = [{**e, "cut": inputs.Cut(**e["cut"])} if "cut" in e else e for e in header["few_loss_tokens"]]
    data = inputs.Dataset(Samples(f, offsets, indices, tokens), header["skipped"], few, header["notes"])
    data.report = header.get("report") or None
    data.data_sha256 = header["key"]["data_sha256"]  # the bytes its samples were read from
    return data
