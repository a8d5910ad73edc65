"""The tokenized input, kept in --out (`.eagle-compat-input.bin`) so that a `--resume` or another `--shard` of the same
set reads it back in seconds instead of tokenizing the input again (minutes for a million conversations).

It is used only where everything that made it is unchanged: the input's bytes (SHA-256), the model folder's files
other than weights (tokenizer files, chat templates), the tokenizer as loaded, the transformers, tokenizers and jinja2
releases, the reading code itself, and every option that changes how lines become samples (`key`). Anything else, a file cut short or of another layout included, is read as "no spool": the input is then read
and tokenized as if there were none, and the spool written again. It holds exactly what `inputs.read_dataset`
returned: the samples' ids, masks, lines and cuts, the left-out lines, the input's notes.

Layout: MAGIC, the header's length (8 bytes, little-endian), the header (JSON: key, counts, the payload's digest,
left-out lines, notes), then arrays in native byte order: index (int64 x n), line (int64 x n), cut (int32 x 5n),
offsets (int64 x n+1), each sample's ids (int32), each sample's masks (int8)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import sys
from array import array
from typing import Any

from . import inputs, writer

SPOOL_FILE = writer.SPOOL_FILE
MAGIC = b"EGCSPL02"
_CUT_FIELDS = [f.name for f in dataclasses.fields(inputs.Cut)]
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
                h.update(os.path.relpath(path, model).encode() + b"\0" + writer.file_sha256(path).encode() + b"\0")
    return h.hexdigest()


def reading_code_sha256() -> str:
    """The code that turns lines into samples (inputs.py) and lays the spool out (this file): a fix to either,
    in any release or checkout, is another key (eagle_compat's version number alone would not say so)."""
    h = hashlib.sha256()
    for module in (inputs, sys.modules[__name__]):
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


def _arrays(data: inputs.Dataset) -> tuple[array, array, array, array]:
    offsets = array("q", [0])
    for s in data.samples:
        offsets.append(offsets[-1] + len(s.input_ids))
    return (array("q", (s.index for s in data.samples)), array("q", (s.line for s in data.samples)),
            array("i", (getattr(s.cut, name) for s in data.samples for name in _CUT_FIELDS)), offsets)


def _as(typecode: str, values: Any) -> array:
    return values if isinstance(values, array) and values.typecode == typecode else array(typecode, values)


def save(out_dir: str, spool_key: dict, data: inputs.Dataset) -> str:
    """Writes the spool (a temporary file, then renamed over the old one: a reader sees a whole spool or none), its
    payload's digest in its header (a spool damaged since is no spool)."""
    table = _arrays(data)
    digest = hashlib.blake2b(digest_size=16)
    for a in table:
        digest.update(a)
    for s in data.samples:
        digest.update(_as("i", s.input_ids))
    for s in data.samples:
        digest.update(_as("b", s.loss_mask))
    header = json.dumps({"key": spool_key, "samples": len(data.samples), "tokens": table[3][-1],
                         "payload_blake2b": digest.hexdigest(), "skipped": data.skipped,
                         "few_loss_tokens": [{**e, "cut": dataclasses.asdict(e["cut"])} if "cut" in e else e
                                             for e in data.few_loss_tokens],
                         "notes": data.notes}).encode()
    path = os.path.join(out_dir, SPOOL_FILE)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(header)) + header)
            for a in table:
                a.tofile(f)
            for s in data.samples:
                _as("i", s.input_ids).tofile(f)
            for s in data.samples:
                _as("b", s.loss_mask).tofile(f)
    writer.atomic_write_file(path, write)
    return path


def _read(f: Any, typecode: str, count: int, digest: Any) -> array:
    a = array(typecode)
    a.fromfile(f, count)  # EOFError if the file is cut short
    digest.update(a)
    return a


def load(out_dir: str, spool_key: dict) -> inputs.Dataset | None:
    """The input as an earlier run of this set read it, or None where there is no whole, undamaged spool made with
    `spool_key`. Each sample's arrays are read on their own (no second copy of the whole input at any time)."""
    path = os.path.join(out_dir, SPOOL_FILE)
    try:
        with os.fdopen(writer.open_no_follow(path, os.O_RDONLY), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if f.read(len(MAGIC)) != MAGIC:
                return None
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size:
                return None
            header = json.loads(f.read(header_len))
            if header.get("key") != spool_key:
                return None
            n, digest = int(header["samples"]), hashlib.blake2b(digest_size=16)
            index, line = _read(f, "q", n, digest), _read(f, "q", n, digest)
            cuts, offsets = _read(f, "i", len(_CUT_FIELDS) * n, digest), _read(f, "q", n + 1, digest)
            lengths = [offsets[k + 1] - offsets[k] for k in range(n)]
            if offsets[0] != 0 or min(lengths, default=0) < 0 or offsets[n] != header["tokens"]:
                return None
            ids = [_read(f, "i", length, digest) for length in lengths]
            masks = [_read(f, "b", length, digest) for length in lengths]
            if f.read(1) or digest.hexdigest() != header["payload_blake2b"]:
                return None
            width = len(_CUT_FIELDS)
            samples = [inputs.Sample(index[k], ids[k], masks[k], line[k],
                                     inputs.Cut(*cuts[width * k: width * (k + 1)])) for k in range(n)]
            few = [{**e, "cut": inputs.Cut(**e["cut"])} if "cut" in e else e for e in header["few_loss_tokens"]]
            return inputs.Dataset(samples, header["skipped"], few, header["notes"])
    except (OSError, EOFError, ValueError, KeyError, TypeError, IndexError, OverflowError, struct.error):
        return None  # no spool, or not one this release can read: the input is read again
