"""Training files: atomic writes, a manifest that says what the files are, resume that neither skips nor repeats.

Layout of an output directory (readable by speculators 0.3.0's `Eagle3SampleFileDataset` unchanged):
  data_{i}.pt            {"input_ids": LongTensor[T], "hidden_states": [Tensor[T, H] per layer], "loss_mask": LongTensor[T]}
                         (or data_{i}.safetensors: input_ids, loss_mask, hidden_states.{k})
  manifest.json          the directory's one settings record (every shard layout shares it), written before the
                         first sample: layer convention, versions, model checksums, settings, and each run
  data_config.json       speculators' data-generation config, written once every sample of the data has its file
  .eagle-compat.lock     flock'ed by the run writing the directory (holds its pid); the run flocks the folder too
`i` is the sample's index in the input file, so shards and resumed runs never collide.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import itertools
import json
import os
import re
import socket
from datetime import datetime, timezone
from collections.abc import Iterator
from typing import Any, NamedTuple

from .. import settings
from ..errors import EagleCompatError, InvalidInput

MANIFEST = "manifest.json"
LOCK_FILE = ".eagle-compat.lock"
# sample files of any writer (ours: data_{i}.pt/.safetensors; speculators' scripts: hs_{i}.pt); not data_config.json
SAMPLE_FILE = re.compile(r"^(data|hs)_\d+\.[A-Za-z0-9]+$")
# `{file}.tmp-{host}-{pid}-{random}`: unique across the hosts of a cluster writing to shared storage (PIDs repeat
# across hosts); `.tmp-{pid}` is the name earlier versions left
TEMP_FILE = re.compile(r"\.tmp-(?:[\w.-]+-\d+-[0-9a-f]{8}|\d+)$")

# Each sample file names the settings that made its states (`states_stamp`): a file copied in from another shard's
# directory (the README's merge), made with other layers or another model, must not pass for this run's because its
# token ids agree. .pt: an extra key (speculators' loaders pick the keys they read); safetensors: metadata.
STAMP_KEY = "eagle_compat_states_of"
SAFETENSORS_DTYPES = {"BF16": "torch.bfloat16", "F16": "torch.float16", "F32": "torch.float32",
                      "F8_E4M3": "torch.float8_e4m3fn"}

LAYER_CONVENTION = ("hidden_states[k] is the residual stream leaving decoder layer layer_ids[k] "
                    "(hidden + residual after that layer; HF output_hidden_states[layer_id + 1] for layer_id <= N-2; "
                    "for the last layer N-1 the input of the final norm, i.e. pre-final-norm)")


class OutputDirectoryConflict(InvalidInput):
    """--out holds files that this run's settings did not make (or that no settings record describes)."""


class OutputDirectoryBusy(InvalidInput):
    """Another run holds --out's lock."""


class OutputWriteError(EagleCompatError, OSError):
    """Writing to --out failed (disk full, permissions, I/O error); what was written before is complete."""


class InvalidSample(EagleCompatError, RuntimeError):
    """--validate: a sample's ids, mask or states are not what the settings promise (the engine's output)."""


class NonFiniteStates(EagleCompatError, RuntimeError):
    """A sample's hidden states hold NaN or Inf: refused before anything of it is written (in fp8 one Inf would also
    make its token's scale Inf: the whole token zeros or NaN)."""
    run_failed = True


def require_finite(index: int, hidden_states: Any, layer_ids: list[int] | None = None) -> None:
    """Every format's writer calls this first. `hidden_states`: per-layer [T, H] tensors, or one [T, L, H]."""
    import torch

    layers = (list(hidden_states) if not isinstance(hidden_states, torch.Tensor)
              else list(hidden_states.unbind(1)) if hidden_states.dim() == 3 else [hidden_states])
    for k, h in enumerate(layers):
        # one read and no copy: a NaN or Inf anywhere makes the float32 sum non-finite, so a finite sum proves every
        # value finite (7x faster than isfinite().all() on a bf16 [1024, 4096] layer: the online loop pays it per
        # sample). Only a non-finite sum (or one that overflows from huge finite values) pays the element-wise check
        if h.is_floating_point() and bool(torch.isfinite(h.sum(dtype=torch.float32))):
            continue
        finite = torch.isfinite(h)
        if bool(finite.all()):
            continue
        bad = (~finite).reshape(h.shape[0], -1).any(dim=-1).nonzero().flatten().tolist()
        which = f"layer id {layer_ids[k]}" if layer_ids and k < len(layer_ids) else f"hidden_states[{k}]"
        raise NonFiniteStates(f"sample {index}: {which} has {int((~finite).sum())} NaN/Inf values, at tokens "
                              f"{bad[:8]}{' ...' if len(bad) > 8 else ''}; nothing of this sample was written. The "
                              "engine produced them (an overflow in the model's dtype: a new --out with --dtype "
                              "float32 avoids it). To finish this set without such samples, rerun with "
                              "--skip-non-finite (also with --resume): they are left out and listed in "
                              "manifest.json and the summary")


class DegenerateStates(EagleCompatError, RuntimeError):
    """A layer's states are one vector repeated at every token (all zeros, say) while the tokens differ: no target
    model computes that, a broken capture does (vllm#46301: all-zero states from a hybrid verifier, a drafter trained
    on them accepted ~0% of its tokens). Refused, never written or skipped."""
    run_failed = True


def require_varying(index: int, input_ids: Any, hidden_states: Any, layer_ids: list[int] | None = None) -> None:
    """Every layer's states differ between tokens where the tokens do. Rows 0 and 1 differ in any real sample, so
    the whole layer is read only where they are equal."""
    import torch

    ids = torch.as_tensor(input_ids)
    if ids.numel() < 2 or bool((ids == ids[0]).all()):  # one token repeated: equal states are right
        return
    layers = (list(hidden_states) if not isinstance(hidden_states, torch.Tensor)
              else list(hidden_states.unbind(1)) if hidden_states.dim() == 3 else [hidden_states])
    for k, h in enumerate(layers):
        if h.shape[0] < 2 or not torch.equal(h[0], h[1]) or not bool((h == h[0]).all()):
            continue
        which = f"layer id {layer_ids[k]}" if layer_ids and k < len(layer_ids) else f"hidden_states[{k}]"
        value = "all zeros" if not bool(h[0].any()) else "one vector repeated"
        raise DegenerateStates(
            f"sample {index}: {which} is {value} at all {h.shape[0]} tokens although the tokens differ; nothing of "
            "this sample was written. A target model's residual stream differs from token to token: the engine or "
            "the capture returned no states for this layer (vllm#46301 saw all-zero states from a hybrid verifier). "
            "Run `eagle-compat check --model MODEL` to compare this engine with HF transformers")


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


def check_engine_dtype(out_dir: str, recorded: str | None, engine_dtype: str | None, requested: str,
                       where: str) -> None:
    """One directory, one engine precision: `--dtype auto` resolves per machine (bfloat16 on Ampere or newer GPUs and
    on CPU, float16 on older GPUs), so a resume, a shard or a Ray actor elsewhere could add files of another dtype
    under a record that names one. Refused before anything of it is written, where files are already there."""
    if not recorded or not engine_dtype or engine_dtype == recorded or not any_sample_file(out_dir):
        return
    raise OutputDirectoryConflict(two_precisions(f"{where}'s engine", engine_dtype, requested, recorded, out_dir))


def two_precisions(engine: str, engine_dtype: str, requested: str, recorded: str, out_dir: str) -> str:
    """The one message for an engine whose dtype differs from the directory's files (local runs and Ray actors)."""
    return (f"{engine} runs {engine_dtype} (--dtype {requested!r}), and the files in {out_dir} were written by an "
            f"engine in {recorded}: one set would hold states of two precisions. Run with --dtype "
            f"{recorded.replace('torch.', '')} (--dtype auto resolves per machine: bfloat16 on Ampere or newer GPUs "
            "and on CPU, float16 on older GPUs), or choose another --out")


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


def sample_path(out_dir: str, index: int, fmt: str) -> str:
    return os.path.join(out_dir, f"data_{index}.{'pt' if fmt == 'pt' else 'safetensors'}")


def states_stamp(settings: dict) -> str:
    """What made a file's states, in a few bytes: the model's content, the layers, the requested dtype, and
    --trust-remote-code (the checkpoint's own config and model classes instead of transformers'). Not paths (shards of
    one set run on machines with other paths) and not the token ids (checked on their own)."""
    made_of = {k: settings.get(k) for k in ("model_checksums", "layer_ids", "dtype")}
    if settings.get("trust_remote_code"):  # only where set: the stamps of every file made without it stay as they were
        made_of["trust_remote_code"] = True
    return hashlib.sha256(json.dumps(made_of, sort_keys=True, default=str).encode()).hexdigest()[:24]


def stamp_of(manifest: dict) -> str | None:
    """The stamp of the files a directory's record describes (None for a record without settings: only the
    runners' scripted tests make one)."""
    return states_stamp(manifest["settings"]) if manifest.get("settings") else None


def save_sample(out_dir: str, index: int, sample: dict, fmt: str, layer_ids: list[int] | None = None,
                stamp: str | None = None) -> str:
    import torch

    require_finite(index, sample["hidden_states"], layer_ids)
    require_varying(index, sample["input_ids"], sample["hidden_states"], layer_ids)
    path = sample_path(out_dir, index, fmt)
    if fmt == "pt":
        record = sample if stamp is None else {**sample, STAMP_KEY: stamp}
        digests: list[str] = []

        # torch.save straight to the file (a BytesIO copy would hold the GIL; hashing and writing let it go, so writer
        # threads scale), through a hash of each block as it passes. Given a file object, torch names the archive
        # inside "archive", whatever the file's name
        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                through = _DigestingFile(f)
                torch.save(record, through)
            digests.append(through.hexdigest())
        atomic_write_file(path, write)
        return WrittenFile.at(path, digests[-1])
    from safetensors.torch import save as st_save

    tensors = {"input_ids": sample["input_ids"], "loss_mask": sample["loss_mask"]}
    tensors.update({f"hidden_states.{k}": h.contiguous() for k, h in enumerate(sample["hidden_states"])})
    # one key: safetensors orders metadata keys by a hash map, and a file must be the same bytes from any writer
    metadata = {STAMP_KEY: stamp} if stamp else {"format": "eagle_compat-1"}
    data = st_save(tensors, metadata=metadata)
    atomic_write_bytes(path, data)
    return WrittenFile.at(path, content_digest(data))


# The index records a digest of each sample file's bytes as written (writer.INDEX_FILE): a file whose inode or change
# time moved since is opened and its bytes hashed again, so an edit in place is told even where its size and
# modification time were put back. sha256 (hashlib's fastest here, about 1 GB/s a core, the GIL let go), 128 bits
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


class _DigestingFile:
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


def load_sample(path: str) -> dict:
    import torch

    if path.endswith(".pt"):
        return torch.load(path, weights_only=True, map_location="cpu")
    from safetensors.torch import load_file

    t = load_file(path)
    n = len([k for k in t if k.startswith("hidden_states.")])
    return {"input_ids": t["input_ids"], "loss_mask": t["loss_mask"],
            "hidden_states": [t[f"hidden_states.{k}"] for k in range(n)]}


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


class SampleFacts:
    """What a sample file holds, read without its states: token ids, loss mask (None: --format arrow's hs files,
    whose masks are the Arrow rows'), the stamp of the settings that made it (None: written before stamps), and its
    states' layer count, hidden size and dtype (None for fp8 files: stored scaled); the user id owning it (of a
    link, the link's: whoever planted it); and the digest of its bytes, where the index recorded one to compare."""

    def __init__(self, ids: list[int], mask: list[int] | None, stamp: str | None, layers: int, hidden: int,
                 dtype: str | None, owner: int | None = None):
        self.ids, self.mask, self.stamp, self.layers, self.hidden, self.dtype = ids, mask, stamp, layers, hidden, dtype
        self.owner = owner
        self.content: str | None = None  # the digest of its bytes, where they were read (`first_mismatch`)


def read_facts(path: str) -> SampleFacts:
    facts = _read_facts(path)
    facts.owner = os.lstat(path).st_uid
    return facts


def _read_facts(path: str) -> SampleFacts:
    import torch

    if path.endswith(".pt"):
        sample = torch.load(path, weights_only=True, map_location="cpu", mmap=True)
        states = list(sample["hidden_states"])
        return SampleFacts(sample["input_ids"].tolist(), torch.as_tensor(sample["loss_mask"]).tolist(),
                           sample.get(STAMP_KEY), len(states), int(states[0].shape[-1]) if states else 0,
                           str(states[0].dtype) if states else None)
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        keys, stamp = set(f.keys()), (f.metadata() or {}).get(STAMP_KEY)
        if "input_ids" in keys:  # ours: hidden_states.{k}, one [T, H] per layer
            layers = sum(k.startswith("hidden_states.") for k in keys)
            first = f.get_slice("hidden_states.0") if layers else None
            return SampleFacts(f.get_tensor("input_ids").tolist(), f.get_tensor("loss_mask").tolist(), stamp, layers,
                               int(first.get_shape()[-1]) if first is not None else 0,
                               SAFETENSORS_DTYPES.get(first.get_dtype()) if first is not None else None)
        hs = f.get_slice("hidden_states")  # --format arrow: [T, L, H]
        shape = hs.get_shape()
        return SampleFacts(f.get_tensor("token_ids").tolist(), None, stamp, int(shape[1]), int(shape[2]),
                           None if "hidden_states_scales" in keys else SAFETENSORS_DTYPES.get(hs.get_dtype()))


def token_ids_in(path: str) -> tuple[list[int], list[int] | None]:
    """The token ids and loss mask a sample file holds, read without its hidden states."""
    facts = read_facts(path)
    return facts.ids, facts.mask


class StatesExpected:
    """What every file of a directory must hold besides its sample's tokens: the run's stamp (None: a set another
    tool wrote, whose record is not ours), layer count, hidden size (0: unknown) and engine dtype (None: no engine
    has run for it yet). `stamped`: every file of the set carries a stamp (a set begun by a stamping release), so a
    file without one was made elsewhere."""

    def __init__(self, stamp: str | None, layers: int, hidden: int, dtype: str | None,
                 dtype_from: str = "the directory's engine ran", stamped: bool = False):
        self.stamp, self.layers, self.hidden, self.dtype, self.dtype_from = stamp, layers, hidden, dtype, dtype_from
        self.stamped = stamped

    def mismatch(self, facts: SampleFacts) -> str | None:
        if facts.stamp is not None and self.stamp is not None and facts.stamp != self.stamp:
            return ("its states were made with other settings (another model, --layers or --dtype, or another "
                    f"--trust-remote-code: the file's stamp {facts.stamp}, this run's {self.stamp}), e.g. copied in "
                    "from another directory")
        if facts.stamp is None and self.stamp is not None and self.stamped:
            return ("it carries no stamp of the settings that made its states, in a set whose files all do (it was "
                    "written by an earlier release or another tool), e.g. copied in from another directory")
        if facts.layers != self.layers:
            return f"it holds {facts.layers} layers of states, this run {self.layers}"
        if self.hidden and facts.hidden != self.hidden:
            return f"its states have hidden size {facts.hidden}, the model {self.hidden}"
        if self.dtype and facts.dtype and facts.dtype != self.dtype:
            return f"its states are {facts.dtype}, {self.dtype_from} {self.dtype}"
        return None


class Mismatch(NamedTuple):
    path: str
    why: str
    states: bool  # the file's states were made otherwise (its tokens may well be right)
    changed: bool = False  # its bytes are not those a run of the directory wrote there (edited in place since)


# --verify-kept reads on threads only where a file's read waits on storage (a cold cache, a network file system):
# the first files are read on one thread, and threads take the rest only if those took longer than this each. On a
# warm page cache a read is CPU work under the GIL, and 8 threads on 2 cores were 3x slower than one
# (benchmarks/results/resume-index.md).
THREADS_PAY_FROM_S, PROBE_FILES = 0.002, 32


def first_mismatch(expected: Any, states: StatesExpected | None = None, threads: int = 1,
                   on_each: Any = None) -> Mismatch | None:
    """(path, what) of the first file that is not the sample it stands for: other token ids or loss mask, states
    made otherwise (`states`), or bytes other than those written there. `expected` yields (path, token ids, loss mask
    or None, what names the sample[, the digest of the bytes written there, or None]). Files are bound to samples by
    position; a resume with another tokenizer, transformers, chat template or option that changes the sample set
    would pair them wrongly, and a file copied in from another run's directory would pass its states off as this
    run's. `threads` > 1 may read ahead on that many threads, where reads wait on storage (the same first mismatch is
    found); `on_each()` after each file."""
    def facts_or_error(e: tuple) -> Any:
        try:
            facts = read_facts(e[0])
            if len(e) > 4 and e[4]:  # its bytes are read whole only where there is a digest to compare
                facts.content = file_content_digest(e[0])
            return facts
        except Exception as exc:  # noqa: BLE001 - an unreadable file is not this sample's either
            return exc

    import time
    expected = iter(expected)  # a million samples' tokens are never held at once: read one by one, or a window ahead
    started = time.monotonic()
    head = list(itertools.islice(expected, PROBE_FILES if threads > 1 else 0))
    head_facts = [facts_or_error(e) for e in head]
    waits_on_storage = bool(head) and (time.monotonic() - started) / len(head) > THREADS_PAY_FROM_S
    pool = None
    if waits_on_storage:
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(threads, thread_name_prefix="eagle-compat-check")
        rest = _read_ahead(pool, facts_or_error, expected, 4 * threads)
    else:
        rest = ((e, facts_or_error(e)) for e in expected)
    try:
        return _first_mismatch(itertools.chain(zip(head, head_facts), rest), states, on_each)
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _read_ahead(pool: Any, read: Any, expected: Any, window: int) -> Any:
    """(e, read(e)) in order, at most `window` reads in flight."""
    import collections
    pending: collections.deque = collections.deque()
    for e in expected:
        pending.append((e, pool.submit(read, e)))
        if len(pending) >= window:
            e0, future = pending.popleft()
            yield e0, future.result()
    while pending:
        e0, future = pending.popleft()
        yield e0, future.result()


def _first_mismatch(pairs: Any, states: StatesExpected | None, on_each: Any) -> Mismatch | None:
    for (path, ids, mask, what, *written), facts in pairs:
        if on_each is not None:
            on_each()
        if isinstance(facts, Exception):
            return Mismatch(path, f"{what}: the file cannot be read ({type(facts).__name__}: {facts}); if it is "
                                  "damaged (an interrupted copy), delete it and --resume redoes its batch", False)
        if facts.owner is not None and facts.owner != os.geteuid():  # whatever it holds: no run of this user made it
            return Mismatch(path, f"{what}: the file belongs to {user_named(facts.owner)}, not to this user (uid "
                                  f"{os.geteuid()}), so none of this user's runs wrote it: another user who may "
                                  "write in the folder (its group, or everyone) put it there", True)
        if facts.ids != list(ids):
            return Mismatch(path, f"{what}: the file holds {len(facts.ids)} tokens {facts.ids[:6]}..., the sample "
                                  f"now tokenizes to {len(ids)} tokens {list(ids)[:6]}...", False)
        if facts.mask is not None and mask is not None and facts.mask != list(mask):
            return Mismatch(path, f"{what}: the same tokens, but another loss mask ({sum(facts.mask)} loss tokens "
                                  f"in the file, {sum(mask)} now: the assistant's spans moved)", False)
        why = states.mismatch(facts) if states is not None else None
        if why:
            return Mismatch(path, f"{what}: {why}", True)
        if written and written[0] and facts.content != written[0]:
            return Mismatch(path, f"{what}: its bytes are not those written there (digest {facts.content}; the "
                                  f"index recorded {written[0]}): it was changed since, in place (its size and "
                                  "modification time may have been put back)", True, changed=True)
    return None


# Append-only record of the sample files written, a JSON line each: its sample, size, modification time, inode and
# change time, a digest of the tokens and mask it was written for, the states' stamp, and a digest of the bytes
# written. A --resume (and the completion of a set) trusts a file whose line still matches it instead of opening it
# (1.5-3 ms a file: most of a million-file restart). The inode and change time are what os.utime cannot put back: a
# file edited in place, its size and modification time restored, no longer matches; it is opened, and its bytes are
# compared with the digest (as every kept file's are under --verify-kept). A line cut short by a killed writer is
# skipped, and a line of an earlier release (no inode, change time or digest) vouches for nothing: their files are
# opened and checked as before.
INDEX_FILE = ".eagle-compat-index.jsonl"
SPOOL_FILE = ".eagle-compat-input.bin"  # the tokenized input (spool.py)


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


def any_sample_file(out_dir: str) -> bool:
    """Whether `sample_files` would find any, without listing them all (a set of a million files is seconds of
    listing, and a run asked several times)."""
    if not os.path.isdir(out_dir):
        return False
    for folder in (out_dir, os.path.join(out_dir, "hidden_states")):
        if os.path.isdir(folder):
            with os.scandir(folder) as entries:
                if any(SAMPLE_FILE.match(e.name) for e in entries):
                    return True
    return os.path.exists(os.path.join(out_dir, "state.json"))


def iter_sample_files(out_dir: str) -> Iterator[str]:
    """`sample_files`, in no order and without holding the list (a set of a million files)."""
    if not os.path.isdir(out_dir):
        return
    for folder, prefix in ((out_dir, ""), (os.path.join(out_dir, "hidden_states"), "hidden_states/")):
        if os.path.isdir(folder):
            with os.scandir(folder) as entries:
                for e in entries:
                    if SAMPLE_FILE.match(e.name):
                        yield prefix + e.name
    if os.path.exists(os.path.join(out_dir, "state.json")):
        yield "state.json"


# What speculators' trainers take for sample files in a folder: 0.3.0's (`list_files`, speculators/train/data.py) walks
# it with os.walk, subfolders included, and takes every file whose name ends in "pt" (not only ".pt"); the Arrow
# layout's are safetensors files and the dataset's .arrow files. Such a file under --out that is not one of the set's
# own (a shard folder copied in as a subfolder, a file manager's `data_0 (copy).pt`) would be trained on beside them.
MEMBER_LOOKING_ENDINGS = ("pt", ".safetensors", ".arrow")


def iter_member_looking(out_dir: str) -> Iterator[str]:
    """The paths (relative to `out_dir`, "/"-separated) of the files under it that a trainer would take for sample
    files, and of every `SAMPLE_FILE` name where ours go (the top and hidden_states/), in no order and not held as a
    list (a million files). Walked as os.walk walks (speculators 0.3.0's trainer): hidden folders too, links to
    folders not followed, a folder that cannot be read skipped. Temporary files and folders of writes in progress
    are left out (the next run sweeps them)."""
    folders = [""]
    while folders:
        rel = folders.pop()
        try:
            entries = os.scandir(os.path.join(out_dir, rel))
        except OSError:
            continue
        with entries:
            for e in entries:
                if TEMP_FILE.search(e.name):
                    continue
                try:
                    is_dir = e.is_dir()
                except OSError:
                    is_dir = False
                if is_dir:
                    if not e.is_symlink():
                        folders.append(f"{rel}{e.name}/")
                elif e.name.endswith(MEMBER_LOOKING_ENDINGS) or (
                        rel in ("", "hidden_states/") and SAMPLE_FILE.match(e.name)):
                    yield f"{rel}{e.name}"


def sample_files(out_dir: str) -> list[str]:
    """Sample files of any writer, and an Arrow dataset (its state.json; --format arrow, speculators >= 0.5)."""
    found = list(iter_sample_files(out_dir))
    return (sorted((f for f in found if f.startswith("data") or f.startswith("hs")), key=lambda f: (len(f), f)) +
            sorted((f for f in found if f.startswith("hidden_states/")), key=lambda f: (len(f), f)) +
            (["state.json"] if "state.json" in found else []))


def read_manifest(out_dir: str, mine: bool = False) -> dict | None:
    """The directory's settings record (None where there is none). `mine`: refused where another user owns it (a run
    adding files to the directory trusts it; `report` or a conversion's source may read anyone's)."""
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.isfile(path):
        return None
    if mine and (owner := os.lstat(path).st_uid) != os.geteuid():
        raise OutputDirectoryConflict(
            f"{path} belongs to {user_named(owner)}, not to this user (uid {os.geteuid()}): no run of yours wrote "
            "this record, so the files it describes cannot be trusted (another user who may write in the folder, "
            "its group or everyone, put it there). Choose a folder of your own")
    try:
        with open(path) as f:
            record = json.load(f)
        if not isinstance(record, dict) or not isinstance(record.get("settings"), dict):
            raise ValueError("no 'settings' object")
    except ValueError as exc:
        raise OutputDirectoryConflict(f"{path} is not a readable eagle_compat settings record ({exc}); the files "
                                      "next to it cannot be checked. Choose another --out") from None
    return record


def refuse_foreign_folder(out_dir: str) -> None:
    """Refuse a folder holding entries but no record of an extraction: the user's own files, among which extract's
    record and locks would be written. Reads only."""
    if not os.path.isdir(out_dir) or os.path.exists(os.path.join(out_dir, MANIFEST)):
        return
    others = sorted(n for n in os.listdir(out_dir)
                    if n not in (LOCK_FILE, WRITERS_LOCK, INDEX_FILE, SPOOL_FILE) and not TEMP_FILE.search(n))
    if others and not any_sample_file(out_dir):  # sample files without a record: check_directory says more
        names = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
        raise OutputDirectoryConflict(
            f"--out {out_dir} is not empty and holds no record of an extraction ({MANIFEST}): {len(others)} "
            f"entries ({names}). Give a new or empty folder, or one an earlier extract made")


def check_directory(out_dir: str, settings: dict, may_differ: tuple[str, ...] = ()) -> dict | None:
    """Refuse a directory whose samples were made with other settings, or by a run that left no record.

    Returns the existing record (None for a directory without one and without samples, or whose record describes no
    sample file: a run with other settings may replace it). `may_differ`: settings whose difference the caller
    judges itself (the input's digest, for a --resume with a corrected input: extract/job.py). Reads only."""
    record = read_manifest(out_dir, mine=True)
    if record is None:
        found = sample_files(out_dir)
        if found:
            names = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
            raise OutputDirectoryConflict(
                f"{out_dir} holds {len(found)} sample files ({names}) "
                f"but no settings record ({MANIFEST}): nothing "
                "says which model, data and layers made them, so adding files to them could mix two extractions. "
                "Move them away or choose another --out")
        refuse_foreign_folder(out_dir)
        return None
    diffs = [d for d in settings_differences(record["settings"], settings) if d.split(":")[0] not in may_differ]
    no_files = not any_sample_file(out_dir)
    # its runs wrote nothing and each of them ended (one refused at start-up, say): nothing there to mix with. A run
    # still marked running may be alive where the lock cannot see it (a file system whose locks are per machine).
    if (diffs and no_files and record.get("status") != "running" and
            all(run.get("status") != "running" for run in record.get("runs") or [])):
        return None
    if diffs and [d.split(":")[0] for d in diffs] == ["data_sha256"] and not no_files:
        raise OutputDirectoryConflict(  # the input's bytes alone: a corrected input, which --resume may continue with
            f"{out_dir} holds an extraction of another version of --data ({MANIFEST}):\n  {diffs[0]}\nWhere the "
            "input was corrected since (a line fixed), rerun with --resume: it keeps each file already written whose "
            "sample the input still gives the same tokens, and refuses one it does not, naming it. Otherwise "
            "extract this input into another --out")
    if diffs:
        raise OutputDirectoryConflict(
            f"{out_dir} holds an extraction made with other settings ({MANIFEST}); refusing to add to it, with or "
            "without --resume:\n  " + "\n  ".join(diffs) +
            "\nRerun with the settings above, or choose another --out" +
            (f" (it holds no sample file: if no run is writing it, remove its {MANIFEST})" if no_files else ""))
    return record


# Held shared (flock) by every process other than the driver that writes into the directory (`--ray` actors) for its
# life; a driver waits to take it exclusively before it sweeps temporary files or redoes batches, so a `--resume`
# right after a killed driver cannot overlap the dead driver's orphaned actors still writing.
WRITERS_LOCK = ".eagle-compat-writers.lock"
WRITERS_WAIT_ENV = "EAGLE_COMPAT_WRITERS_WAIT_S"


def hold_as_writer(out_dir: str) -> int:
    """A descriptor holding the directory's writers lock shared (kept for the writer's life; the kernel releases it
    when the process dies)."""
    path = os.path.join(out_dir, WRITERS_LOCK)
    fd = open_no_follow(path, os.O_RDWR | os.O_CREAT)
    flock_or_explain(fd, fcntl.LOCK_SH, path)
    return fd


def wait_for_other_writers(out_dir: str, timeout: float | None = None, on_wait: Any = None) -> float:
    """Block until no other process holds the directory's writers lock (orphaned writers of a dead run end: Ray ends
    a dead driver's actors within seconds); returns the seconds waited. Past `timeout` (default 120 s,
    EAGLE_COMPAT_WRITERS_WAIT_S) raises OutputDirectoryBusy. `on_wait(seconds)` is called on every retry."""
    import time
    timeout = settings.value(WRITERS_WAIT_ENV) if timeout is None else timeout
    path = os.path.join(out_dir, WRITERS_LOCK)
    if not os.path.exists(path):
        return 0.0
    try:  # for writing: on NFS flock is emulated with POSIX locks, whose exclusive lock needs it
        fd = open_no_follow(path, os.O_RDWR)
    except PermissionError:
        fd = open_no_follow(path, os.O_RDONLY)
    start = time.monotonic()
    try:
        while True:
            try:
                flock_or_explain(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, path)
                return time.monotonic() - start
            except OSError as exc:
                if isinstance(exc, OutputWriteError) or exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN,
                                                                          errno.EACCES):
                    raise OutputWriteError(f"cannot lock {path} to check for writers of an earlier run: "
                                           f"{exc.strerror or exc}") from exc
                waited = time.monotonic() - start
                if waited > timeout:
                    raise OutputDirectoryBusy(
                        f"{out_dir} is still being written by processes of an earlier run (they hold {WRITERS_LOCK}: "
                        f"e.g. Ray actors of a driver that was killed) after {timeout:.0f} s; end them (ray stop, or "
                        f"kill the holders: fuser {path}) and rerun, or wait longer ({WRITERS_WAIT_ENV})") from None
                if on_wait is not None:
                    on_wait(waited)
                time.sleep(0.5)
    finally:
        os.close(fd)  # the lock (if taken) goes with it: this run's own writers take it shared next


def sweep_temp_files(out_dir: str) -> list[str]:
    """Temporary files of runs that died mid-write (only the lock holder calls this, so none is in use)."""
    swept = []
    hs_dir = os.path.join(out_dir, "hidden_states")  # --format arrow's sample files
    for d in (out_dir, hs_dir) if os.path.isdir(hs_dir) else (out_dir,):
        for name in os.listdir(d):
            if TEMP_FILE.search(name):
                path = os.path.join(d, name)
                try:
                    if os.path.isdir(path):  # --format arrow's dataset is written in a temporary directory
                        import shutil
                        shutil.rmtree(path)
                    else:
                        os.unlink(path)
                    swept.append(os.path.relpath(path, out_dir))
                except FileNotFoundError:
                    pass
    return swept


def try_flock(path: str, mode: int = 0o644, read_only_ok: bool = False) -> int | None:
    """A descriptor holding an exclusive flock on `path` (created if missing), or None while another process holds
    it. The kernel releases the lock when its holder dies. `read_only_ok`: a file another user made is locked through
    a read-only descriptor (flock allows it)."""
    try:
        fd = open_no_follow(path, os.O_RDWR | os.O_CREAT, mode)
    except PermissionError:
        if not read_only_ok:
            raise
        fd = open_no_follow(path, os.O_RDONLY)
    try:
        flock_or_explain(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, path)
    except OSError as exc:
        os.close(fd)
        if isinstance(exc, OutputWriteError) or exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        return None
    return fd


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


# errno values a filesystem without flock answers with (Lustre mounted without -o flock: ENOSYS; NFS without a lock
# manager: ENOLCK)
NO_FLOCK = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


def mount_of(path: str) -> tuple[str, str, str]:
    """(mount point, filesystem type, options) of the mount holding `path`, from /proc/mounts ("?" where unknown):
    the longest mount point that contains it."""
    best, best_point = ("?", "?", "?"), ""
    try:
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 4:
                    continue
                point = parts[1].replace("\\040", " ")
                inside = point == "/" or real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best_point):
                    best, best_point = (point, parts[2], parts[3]), point
    except OSError:
        pass
    return best


def flock_or_explain(fd: int, operation: int, path: str) -> None:
    """fcntl.flock, with a filesystem that has no flock named (mount, type) and the way out, instead of a raw
    OSError: every guarantee about one writer per folder rests on it."""
    try:
        fcntl.flock(fd, operation)
    except OSError as exc:
        if exc.errno not in NO_FLOCK:
            raise
        point, fstype, options = mount_of(path)
        raise OutputWriteError(
            f"cannot lock {path}: the filesystem has no flock ({fstype} mounted at {point}, options {options}; "
            f"{exc.strerror or exc}). eagle_compat's one-writer-per-folder guarantee needs it: mount with flock "
            "support (Lustre: -o flock), or write --out to a filesystem that has it (a local disk) and copy the "
            "finished folder") from None


# filesystems whose flock, as mounted, holds on one machine only: two machines can each take it
LOCAL_ONLY_LOCKS = {"beegfs": "BeeGFS takes flock per client unless tuneUseGlobalFileLocks is set",
                    "lustre:localflock": "Lustre mounted with localflock takes flock per client"}


def lock_scope_note(path: str) -> str | None:
    """Where locks on `path` hold on this machine only, what that means for --shard across machines (else None)."""
    _, fstype, options = mount_of(path)
    why = LOCAL_ONLY_LOCKS.get(fstype) or (
        LOCAL_ONLY_LOCKS["lustre:localflock"] if fstype == "lustre" and "localflock" in options.split(",") else None)
    if why is None:
        return None
    return (f"{path} is on {fstype} ({why}): the one-writer lock does not hold across machines, so run each --shard "
            "of one folder on one machine, or give each machine its own --out and merge them (README)")


def user_named(uid: int) -> str:
    """'user NAME (uid N)', or 'uid N' where the system knows no name for it."""
    try:
        import pwd
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def refuse_others_folder(path: str, what: str = "--out") -> None:
    """A folder this run writes must be the user's own: not another user's (who could plant links or files there),
    not writable by every user unless sticky (where anyone could replace its files). A folder its group may write
    (a team's project folder, or umask 002) is taken, and so is one under a folder others may write (which could
    swap it for theirs): in it a run trusts only this user's files (the record, the index, the tokenized input, each
    sample file it keeps; `user_named` names the owner of any other), so another user can remove files but never
    have theirs taken for this run's."""
    import stat
    st = os.stat(path)
    me = os.geteuid()
    if st.st_uid != me:
        try:
            import pwd
            owner = pwd.getpwuid(st.st_uid).pw_name
        except (KeyError, ImportError):
            owner = str(st.st_uid)
        raise OutputDirectoryConflict(
            f"{what} {path!r} belongs to another user ({owner}, uid {st.st_uid}; you are uid {me}): they could "
            "plant links or files there that this run would write through or train on. Choose a folder of your own")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise OutputDirectoryConflict(
            f"{what} {path!r} is writable by every user (mode {stat.S_IMODE(st.st_mode):o}) without the sticky bit: "
            f"anyone could replace its files. chmod o-w {path}, or choose another folder")


# The lock is held twice. On --out itself (flock on a descriptor of the folder): a clean-up of files (`rm *.lock`)
# cannot remove a folder that holds files, so a second run is refused for as long as the first lives. And on
# `.eagle-compat.lock`, which earlier releases lock (a run of either kind refuses the other) and which holds across
# the machines of a network file system (NFS locks a folder per machine only). That file's lock counts only while the
# file is at its path: a run whose lock file was removed or replaced stops at its next batch (`check_lock_held`),
# since a run on another machine, or of an earlier release, may have made and locked a new one.
LOCK_ATTEMPTS = 5


class LockFileRemoved(OutputDirectoryBusy):
    """The run's `.eagle-compat.lock` was removed or replaced while the run held it."""
    run_failed = True


def is_file_at(fd: int, path: str) -> bool:
    """Whether the open file `fd` is the one at `path` (a link at `path` is not followed: it is another file)."""
    try:
        at_path = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (at_path.st_dev, at_path.st_ino)


_HELD_LOCKS: dict[str, "DirectoryLock"] = {}  # this process's locks, by the folder's real path


def check_lock_held(out_dir: str) -> None:
    """Raises LockFileRemoved where this process holds `out_dir`'s lock and its lock file is no longer at its path;
    the runners call it before each batch's files are written."""
    lock = _HELD_LOCKS.get(os.path.realpath(out_dir))
    if lock is not None:
        lock.check_held()


class DirectoryLock:
    """One writer per output directory: flock on the folder and on `.eagle-compat.lock`, released by the kernel if
    the run dies."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, LOCK_FILE)
        self.fd: int | None = None
        self.folder_fd: int | None = None

    def busy(self) -> OutputDirectoryBusy:
        return OutputDirectoryBusy(f"{os.path.dirname(self.path) or '.'} is being written by another run "
                                   f"({self.holder()}); two runs writing one directory could mix their files. "
                                   "Wait for it to finish, or choose another --out")

    def __enter__(self) -> "DirectoryLock":
        self.folder_fd = self._lock_folder()
        try:
            fd = self._lock_file_at_path()
        except BaseException:
            self._release()
            raise
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": datetime.now(timezone.utc).isoformat()}).encode())
        self.fd = fd
        _HELD_LOCKS[os.path.realpath(self.out_dir)] = self
        return self

    def _lock_folder(self) -> int | None:
        """A descriptor of the folder holding its flock; None on a file system that locks no folder (the lock
        file's lock and `check_held` remain)."""
        fd = os.open(self.out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise self.busy() from None
            if exc.errno in (*NO_FLOCK, errno.EBADF):
                return None
            raise
        return fd

    def _lock_file_at_path(self) -> int:
        """The lock file's descriptor, locked, and the file at its path: one removed or replaced between its open and
        its flock is let go and the one at the path taken instead."""
        for _ in range(LOCK_ATTEMPTS):
            fd = try_flock(self.path)
            if fd is None:
                raise self.busy() from None
            if is_file_at(fd, self.path):
                return fd
            os.close(fd)
        raise OutputDirectoryBusy(f"{self.path} was removed or replaced each of the {LOCK_ATTEMPTS} times this run "
                                  "locked it: another process keeps removing it. Stop that process (a clean-up of "
                                  "*.lock files?) and run again, or choose another --out")

    def check_held(self) -> None:
        if self.fd is None or is_file_at(self.fd, self.path):
            return
        raise LockFileRemoved(
            f"{self.path} was removed or replaced while this run held it (a clean-up of *.lock files?): a run on "
            "another machine, or of an earlier release, may now write this directory too. This run stopped before "
            "writing more; its files so far are complete. When no other run writes it, rerun the same command "
            "with --resume")

    def holder(self) -> str:
        try:
            with open(self.path) as f:
                info = json.load(f)
            return f"pid {info['pid']} on {info['host']}, since {info['since']}"
        except FileNotFoundError:
            return (f"holder unknown: its {LOCK_FILE} was removed; `fuser -v {os.path.dirname(self.path) or '.'}` "
                    "lists the processes that have the folder open")
        except (OSError, ValueError, KeyError):
            return "holder unknown"

    def _release(self) -> None:
        for fd in (self.fd, self.folder_fd):
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
        self.fd = self.folder_fd = None

    def __exit__(self, *exc: Any) -> None:
        if _HELD_LOCKS.get(os.path.realpath(self.out_dir)) is self:
            del _HELD_LOCKS[os.path.realpath(self.out_dir)]
        self._release()


# Settings recorded since a release after sets were begun without them, with the value those sets were made with
# (an earlier release recorded no --trust-remote-code: it is taken as off, its default)
SETTINGS_ADDED_SINCE = {"trust_remote_code": False, "loss_mask": "generated"}


def settings_differences(old: dict, new: dict) -> list[str]:
    """One line per setting that differs (a setting one record lacks differs: it was made by another release; but
    for those of SETTINGS_ADDED_SINCE, whose value it then had is known)."""
    def value(settings: dict, k: str) -> Any:
        return settings.get(k, SETTINGS_ADDED_SINCE.get(k))
    return [f"{k}: was {value(old, k)!r}, now {value(new, k)!r}" for k in sorted(set(old) | set(new))
            if value(old, k) != value(new, k)]


def validate_sample(sample: dict, vocab_size: int, layer_count: int, hidden_size: int | None) -> None:
    """`--validate`: a sample's ids, mask and states have the shapes and values the settings promise."""
    import torch

    ids, mask, hs = sample["input_ids"], sample["loss_mask"], sample["hidden_states"]
    t = ids.shape[0]
    problems = []
    if ids.dtype != torch.long or ids.min() < 0 or (vocab_size and ids.max() >= vocab_size):
        problems.append("token ids outside the vocabulary")
    if mask.shape[0] != t or not bool(((mask == 0) | (mask == 1)).all()):
        problems.append("loss mask is not 0/1 of the sequence length")
    if len(hs) != layer_count:
        problems.append(f"{len(hs)} hidden-state tensors for {layer_count} layers")
    for k, h in enumerate(hs):
        if h.shape[0] != t or (hidden_size and h.shape[-1] != hidden_size):
            problems.append(f"hidden_states[{k}] has shape {tuple(h.shape)}, expected [{t}, {hidden_size}]")
        if not bool(torch.isfinite(h).all()):
            problems.append(f"hidden_states[{k}] has NaN or Inf")
    if problems:
        raise InvalidSample("--validate: " + "; ".join(problems) + "; nothing of this sample was written")
