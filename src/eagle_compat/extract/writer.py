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

import hashlib
import itertools
import json
import os
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

from ..errors import EagleCompatError, OutputDirectoryConflict
from .atomic_io import (DigestingFile, WrittenFile, atomic_write_bytes, atomic_write_file, content_digest,
                        file_content_digest)
from .directory_lock import LOCK_FILE, WRITERS_LOCK, user_named
from .written_index import INDEX_FILE

MANIFEST = "manifest.json"
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
                through = DigestingFile(f)
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


def load_sample(path: str) -> dict:
    import torch

    if path.endswith(".pt"):
        return torch.load(path, weights_only=True, map_location="cpu")
    from safetensors.torch import load_file

    t = load_file(path)
    n = len([k for k in t if k.startswith("hidden_states.")])
    return {"input_ids": t["input_ids"], "loss_mask": t["loss_mask"],
            "hidden_states": [t[f"hidden_states.{k}"] for k in range(n)]}


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


SPOOL_FILE = ".eagle-compat-input.bin"  # the tokenized input (spool.py)


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
