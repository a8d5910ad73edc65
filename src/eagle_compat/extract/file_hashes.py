"""The model's checksums a set records (its weights and config, hashed whole or by a fixed sample of large files), so
that a resume or a shard elsewhere runs the same model."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from ..errors import InvalidInput


def file_sha256(path: str, limit: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if limit is None:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        else:  # size + first and last `limit` bytes: HASHED_ENDS
            size = os.path.getsize(path)
            h.update(str(size).encode())
            h.update(f.read(limit))
            if size > limit:
                f.seek(max(size - limit, limit))
                h.update(f.read(limit))
    return h.hexdigest()


# Weights over FULL_HASH_LIMIT are not read whole (hundreds of GB for Kimi-K2.5, before the engine starts): each
# record names how its files were hashed, and a run adding to a directory hashes them the way its record says.
FULL_HASH_LIMIT = 1 << 30


HASHED_FULL = "full"


# records of earlier releases: a fine-tune that trained neither end of any weight file shared its base's checksums
HASHED_ENDS = "size+first+last MiB"


# a trained tensor changes (nearly) every value: its first and last 4 KiB differ
HASHED_TENSORS = "size+header+first and last 4 KiB of each tensor"


HASHED_SPREAD = "size+64 MiB spread over the file"  # a large weight file that is not safetensors (a pickle)


_TENSOR_END = 4096


def _large_file_sha256(path: str, method: str) -> str:
    if method == HASHED_ENDS:
        return file_sha256(path, 1 << 20)
    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        if method == HASHED_TENSORS:
            header, data_start, spans = _safetensors_layout(f, path, size)
            h.update(header)
            for read_begin, read_end, pieces in _tensor_end_reads(spans):
                f.seek(data_start + read_begin)
                block = f.read(read_end - read_begin)
                for begin, end in pieces:  # only the ends: the digest does not depend on how reads were merged
                    h.update(block[begin - read_begin:end - read_begin])
        elif method == HASHED_SPREAD:
            for k in range(64):
                f.seek((size - (1 << 20)) * k // 63 if size > 1 << 20 else 0)
                h.update(f.read(1 << 20))
        else:
            raise ValueError(f"unknown hashing method {method!r}")
    return h.hexdigest()


def _safetensors_layout(f: Any, path: str, size: int) -> tuple[bytes, int, list[tuple[int, int]]]:
    """The header's bytes, where the tensor data starts, and each tensor's (begin, end) within the data; an
    InvalidInput naming the file where the header does not describe it."""
    def unreadable(why: str) -> InvalidInput:
        return InvalidInput(f"--model file {path}: not a readable safetensors file ({why})")

    raw = f.read(8)
    if len(raw) < 8:
        raise unreadable("shorter than the 8 bytes giving its header's length")
    header_size = int.from_bytes(raw, "little")
    if header_size > min(size - 8, 100 << 20):  # safetensors' own limit is 100 MB
        raise unreadable(f"its header length {header_size} exceeds the file or 100 MB")
    header = f.read(header_size)
    try:
        parsed = json.loads(header)
    except ValueError as exc:
        raise unreadable(f"its header is not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise unreadable("its header is not a JSON object")
    data_size = size - 8 - header_size
    spans = []
    for key, tensor in parsed.items():
        if key == "__metadata__":
            continue
        offsets = tensor.get("data_offsets") if isinstance(tensor, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data_size):
            raise unreadable(f"tensor {key!r}: data_offsets {offsets!r} are not within its {data_size} data bytes")
        spans.append((offsets[0], offsets[1]))
    return header, 8 + header_size, spans


def _tensor_end_reads(spans: list[tuple[int, int]]) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Reads covering each tensor's first and last 4 KiB, in file order, as (begin, end, the ends within it); ends
    less than 64 KiB apart are read as one (a quantized MoE file holds thousands of small scale tensors side by
    side)."""
    ends = sorted({window for begin, end in spans
                   for window in ((begin, min(end, begin + _TENSOR_END)), (max(begin, end - _TENSOR_END), end))})
    reads: list[tuple[int, int, list[tuple[int, int]]]] = []
    for begin, end in ends:
        if reads and begin <= reads[-1][1] + (64 << 10):
            read_begin, read_end, pieces = reads[-1]
            reads[-1] = (read_begin, max(read_end, end), pieces + [(begin, end)])
        else:
            reads.append((begin, end, [(begin, end)]))
    return reads


def model_checksums(model_path: str, recorded: dict[str, Any] | None = None) -> dict[str, Any]:
    """Each model file's size and sha256 (`hashed` says of what). `recorded`: the record of a directory that holds
    files made with them; a large file of the recorded size that it hashed the earlier way (HASHED_ENDS) is hashed
    that way again, so the directory's files (stamped with those checksums) stay comparable."""
    out: dict[str, Any] = {}
    if not os.path.isdir(model_path):
        return {"note": "not a local directory; no checksums"}
    for name in sorted(os.listdir(model_path)):
        path = os.path.join(model_path, name)
        if not os.path.isfile(path) or not name.endswith((".json", ".safetensors", ".bin", ".model", ".py")):
            continue
        size = os.path.getsize(path)
        method = (HASHED_FULL if size <= FULL_HASH_LIMIT
                  else HASHED_TENSORS if name.endswith(".safetensors") else HASHED_SPREAD)
        before = (recorded or {}).get(name)
        if (method != HASHED_FULL and isinstance(before, dict) and before.get("size") == size
                and before.get("hashed") == HASHED_ENDS):
            method = HASHED_ENDS
        digest = file_sha256(path) if method == HASHED_FULL else _large_file_sha256(path, method)
        out[name] = {"size": size, "sha256": digest, "hashed": method}
    return out


def hashed_the_earlier_way(checksums: dict[str, Any]) -> list[str]:
    """The files of a record hashed by size and first and last MiB (records of earlier releases)."""
    return [name for name, entry in checksums.items() if isinstance(entry, dict) and entry.get("hashed") == HASHED_ENDS]
