"""The tokenized input, kept in --out (`.eagle-compat-input.bin`) so that a `--resume` or another `--shard` of the same
set reads it back in seconds instead of tokenizing the input again (minutes for a million conversations).

It is used only where everything that made it is unchanged: the input's bytes (SHA-256), the model folder's files
(the tokenizer's among them), the transformers and tokenizers releases, eagle_compat's, and every option that changes
how lines become samples (`key`). Anything else, a file cut short or of another layout included, is read as "no spool": the input is then read
and tokenized as if there were none, and the spool written again. It holds exactly what `inputs.read_dataset`
returned: the samples' ids, masks, lines and cuts, the left-out lines, the input's notes.

Layout: MAGIC, the header's length (8 bytes, little-endian), the header (JSON: key, counts, left-out lines, notes),
then arrays in native byte order: index (int64 x n), line (int64 x n), cut (int32 x 5n), offsets (int64 x n+1), ids
(int32 x tokens), masks (int8 x tokens)."""
from __future__ import annotations

import dataclasses
import json
import os
import struct
import sys
from array import array
from typing import Any

from . import inputs, writer

SPOOL_FILE = writer.SPOOL_FILE
MAGIC = b"EGCSPL01"
LAYOUT = 1
_CUT_FIELDS = [f.name for f in dataclasses.fields(inputs.Cut)]


def key(data_sha256: str, model_checksums: dict, reading: dict[str, Any]) -> dict[str, Any]:
    """What must be equal for a spool to stand for this run's read of the input: the input's bytes, the model
    folder's files (the run's settings hash every one: the tokenizer's and its chat template among them), the
    releases that tokenize, and `reading`, the options that change how lines become samples (max-len, vocabulary
    size, --skip-uncovered, --validate, --min-loss-tokens)."""
    import tokenizers
    import transformers

    from .._version import __version__
    return {"layout": LAYOUT, "byteorder": sys.byteorder, "data_sha256": data_sha256,
            "model_checksums": model_checksums, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__, "eagle_compat": __version__, "reading": reading}


def save(out_dir: str, spool_key: dict, data: inputs.Dataset) -> str:
    """Writes the spool (a temporary file, then renamed over the old one: a reader sees a whole spool or none)."""
    n = len(data.samples)
    offsets = array("q", [0])
    for s in data.samples:
        offsets.append(offsets[-1] + len(s.input_ids))
    header = json.dumps({"key": spool_key, "samples": n, "tokens": offsets[-1], "skipped": data.skipped,
                         "few_loss_tokens": [{**e, "cut": dataclasses.asdict(e["cut"])} if "cut" in e else e
                                             for e in data.few_loss_tokens],
                         "notes": data.notes}).encode()
    path = os.path.join(out_dir, SPOOL_FILE)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(header)) + header)
            array("q", (s.index for s in data.samples)).tofile(f)
            array("q", (s.line for s in data.samples)).tofile(f)
            array("i", (getattr(s.cut, name) for s in data.samples for name in _CUT_FIELDS)).tofile(f)
            offsets.tofile(f)
            for s in data.samples:
                array("i", s.input_ids).tofile(f)
            for s in data.samples:
                array("b", s.loss_mask).tofile(f)
    writer.atomic_write_file(path, write)
    return path


def _read_array(f: Any, typecode: str, count: int) -> array:
    a = array(typecode)
    a.fromfile(f, count)  # EOFError if the file is cut short
    return a


def load(out_dir: str, spool_key: dict) -> inputs.Dataset | None:
    """The input as an earlier run of this set read it, or None where there is no spool made with `spool_key`."""
    path = os.path.join(out_dir, SPOOL_FILE)
    try:
        with os.fdopen(writer.open_no_follow(path, os.O_RDONLY), "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                return None
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
            if header.get("key") != spool_key:
                return None
            n, tokens = int(header["samples"]), int(header["tokens"])
            index, line = _read_array(f, "q", n), _read_array(f, "q", n)
            cuts, offsets = _read_array(f, "i", len(_CUT_FIELDS) * n), _read_array(f, "q", n + 1)
            ids, masks = _read_array(f, "i", tokens), _read_array(f, "b", tokens)
            if f.read(1) or offsets[-1] != tokens:
                return None
    except (OSError, EOFError, ValueError, KeyError, TypeError, struct.error):
        return None  # no spool, or not one this release can read: the input is read again
    width = len(_CUT_FIELDS)
    samples = [inputs.Sample(index[k], ids[offsets[k]:offsets[k + 1]], masks[offsets[k]:offsets[k + 1]], line[k],
                             inputs.Cut(*cuts[width * k: width * (k + 1)])) for k in range(n)]
    few = [{**e, "cut": inputs.Cut(**e["cut"])} if "cut" in e else e for e in header["few_loss_tokens"]]
    return inputs.Dataset(samples, header["skipped"], few, header["notes"])
