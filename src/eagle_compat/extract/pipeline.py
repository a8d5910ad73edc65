"""The extract job's pipeline: the engine computes batch k+1 while writer threads save batch k.

Samples reach the writers as tensors in the generator's shared-memory buffers (no copy); a buffer goes back to the
generator's ring once its samples are written. At most `max_pending` samples wait for a writer, so host memory stays
bounded (about `max_pending` samples plus the ring) however slow the disk is.
"""
from __future__ import annotations

import collections
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

DEFAULT_THREADS = max(2, min(8, os.cpu_count() or 2))


def _lower_priority(nice: int) -> None:
    """Writer threads yield the CPU to the engine (on a CPU engine they would otherwise slow its compute threads);
    the bounded queue still makes the engine wait if the writers fall behind."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass


class WriterPool:
    """Run `fn(*args)` on `threads` threads; `submit` blocks while `max_pending` calls wait. The first error is
    raised by the next `submit` or by `close`. `blocked_s` / `blocked_submits`: how long and how often `submit` had
    to wait for a free slot (the caller waiting for the writers: the disk)."""

    def __init__(self, threads: int = DEFAULT_THREADS, max_pending: int | None = None, nice: int = 10):
        self.threads = max(1, int(threads))
        self._slots = threading.BoundedSemaphore(max_pending or 4 * self.threads)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="eagle-compat-writer",
                                        initializer=_lower_priority, initargs=(nice,))
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self.done = 0
        self.blocked_s = 0.0
        self.blocked_submits = 0  # counted before the wait: tests wait on it (hooks, no timing windows)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._raise()
        if not self._slots.acquire(blocking=False):
            start = time.monotonic()
            self.blocked_submits += 1
            self._slots.acquire()
            self.blocked_s += time.monotonic() - start
        try:
            future = self._pool.submit(fn, *args)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(self._finished)

    def _finished(self, future: Future) -> None:
        self._slots.release()
        if future.cancelled():  # a write left undone by a failure or Ctrl-C: nothing to record (and exception()
            return              # would raise CancelledError here: one logged traceback per queued write)
        exc = future.exception()
        with self._lock:
            if exc is not None and self._error is None:
                self._error = exc
            elif exc is None:
                self.done += 1

    def _raise(self) -> None:
        with self._lock:
            exc = self._error
        if exc is not None:
            raise exc

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._raise()

    def __enter__(self) -> "WriterPool":
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            return
        self.close()


class _TokenIds:
    """The batches' token ids, as the engine's thread takes them (each batch kept in `sent` for its results).
    `cancel`: a wait for a batch whose input is still being read ends (the generator calls it before it joins its
    engine thread, so a Ctrl-C there does not wait for the reading)."""

    def __init__(self, batches: Any, ids_of: Callable[[Any], list[int]], sent: collections.deque):
        self.batches, self.ids_of, self.sent = batches, ids_of, sent

    def __iter__(self) -> Iterator[list[list[int]]]:
        for b in self.batches:
            self.sent.append(b)
            yield [self.ids_of(s) for s in b]

    def cancel(self) -> None:
        cancel = getattr(self.batches, "cancel", None)  # placement.StreamedBatches'; other batches never wait
        if cancel is not None:
            cancel()


def pipelined(gen: Any, batches: list[list[Any]], ids_of: Callable[[Any], list[int]],
              prefetch: int = 1) -> Iterator[tuple[list[Any], list[dict]]]:
    """(batch, results) for each batch, the engine running ahead by `prefetch` batches (see generate_batches).
    `batches` is iterated once (by the engine's thread: it may wait for a batch whose input is still being read)."""
    sent: collections.deque = collections.deque()
    token_ids = _TokenIds(batches, ids_of, sent)
    results = gen.generate_batches(token_ids, prefetch=prefetch)
    try:
        for r in results:
            yield sent.popleft(), r
    finally:
        token_ids.cancel()  # an input still being read: the engine's thread stops waiting
        results.close()  # stops the engine thread at once when the caller stops early (an error, a writer failure)


class Progress:
    """The run's one progress bar (samples, their rate, tok/s) on stderr; nothing where disabled or without tqdm."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="sample", desc="extract", file=sys.stderr)
            except ImportError:
                pass

    def update(self, n: int, samples_per_s: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.update(n)
            # tqdm shows the samples' rate itself: a second one, computed otherwise, would disagree with it
            self.bar.set_postfix_str(f"{tokens_per_s:,.0f} tok/s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
