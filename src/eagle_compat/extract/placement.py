"""The set's samples in their places and its batches, as views made when asked for: the driver holds each sample's
input index (8 bytes) and reads its tokens from the spool when a batch, a check or a report needs them, so its memory
does not grow with the input (a million conversations). A batch is fixed by position: batch b is rows b*size up to
(b+1)*size of the set, whichever shard or run does it."""
from __future__ import annotations

import bisect
from array import array
from collections.abc import Container, Iterable, Iterator, Sequence
from typing import Any

from . import formats


class PlacedSamples(Sequence):
    """Sample k of the set as `formats.Placed` (its row is k)."""

    def __init__(self, samples: Sequence[Any]):
        self.samples = samples
        indices = getattr(samples, "indices", None)  # a spool's; a list of samples has none
        self.indices = indices if indices is not None else array("q", (s.index for s in samples))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(len(self)))]
        s = self.samples[k]
        return formats.Placed(s.index, k % len(self) if k < 0 else k, s.line, s.input_ids, s.loss_mask)

    def __iter__(self) -> Iterator[formats.Placed]:
        for k, s in enumerate(self.samples):
            yield formats.Placed(s.index, k, s.line, s.input_ids, s.loss_mask)

    def position_of(self, index: int) -> int | None:
        """The row of the sample with input index `index`, or None where the set has none (indices ascend)."""
        k = bisect.bisect_left(self.indices, index)
        return k if k < len(self.indices) and self.indices[k] == index else None

    def members(self, leaving_out: Container[int] = ()) -> formats.Members:
        """The set's samples but those whose index is in `leaving_out` (a list of indices is never made)."""
        count = len(self) - sum(self.position_of(index) is not None for index in leaving_out)
        return formats.Members(count, lambda index: index not in leaving_out and self.position_of(index) is not None,
                               lambda row: 0 <= row < len(self) and self.indices[row] not in leaving_out)

    def files_at(self, fmt: Any, out: str, rows: Iterable[int], index: Any) -> Iterator[tuple]:
        """(path, token ids, loss mask, what names it, the digest of the bytes written there or None) of the samples
        at `rows`, as writer.first_mismatch reads them; `index`: the directory's index (written_index.IndexVerdicts)."""
        for row in rows:
            s = self[row]
            yield fmt.path(out, s.index, s.row), s.input_ids, s.loss_mask, f"input line {s.line}", index.content_of(row)

    def to_check(self, leaving_out: Container[int], known: Batches, index: Any, on_known: Any) -> Iterator[tuple]:
        """(index, row, ids, mask, what names it, the digest of the bytes written there or None) of each sample but
        those left out, whose file is not known good: written or checked by this run (`known`'s rows) or vouched for
        by the directory's index (written_index.IndexVerdicts; `on_known()` for each of those)."""
        for row, sample_index in enumerate(self.indices):
            if sample_index in leaving_out:
                continue
            if known.holds_row(row) or index.vouched[row]:
                on_known()
                continue
            s = self[row]
            yield s.index, s.row, s.input_ids, s.loss_mask, f"input line {s.line}", index.content_of(row)

    def ids_and_masks(self, leaving_out: Container[int] = ()) -> Iterator[tuple[Sequence[int], Sequence[int]]]:
        for s in self.samples:
            if s.index not in leaving_out:
                yield s.input_ids, s.loss_mask


class Batches(Sequence):
    """Some of the set's batches (`numbers`, ascending), each a list of `formats.Placed` made when asked for."""

    def __init__(self, placed: PlacedSamples, size: int, numbers: Sequence[int]):
        self.placed, self.size, self.numbers = placed, size, numbers

    def __len__(self) -> int:
        return len(self.numbers)

    def rows(self, j: int) -> range:
        b = self.numbers[j]
        return range(b * self.size, min((b + 1) * self.size, len(self.placed)))

    def __getitem__(self, j: Any) -> Any:
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        return [self.placed[r] for r in self.rows(j)]

    def __iter__(self) -> Iterator[list[formats.Placed]]:
        for j in range(len(self)):
            yield self[j]

    def places(self, j: int) -> list[tuple[int, int]]:
        """(index, row) of batch j's samples, without reading their tokens."""
        return [(self.placed.indices[r], r) for r in self.rows(j)]

    def all_places(self) -> Iterator[tuple[int, int]]:
        for j in range(len(self)):
            yield from self.places(j)

    def samples(self) -> Iterator[Any]:
        """The samples of these batches (`inputs.Sample`: with their cuts, for a report)."""
        for j in range(len(self)):
            for r in self.rows(j):
                yield self.placed.samples[r]

    def sample_count(self) -> int:
        return sum(len(self.rows(j)) for j in range(len(self)))

    def select(self, js: Sequence[int]) -> "Batches":
        """Batches js of these (positions in this view), a view of the same set."""
        return Batches(self.placed, self.size, array("q", (self.numbers[j] for j in js)))

    def holds_row(self, row: int) -> bool:
        return row // self.size in self.numbers  # a shard's numbers are a range: no search


class StreamedBatches(Batches):
    """A shard's batches of a set whose input is still being read (`reading`, a spool.Builder on its own thread):
    iterating waits for each batch's samples, and ends where the input does; the reading's error, where it met one,
    is raised where its samples end. Counting and choosing are of the batches whose samples are all read so far
    (every batch, once the reading has ended)."""

    def __init__(self, placed: PlacedSamples, size: int, shard: tuple[int, int], reading: Any):
        self.placed, self.size, self.reading = placed, size, reading
        self.shard_i, self.shard_n = shard

    @property
    def numbers(self) -> range:  # type: ignore[override]
        finished = self.reading.finished  # first: the count read after it is at least what it had then
        n = len(self.placed)
        return range(self.shard_i, -(-n // self.size) if finished else n // self.size, self.shard_n)

    def cancel(self) -> None:
        """The reading stops: no batch is waited for any more (the run stopped early)."""
        self.reading.stop()

    def __iter__(self) -> Iterator[list[formats.Placed]]:
        b = self.shard_i
        while True:
            self.reading.wait_samples((b + 1) * self.size)
            n = len(self.placed)
            if b * self.size >= n:
                return
            yield [self.placed[r] for r in range(b * self.size, min((b + 1) * self.size, n))]
            b += self.shard_n

    def sample_count(self) -> int | None:
        return super().sample_count() if self.reading.finished else None

    def holds_row(self, row: int) -> bool:
        return row // self.size % self.shard_n == self.shard_i


def sample_count(batches: Sequence[Sequence[Any]]) -> int | None:
    """The samples in `batches` (a view counts without reading any; None: a set whose input is still being read)."""
    count = getattr(batches, "sample_count", None)
    return count() if count is not None else sum(map(len, batches))
