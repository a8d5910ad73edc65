"""The hand-over of captured states from the worker to the driver: a ring of shared-memory buffers.

Driver (`HostRing`): owns a few files in /dev/shm, each mapped once in the driver and once in the capture worker,
where it is registered as pinned memory (`cudaHostRegister`). Before a batch runs, the driver picks a free buffer and
tells the worker where each request's states go (`plan`): one block per sample, `[layers, tokens, hidden]`, so
every per-layer tensor is one contiguous range.
Worker (`RingStaging`): after each step, copies each request's rows straight from the GPU into its block, on a side
stream (overlapping the next step): the only host copy. At the end of the batch it waits for the copies and answers
with row counts; no tensor goes through the RPC queue.
The driver then hands out tensors that *are* those blocks (`torch.frombuffer` on a per-batch memoryview, one storage
per tensor, so `torch.save` of a sample writes only that sample). The buffer returns to the ring when the last of
them is gone (a finalizer on the memoryview); the ring keeps at most `keep_free` idle buffers.

A batch that does not fit (free space in /dev/shm, or the limit `EAGLE_COMPAT_SHM_LIMIT_BYTES`) falls back, with a
logged reason, to per-step pinned copies returned through the RPC queue (`HostStaging`).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import settings

log = logging.getLogger("eagle_compat.handover")

SHM_DIR = "/dev/shm"
LIMIT_ENV = "EAGLE_COMPAT_SHM_LIMIT_BYTES"
ROUND = 64 << 20  # buffers are sized in 64 MiB steps, so batches of slightly different sizes reuse them
SMALL_ROUND = 1 << 20  # (1 MiB steps below 64 MiB)
HEADROOM = 256 << 20  # left free in /dev/shm for everyone else
NONCE_BYTES = 16


def sample_block_bytes(tokens: int, layers: int, hidden: int, itemsize: int) -> int:
    return tokens * layers * hidden * itemsize


# ----------------------------------------------------------------------------------------------------------------
# Driver side

@dataclass
class Slot:
    id: int
    nbytes: int
    mm: Any = field(repr=False, default=None)
    pinned: bool = False


# A buffer's file: `eagle-compat-<pid>-<random>.bin` (random: unique across PID namespaces and across rings of one
# process), made as `.<name>.new`, locked by its creator (flock), then renamed. The creator keeps the lock until it
# removes the name, after the worker has mapped the file. The sweep takes `.new` files too (a creator killed before
# the rename leaves one); one swept before its creator locked it is noticed by the creator (another inode).
FILE_PATTERN = r"\.?eagle-compat-\d+-[0-9a-f]+\.bin(\.new)?"


class HandoverError(RuntimeError):
    """The worker did not map the driver's buffer (its file is gone, or it is another file): states would be lost."""


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove hand-over files whose creator is gone. A buffer's name lives only while the worker maps it (one RPC),
    but a driver killed in that window leaves the file, and /dev/shm is memory. Whether the creator lives is asked of
    the file itself (its creator's flock, released by the kernel when that process dies), never of /proc: drivers in
    other containers sharing /dev/shm (`docker --ipc=host`) have PIDs this /proc does not show. Returns what went."""
    import fcntl
    import re
    gone = []
    try:
        names = os.listdir(directory)
    except OSError:
        return gone
    for name in names:
        if not re.fullmatch(FILE_PATTERN, name):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # taken: nobody holds the file any more
        except OSError:
            continue  # its creator lives (here or in another PID namespace)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
                gone.append(name)
        finally:
            os.close(fd)
    if gone:
        log.info("removed %d hand-over files left in %s by processes that no longer run", len(gone), directory)
    return gone


DEFAULT_LIMIT_SHARE = 0.25


def default_limit_bytes(directory: str = SHM_DIR) -> int | None:
    """The ring's bound where the user set none: a quarter of the filesystem holding it. Results the caller keeps
    hold their batch's whole buffer (one storage per batch); without a bound, a caller keeping one sample per batch
    grew the ring until /dev/shm was nearly full (pinned, on GPU, in both processes)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return int(st.f_blocks * st.f_frsize * DEFAULT_LIMIT_SHARE)


class _CannotAllocate(Exception):
    """The buffer's file could not be made (its OSError is the cause)."""


class HostRing:
    """Driver side of the ring. `rpc(method, *args)` calls the capture worker (rank 0); it is only called from the
    thread that runs the engine (acquire / close), never from a finalizer."""

    def __init__(self, rpc: Callable[..., Any], *, directory: str = SHM_DIR, limit_bytes: int | None = None,
                 keep_free: int = 2, pin: bool = True):
        self.rpc = rpc
        self.directory = directory
        env = settings.value(LIMIT_ENV)
        self.limit_bytes = (limit_bytes if limit_bytes is not None else env if env is not None else
                            default_limit_bytes(directory))
        if settings.value("EAGLE_COMPAT_NO_SHM"):  # every batch through the fallback
            self.limit_bytes = 0
        self.keep_free = keep_free
        self.pin = pin
        self.slots: dict[int, Slot] = {}
        self.free: set[int] = set()
        self._lock = threading.RLock()  # release() may run from a finalizer while this thread holds it
        self._ids = itertools.count()
        self.fallbacks = 0
        self.peak_bytes = 0
        sweep_stale(directory)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots.values())

    def acquire(self, nbytes: int) -> tuple[Slot | None, str | None]:
        """A buffer of at least `nbytes` for one batch, or (None, why not)."""
        self._trim()
        with self._lock:
            fits = sorted((self.slots[i] for i in self.free if self.slots[i].nbytes >= nbytes), key=lambda s: s.nbytes)
            if fits:
                self.free.discard(fits[0].id)
                return fits[0], None
        step = ROUND if nbytes >= ROUND else SMALL_ROUND  # small batches do not hold 64 MiB each
        size = -(-nbytes // step) * step
        if self.limit_bytes is not None and self.total_bytes + size > self.limit_bytes:
            size = nbytes  # no rounding up when that alone would pass the limit
        while True:  # make room: idle buffers that are too small go first
            with self._lock:
                idle = sorted(self.free, key=lambda i: self.slots[i].nbytes)
                over_limit = self.limit_bytes is not None and self.total_bytes + size > self.limit_bytes
                too_many = len(self.free) >= self.keep_free
            if not idle or not (over_limit or too_many or self._space() < size + HEADROOM):
                break
            self._destroy(idle[0])
        if self.limit_bytes is not None and self.total_bytes + size > self.limit_bytes:
            with self._lock:
                kept = [s for i, s in self.slots.items() if i not in self.free]
            held = (f"; {len(kept)} buffers ({sum(s.nbytes for s in kept) / 2**20:.0f} MiB) are held by results the "
                    "caller still references: clone() the tensors you keep to give their buffers back") if kept else ""
            return None, (f"{size / 2**20:.0f} MiB more would pass the hand-over limit of "
                          f"{self.limit_bytes / 2**20:.0f} MiB ({LIMIT_ENV}); {self.total_bytes / 2**20:.0f} MiB in use"
                          f"{held}")
        space = self._space()
        if space < size + HEADROOM:
            return None, (f"{self.directory} has {space / 2**20:.0f} MiB free; a batch needs {size / 2**20:.0f} MiB "
                          f"plus {HEADROOM >> 20} MiB headroom")
        try:
            slot = self._create(size)
        except _CannotAllocate as exc:  # not OSError: a worker call's TimeoutError is one, and must propagate
            return None, f"cannot allocate {size / 2**20:.0f} MiB in {self.directory}: {exc.__cause__}"
        return slot, None

    def _trim(self) -> None:
        """Unmap idle buffers beyond `keep_free`, and while the ring holds more than its limit (smallest first)."""
        while True:
            with self._lock:
                idle = sorted(self.free, key=lambda i: self.slots[i].nbytes)
                over = self.limit_bytes is not None and self.total_bytes > self.limit_bytes
            if not idle or (len(idle) <= self.keep_free and not over):
                return
            self._destroy(idle[0])

    def _space(self) -> int:
        try:
            st = os.statvfs(self.directory)
        except OSError:
            return 0
        return st.f_bavail * st.f_frsize

    def _create(self, size: int) -> Slot:
        import fcntl
        import secrets

        sid = next(self._ids)
        path = os.path.join(self.directory, f"eagle-compat-{os.getpid()}-{secrets.token_hex(8)}.bin")
        making = os.path.join(self.directory, "." + os.path.basename(path) + ".new")
        try:
            fd = os.open(making, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            raise _CannotAllocate() from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # held until the name is gone: the sweep of any process keeps it
                if os.fstat(fd).st_ino != os.stat(making).st_ino:  # a sweep took the unlocked file meanwhile
                    raise FileNotFoundError(f"{making} was removed before it was locked")
                os.posix_fallocate(fd, 0, size)  # reserve the pages now: ENOSPC here, not SIGBUS later
                os.rename(making, path)
                mm = mmap.mmap(fd, size)
            except OSError as exc:
                for p in (making, path):
                    with contextlib.suppress(OSError):
                        os.unlink(p)
                raise _CannotAllocate() from exc
            # the worker must map this very file: it reads this back from its mapping
            nonce = secrets.token_bytes(NONCE_BYTES)
            mm[:NONCE_BYTES] = nonce
            try:
                reply = self.rpc("eagle_compat_map", sid, path, size, self.pin) or {}
            except BaseException:
                mm.close()
                raise
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(path)  # both sides hold their mapping; the name is no longer needed
        finally:
            os.close(fd)  # the lock goes with it
        if reply.get("mapped") and reply.get("nonce") != nonce.hex():
            mm.close()
            with contextlib.suppress(Exception):
                self.rpc("eagle_compat_unmap", sid)
            raise HandoverError(f"the worker mapped another file than the driver's {path} (it read "
                                f"{reply.get('nonce')!r} where the driver wrote {nonce.hex()}): states would be lost")
        slot = Slot(sid, size, mm, pinned=bool(reply.get("registered")))
        with self._lock:
            self.slots[sid] = slot
            self.peak_bytes = max(self.peak_bytes, self.total_bytes)
        log.info("hand-over buffer %d: %.0f MiB in %s (ring: %d buffers, %.0f MiB)", sid, size / 2**20,
                 self.directory, len(self.slots), self.total_bytes / 2**20)
        return slot

    def _destroy(self, sid: int) -> None:
        with self._lock:
            slot = self.slots.pop(sid, None)
            self.free.discard(sid)
        if slot is None:
            return
        try:
            self.rpc("eagle_compat_unmap", sid)
        finally:
            with contextlib.suppress(BufferError):
                slot.mm.close()  # tensors still using it keep it mapped

    def reserve(self, nbytes: int, count: int) -> int:
        """Create up to `count` idle buffers of `nbytes` now; returns how many idle buffers fit that size."""
        self.keep_free = max(self.keep_free, count)
        held = []
        for _ in range(count):
            slot, why = self.acquire(nbytes)
            if slot is None:
                log.warning("reserved %d of %d hand-over buffers: %s", len(held), count, why)
                break
            held.append(slot)
        for slot in held:
            self.release(slot.id)
        return len(held)

    def lease(self, slot: Slot) -> memoryview:
        """A view of the buffer for one batch's tensors; the buffer is free again once no tensor uses it."""
        mv = memoryview(slot.mm)
        weakref.finalize(mv, self.release, slot.id)
        return mv

    def release(self, sid: int) -> None:
        with self._lock:
            if sid in self.slots:
                self.free.add(sid)

    def close(self, rpc_ok: bool = True) -> None:
        for sid in list(self.slots):
            with self._lock:
                idle = sid in self.free
            if rpc_ok and idle:
                with contextlib.suppress(Exception):
                    self._destroy(sid)
        with self._lock:
            self.slots.clear()  # leased buffers stay mapped for their tensors
            self.free.clear()


def tensors_from_lease(mv: memoryview, dtype: Any, offset: int, tokens: int, layers: int, hidden: int) -> list:
    """The per-layer [tokens, hidden] tensors of one sample's block, each with its own storage."""
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    count = tokens * hidden
    return [torch.frombuffer(mv, dtype=dtype, count=count, offset=offset + j * count * itemsize).view(tokens, hidden)
            for j in range(layers)]


# ----------------------------------------------------------------------------------------------------------------
# Worker side

class RingStaging:
    """Worker side: the registered buffers and the plans of the batches whose states are not yet collected (the driver
    starts batch k+1 before it collects batch k, so batch k's last copies overlap batch k+1's first step).
    `add` is CaptureSession's row_sink; rows of requests in no plan go to the fallback staging."""

    def __init__(self, fallback: Any):
        self.buffers: dict[int, tuple[Any, bool]] = {}
        self.batches: dict[Any, dict] = {}
        self.where: dict[str, Any] = {}  # request id -> batch id
        self.fallback = fallback  # HostStaging: per-step pinned copies, returned through the RPC queue
        self.fallback_batch: Any = None
        self._stream = None

    def map(self, sid: int, path: str, nbytes: int, pin: bool, capture: bool = True) -> dict:
        import torch

        if not capture:
            return {"mapped": False, "registered": False}
        # open, never create: torch.from_file(shared=True) makes a new file where the driver's is gone, and the
        # worker would then write into memory the driver never reads
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise HandoverError(f"the driver's hand-over buffer {path} does not exist (removed by another process "
                                "sharing /dev/shm?): refusing to create another") from None
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise HandoverError(f"the driver's hand-over buffer {path} holds {size} bytes, not {nbytes}")
            buf = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
        finally:
            os.close(fd)  # the mapping stays
        registered = False
        if pin and torch.cuda.is_available():
            rc = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
            registered = int(getattr(rc, "value", rc)) == 0
            if not registered:
                log.warning("cudaHostRegister of %d bytes failed (%s): copies to this buffer are synchronous", nbytes, rc)
        self.buffers[sid] = (buf, registered)
        return {"mapped": True, "registered": registered, "nonce": bytes(buf[:NONCE_BYTES].tolist()).hex()}

    def unmap(self, sid: int) -> None:
        import torch

        entry = self.buffers.pop(sid, None)
        if entry is None:
            return
        buf, registered = entry
        if registered:
            self._wait_all()
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())

    def begin(self, batch_id: Any, plan: dict | None) -> None:
        """plan: {"slot", "dtype", "hidden", "requests": {request_id: (byte_offset, tokens)}}, or None: this batch
        goes through the fallback."""
        if plan is None:
            self.fallback.clear()
            self.fallback_batch = batch_id
            return
        self.batches[batch_id] = {**plan, "events": [], "seen": {}}
        for rid in plan["requests"]:
            self.where[rid] = batch_id

    def add(self, per_layer: list, rows: dict[str, tuple[int, int]], order: list[str]) -> None:
        import torch

        mine = [r for r in order if r in self.where]
        others = [r for r in order if r not in self.where]
        if others:
            # which request each staged row is: the driver checks every sample's rows, not the batch's total
            spans = [(r, rows[r][1]) for r in others]
            if list(rows) == others:
                self.fallback.add(per_layer, spans)
            else:
                self.fallback.add([torch.cat([h[rows[r][0]: rows[r][0] + rows[r][1]] for r in others], 0)
                                   for h in per_layer], spans)
        if not mine:
            return
        h0 = per_layer[0]
        hidden, itemsize, cuda = h0.shape[-1], h0.element_size(), h0.is_cuda
        if cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
        touched = set()
        with torch.cuda.stream(self._stream) if cuda else contextlib.nullcontext():
            for rid in mine:
                batch = self.batches[self.where[rid]]
                if str(h0.dtype) != batch["dtype"] or hidden != batch["hidden"]:
                    raise RuntimeError(f"captured states are {h0.dtype} x {hidden}, the hand-over plan expected "
                                       f"{batch['dtype']} x {batch['hidden']}")
                start, n = rows[rid]
                offset, planned = batch["requests"][rid]
                if planned != n:
                    raise RuntimeError(f"request {rid}: {n} rows captured, the hand-over plan has {planned}")
                buf = self.buffers[batch["slot"]][0]
                for j, h in enumerate(per_layer):
                    o = offset + j * n * hidden * itemsize
                    buf[o: o + n * hidden * itemsize].view(h.dtype).view(n, hidden).copy_(
                        h[start: start + n], non_blocking=cuda)
                batch["seen"][rid] = n
                touched.add(self.where[rid])
        if cuda:
            for h in per_layer:
                h.record_stream(self._stream)  # the GPU rows stay allocated until the copy is done
            event = self._stream.record_event()
            for bid in touched:
                self.batches[bid]["events"].append(event)

    def _wait_all(self) -> None:
        for batch in self.batches.values():
            for e in batch["events"]:
                e.synchronize()

    def finish(self, batch_id: Any) -> dict:
        """Waits for the batch's copies: {"rows": {request_id: tokens}}, or {"fallback": per-layer tensors,
        "fallback_rows": [(request_id, tokens), ...] in the tensors' row order}."""
        if batch_id == self.fallback_batch and batch_id not in self.batches:
            self.fallback_batch = None
            spans = list(self.fallback.requests)
            return {"fallback": self.fallback.collect(), "fallback_rows": spans}
        batch = self.batches.pop(batch_id, None)
        if batch is None:
            raise RuntimeError(f"no hand-over plan for batch {batch_id!r}")
        for e in batch["events"]:
            e.synchronize()
        for rid in batch["requests"]:
            self.where.pop(rid, None)
        return {"rows": batch["seen"]}

    def abandon(self) -> None:
        """Forget every plan (after a failed batch): pending copies finish first."""
        self._wait_all()
        self.batches.clear()
        self.where.clear()
        self.fallback.clear()
        self.fallback_batch = None
