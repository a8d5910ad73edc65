"""The run's stage lines on stderr, one each, from its first second: the input read, the engine starting (with its
elapsed time while it loads), the engine ready. A start-up of minutes (a large model's weights, a busy CPU) is then
never mistaken for a hang, and the summary can split start-up from extraction."""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Any, Iterator

from . import report

# while the engine starts: how often its elapsed time is said (rewritten in place on a terminal, a new line elsewhere:
# a log file gets a line every half minute, not a line a second)
TICK_TERMINAL_S = 1.0
TICK_LOG_S = 30.0


def say(text: str, stream: Any = None) -> None:
    print(f"extract: {text}", file=stream or sys.stderr, flush=True)


def lines_of(entries: list[dict], most: int = 10) -> str:
    """`line 3` / `lines 3, 7, ...`: the input lines of entries (each with a "line"), the first `most` of them."""
    lines = [e["line"] for e in entries if "line" in e]
    return report.line_list(lines, len(lines), most) if lines else ""


def plural(n: int, word: str, words: str = "") -> str:
    """`1 sample`, `2 samples`: the count with its word (report.plural gives the word alone)."""
    return f"{n:,} {report.plural(n, word, words or None)}"


@contextlib.contextmanager
def waiting(doing: str, done: str, stream: Any = None, tick_s: float | None = None) -> Iterator[dict]:
    """Says `doing`, then its elapsed time while the body runs, then `done` with the seconds it took (`{s}` in
    `done`). Yields a dict whose "seconds" is set at the end. Nothing is said of a body that raised: its error is."""
    stream = stream or sys.stderr
    terminal = bool(getattr(stream, "isatty", lambda: False)())
    tick = tick_s if tick_s is not None else TICK_TERMINAL_S if terminal else TICK_LOG_S
    started = time.monotonic()
    stop = threading.Event()
    say(doing, stream)

    def tell_elapsed() -> None:
        while not stop.wait(tick):
            elapsed = time.monotonic() - started
            if terminal:
                print(f"\rextract: {doing} ({elapsed:.0f} s)", end="", file=stream, flush=True)
            else:
                say(f"{doing} ({elapsed:.0f} s)", stream)

    ticker = threading.Thread(target=tell_elapsed, name="eagle-compat-stage", daemon=True)
    ticker.start()
    took: dict = {}
    try:
        yield took
    finally:
        stop.set()
        ticker.join()
        took["seconds"] = time.monotonic() - started
        if terminal:
            print("\r", end="", file=stream, flush=True)
    say(done.format(s=took["seconds"]), stream)


class Count:
    def __init__(self) -> None:
        self.n = 0

    def add(self, n: int = 1) -> None:
        self.n += n  # one writer (the thread doing the work); the ticker only reads it


@contextlib.contextmanager
def counting(doing: str, total: int | None, unit: str, stream: Any = None,
             tick_s: float | None = None) -> Iterator[Count]:
    """For work of unknown length (reading the input, checking kept files): nothing for work done within one tick;
    past it, `doing: n of total units (rate/s)` every tick, and a last line with the count and time."""
    stream = stream or sys.stderr
    terminal = bool(getattr(stream, "isatty", lambda: False)())
    tick = tick_s if tick_s is not None else TICK_TERMINAL_S * 5 if terminal else TICK_LOG_S
    count, started, stop = Count(), time.monotonic(), threading.Event()
    ticked = []

    def line() -> str:
        elapsed = max(time.monotonic() - started, 1e-9)
        of = f" of {total:,}" if total is not None else ""
        return f"{doing}: {count.n:,}{of} {unit}s ({count.n / elapsed:,.0f}/s, {elapsed:.0f} s)"

    def tell() -> None:
        while not stop.wait(tick):
            ticked.append(True)
            say(line(), stream)

    ticker = threading.Thread(target=tell, name="eagle-compat-count", daemon=True)
    ticker.start()
    try:
        yield count
    finally:
        stop.set()
        ticker.join()
    if ticked:
        say(line() + ": done", stream)
