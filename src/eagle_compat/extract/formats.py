"""Output formats: one object per `--format`, used by every path that writes training files (the local runner, the
`--ray` actors, `convert`), so a format is decided in one place: where a sample's file goes, how it is saved, what a
whole set needs before a trainer may open it, and what the manifest says of it.

  pt, safetensors      speculators 0.3.0's files: data_{i}.pt / .safetensors, `i` the sample's index in the input
                       (writer.py); a whole set gets data_config.json
  arrow, arrow-fp8     speculators 0.8-0.9's layout: hidden_states/hs_{r}.safetensors, `r` the sample's row (its rank
                       among the indices present); a whole set gets the Arrow dataset of ids and masks (arrow.py)
"""
from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Sequence

from .. import detect
from ..errors import InvalidInput
from . import arrow, atomic_io, writer, written_index


@dataclass(frozen=True)
class Placed:
    """A sample and where its file goes: its input index (pt, safetensors), its row (arrow: its rank among the indices
    present), the input line it came from (for messages)."""
    index: int
    row: int
    line: int
    input_ids: Sequence[int]  # the sample's own arrays (inputs.Sample): no copy
    loss_mask: Sequence[int]


@dataclass(frozen=True)
class DataDescription:
    """What speculators' data_config.json says of a whole set (the run's model, data and engine settings)."""
    model: str
    data: str | None
    layer_ids: list[int]
    hidden_size: int
    num_samples: int
    max_len: int | None
    versions: dict
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.8
    command: str = ""


class _Layout:
    """What every format's whole set must be before the run that completes it writes what a trainer opens."""
    arrow: bool
    finishes: str  # what a whole set gets
    finishes_sentence: str  # the same, starting a sentence
    holds = "its sample"  # what each file must hold

    def __init__(self, name: str):
        self.name = name

    def path(self, out: str, index: int, row: int) -> str:
        raise NotImplementedError

    def expected(self, out: str, index: int, row: int, ids: list[int], mask: list[int], what: str) -> tuple:
        """(path, token ids, loss mask or None, what names the sample), as writer.first_mismatch reads it."""
        raise NotImplementedError

    def check_whole_set(self, out: str, placed: Iterable[tuple[int, int, Sequence[int], Sequence[int], str]],
                        states: writer.StatesExpected | None = None, known: Container = frozenset(),
                        left_out: dict[int, int] | None = None, on_each: Any = None,
                        members: Members | None = None) -> None:
        """Every file of the set (other shards' and runs' included: copied in, say) must hold its sample's tokens
        (and mask, where the file keeps it) and states made as this run's, and no other sample file may be there
        (speculators 0.3.0 trains on every .pt under its folder; Arrow rows bind files by position). `placed`: (index,
        row, token ids, loss mask, what names the sample[, the digest of the bytes written to its file]), read once;
        `known`: indices whose files this run wrote or already checked; `members`: the set's samples, where `placed`
        is not all of them (a list is); `on_each()` after each file read."""
        if members is None:
            placed = list(placed)
            members = Members.of(placed)
        refuse_strays(self, out, members, f"{self.finishes_sentence} is not written", left_out)
        wrong = writer.first_mismatch(((*self.expected(out, index, row, ids, mask, what), *written)
                                       for index, row, ids, mask, what, *written in placed if index not in known),
                                      states, on_each=on_each)
        if wrong:
            raise writer.OutputDirectoryConflict(whole_set_refusal(wrong, self.finishes_sentence, self.holds))


class SampleFiles(_Layout):
    """speculators 0.3.0's layout: one file per sample, named by its input index."""
    arrow = False
    manifest_notes: dict = {}
    finishes = finishes_sentence = "data_config.json"

    def path(self, out: str, index: int, row: int) -> str:
        return writer.sample_path(out, index, self.name)

    def save(self, out: str, index: int, row: int, input_ids: Any, loss_mask: Any, hidden_states: list,
             layer_ids: list[int] | None = None, stamp: str | None = None) -> str:
        if getattr(hidden_states, "dim", lambda: 0)() == 3:  # [T, L, H]: one tensor per layer, each its own storage
            hidden_states = [h.clone() for h in hidden_states.unbind(1)]  # (a view would save the whole [T, L, H])
        return writer.save_sample(out, index, {"input_ids": input_ids, "hidden_states": list(hidden_states),
                                               "loss_mask": loss_mask}, self.name, layer_ids, stamp)

    def expected(self, out: str, index: int, row: int, ids: list[int], mask: list[int], what: str) -> tuple:
        return self.path(out, index, row), ids, mask, what

    def finish(self, out: str, rows: Iterable[tuple[list[int], list[int]]], description: DataDescription) -> None:
        """The set is whole: describe it for speculators' trainer (whichever run finished it)."""
        atomic_io.atomic_write_json(os.path.join(out, "data_config.json"), speculators_data_config(self.name,
                                                                                               description))


class ArrowLayout(_Layout):
    """speculators 0.8-0.9's layout: per-row hidden-state files, and one Arrow dataset for the whole set."""
    arrow = True
    finishes, finishes_sentence = "the Arrow dataset", "The Arrow dataset"
    holds = "its row's sample"
    manifest_notes = {"arrow_rows": "row r of the Arrow dataset and hidden_states/hs_{r}.safetensors hold the r-th "
                                    "smallest sample index present (indices count the input's non-blank lines from 0; "
                                    "those in skipped_uncovered have no row)"}

    def path(self, out: str, index: int, row: int) -> str:
        return arrow.hs_path(out, row)

    def save(self, out: str, index: int, row: int, input_ids: Any, loss_mask: Any, hidden_states: Any,
             layer_ids: list[int] | None = None, stamp: str | None = None) -> str:
        return arrow.save_hs(out, row, input_ids, hidden_states, self.name, layer_ids, stamp)

    def expected(self, out: str, index: int, row: int, ids: list[int], mask: list[int], what: str) -> tuple:
        return self.path(out, index, row), ids, None, f"row {row} ({what})"  # masks are the Arrow rows'

    def finish(self, out: str, rows: Iterable[tuple[list[int], list[int]]], description: DataDescription) -> None:
        """The dataset `ArrowDataset` opens, written only for a whole set: before it the directory cannot be opened,
        so a partial set is never mistaken for a whole one."""
        arrow.write_dataset(out, rows)


@dataclass(frozen=True)
class Members:
    """Which samples a set has, without a list of them: `count` samples, `has_index(i)` whether input index i is
    one, `has_row(r)` whether row r is one's (rows left out leave gaps)."""
    count: int
    has_index: Callable[[int], bool]
    has_row: Callable[[int], bool]

    @classmethod
    def of(cls, placed: list) -> "Members":
        """From (index, row, ...) tuples or `Placed`s."""
        pairs = [(p.index, p.row) if isinstance(p, Placed) else (p[0], p[1]) for p in placed]
        indices, rows = frozenset(i for i, _ in pairs), frozenset(r for _, r in pairs)
        return cls(len(indices), indices.__contains__, rows.__contains__)


def refuse_strays(fmt: _Layout, out: str, members: Members, finishes: str,
                  left_out: dict[int, int] | None = None) -> None:
    """A file under `out` that a trainer would take for a sample file but that stands for no sample of the set
    (copied in from a larger set, another format's, of a sample the input now leaves out, or a copy under another
    name or in a subfolder) would be trained on or mistaken for part of it. `left_out`: index -> input line of the
    samples the set leaves out. A file's name is read as the number it carries (an index, or a row for Arrow) and
    must be the name this set gives that number (nothing is listed per sample: a million)."""
    strays = sorted((name for name in writer.iter_member_looking(out) if not is_own_name(fmt, out, name, members)),
                    key=lambda f: (len(f), f))
    if not strays:
        return
    name, others = strays[0], strays[1:]
    listed = ": " + ", ".join(others[:3]) + (", ..." if len(others) > 3 else "") if others else ""
    more = f"(and {len(others)} more{listed})"
    number = number_in_name(name)
    if number is None:
        in_subfolder = any(n.count("/") > n.startswith(f"{arrow.HS_DIR}/") for n in strays)
        raise writer.OutputDirectoryConflict(
            f"{os.path.join(out, name)} {more} is not a file of this set, but a trainer would take it for one: "
            f"{trainer_takes(name)}. Move {'them' if others else 'it'} out of {out}"
            + (" (a shard's folder is merged by copying its files to the same places here, not the folder into a "
               "subfolder)" if in_subfolder else "") + f", then rerun with --resume. {finishes}")
    why = (f"input line {left_out[number]} is now left out (--skip-uncovered / --min-loss-tokens), but an earlier "
           "run wrote its file: the samples tokenize differently than they did then"
           if not fmt.arrow and number in (left_out or {}) else
           f"the input has {members.count} samples, their files named by "
           f"{'row' if fmt.arrow else 'index'}; copied in from a larger set or another format?")
    raise writer.OutputDirectoryConflict(
        f"{os.path.join(out, name)} {more} stands for no sample of this set: {why}. A trainer "
        f"would read it as part of the set: remove it. {finishes}")


NUMBERED_NAME = re.compile(r"^(?:hidden_states/)?(?:data|hs)_(\d+)\.[A-Za-z0-9]+$")


def number_in_name(name: str) -> int | None:
    """The number a sample file's name gives it, where ours go (the top, hidden_states/); None for any other name."""
    match = NUMBERED_NAME.match(name)
    return int(match.group(1)) if match else None


def is_own_name(fmt: _Layout, out: str, name: str, members: Members) -> bool:
    """Whether `name` (relative to `out`) is the name of one of the set's files: a member's sample file, or (Arrow)
    a data file of the set's dataset, which the run completing the set writes anew."""
    if fmt.arrow and arrow.DATASET_FILE.match(name):
        return True
    number = number_in_name(name)
    if number is None or not (members.has_row(number) if fmt.arrow else members.has_index(number)):
        return False
    return fmt.path(out, number, number)[len(os.path.join(out, "")):] == name  # a path takes the index or the row


def trainer_takes(name: str) -> str:
    """Why a trainer would read the file `name` as part of the set."""
    if name.endswith("pt"):
        return ("speculators 0.3.0's trainer reads every file under the folder whose name ends in \"pt\", subfolders "
                "included, and would train on it beside the set's own")
    return ("it is named as a sample file or an Arrow data file, and a tool that collects such files under the "
            "folder (a trainer, a merge or a conversion of it) would read it as part of the set")


def not_the_sets_by_name(fmt: _Layout, out: str) -> list[str]:
    """The files under `out` a trainer would take for sample files whose names no file of this layout has (in a
    subfolder, a copy under another name), in name order; a report reads them without the set's members."""
    anyone = Members(0, lambda index: True, lambda row: True)
    return sorted((name for name in writer.iter_member_looking(out)
                   if number_in_name(name) is None and not is_own_name(fmt, out, name, anyone)),
                  key=lambda f: (len(f), f))


def whole_set_refusal(wrong: writer.Mismatch, finishes: str, holds: str = "its sample") -> str:
    not_written = f"{finishes} is not written"
    if wrong.changed:
        return (f"{wrong.path} was changed since a run of this directory wrote it: {wrong.why}. A trainer would read "
                "states no run made for it: delete it, and a --resume of the shard that wrote it (or of the whole "
                f"set, without --shard) redoes its batch. {not_written}")
    if wrong.states:
        return (f"{wrong.path} does not belong to this set: {wrong.why}. Shards merge only between runs of the same "
                f"model, --layers, --dtype and --trust-remote-code, of this user; remove the files of other runs. "
                f"{not_written}")
    return (f"{wrong.path} does not hold {holds}: {wrong.why}; the shards of this directory were made from differing "
            f"sample sets (another tokenizer, transformers version or option). {not_written}")


def training_sample(result: dict, loss_mask: Any) -> dict:
    """What a training file holds for a sample (and what the online iterable yields): the engine's ids and states,
    the input's loss mask as a LongTensor."""
    import torch
    return {"input_ids": result["input_ids"], "hidden_states": result["hidden_states"],
            "loss_mask": torch.as_tensor(loss_mask, dtype=torch.long)}


def write_sample(fmt: SampleFiles | ArrowLayout, out: str, s: Placed, result: dict, layer_ids: list[int], *,
                 data: str, validate: bool, vocab_size: int, hidden_size: int, stamp: str | None = None) -> str:
    """The one sample writer of every runner (local, Ray actors): the engine's result for a placed sample, checked
    (`--validate`), saved atomically in the run's format. A non-finite sample is refused naming its input line; an
    OSError is the caller's to word (it knows what was written before)."""
    sample = training_sample(result, s.loss_mask)
    try:
        if validate:
            writer.require_finite(s.index, sample["hidden_states"], layer_ids)  # its own message, as without
            writer.validate_sample(sample, vocab_size, len(layer_ids), hidden_size)
        path = fmt.save(out, s.index, s.row, sample["input_ids"], sample["loss_mask"], sample["hidden_states"],
                        layer_ids, stamp)
        if stamp is not None:  # what a --resume trusts without opening the file (written_index.INDEX_FILE)
            _, ids, mask, _ = fmt.expected(out, s.index, s.row, s.input_ids, s.loss_mask, "")
            written_index.index_written(out, s.index, path, ids, mask, stamp, getattr(path, "content", None))
        return path
    except (writer.NonFiniteStates, writer.DegenerateStates, writer.InvalidSample) as exc:
        raise type(exc)(f"{data}:{s.line}: {exc}") from None


def left_out_entry(s: Placed, exc: BaseException) -> dict:
    """The record of a sample --skip-non-finite left out: its index and input line, what was found, and the digest
    of its tokens ("d": a --resume with a corrected input keeps it out only where its tokens are unchanged)."""
    return {"index": s.index, "line": s.line, "why": str(exc).split("; nothing of this sample")[0][:300],
            "d": written_index.tokens_digest(s.input_ids, s.loss_mask)}


FORMATS: dict[str, SampleFiles | ArrowLayout] = {
    "pt": SampleFiles("pt"), "safetensors": SampleFiles("safetensors"),
    "arrow": ArrowLayout("arrow"), "arrow-fp8": ArrowLayout("arrow-fp8")}


def get(name: str, option: str = "--format") -> SampleFiles | ArrowLayout:
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise InvalidInput(f"{option} {name!r}; allowed: {', '.join(FORMATS)}") from None


def speculators_data_config(fmt: str, d: DataDescription) -> dict:
    """data_config.json in the shape speculators 0.3.0's data-generation script writes it (version 2.0)."""
    return {
        "version": "2.0", "generated_at": datetime.now(timezone.utc).isoformat(),
        "speculators_version": d.versions.get("speculators"),
        "reproducibility": {"command": d.command or " ".join(["eagle-compat", *sys.argv[1:]]),
                            "package_versions": {k: d.versions.get(k) for k in ("torch", "vllm", "transformers",
                                                                               "speculators")},
                            "gpu": "CPU only" if not detect.feature("cuda_available") else "cuda"},
        "model": {"target_model_path": d.model, "tensor_parallel_size": d.tensor_parallel_size,
                  "gpu_memory_utilization": d.gpu_memory_utilization, "hidden_size": d.hidden_size},
        "data": {"train_data_path": d.data, "seq_length": d.max_len, "max_samples": None,
                 "num_samples": d.num_samples, "seed": 0,
                 "chat_template_note": "Uses tokenizer's built-in chat template"},
        "hidden_states": {"layer_ids": d.layer_ids,
                          "description": "Layers selected for EAGLE3 fusion and target logits"},
        "generation": {"cache_dir": ""},
        "format": {"file_pattern": "data_{idx}.pt" if fmt == "pt" else "data_{idx}.safetensors",
                   "data_format_version": 1,
                   "schema": {"input_ids": {"dtype": "torch.long", "shape": "[seq_len]"},
                              "hidden_states": {"shape": f"list of [seq_len, {d.hidden_size}]",
                                                "num_tensors": len(d.layer_ids)},
                              "loss_mask": {"dtype": "torch.long", "shape": "[seq_len]"}}},
    }


class SetReader:
    """A whole set of one format, read one sample at a time (`convert`): its files by (index, row)."""

    def __init__(self, fmt: SampleFiles | ArrowLayout, src: str):
        self.fmt, self.src = fmt, src
        self.rows = arrow.read_rows(src) if fmt.arrow else None  # memory-mapped ids and masks

    def check_rows(self, count: int) -> None:
        if self.rows is not None and len(self.rows) != count:
            raise InvalidInput(f"{self.src}: its Arrow dataset has {len(self.rows)} rows, its manifest {count} "
                               "samples; the directory is not one extraction")

    def sample(self, index: int, row: int) -> tuple[Any, Any, Any]:
        """(input ids, loss mask, states [T, L, H]) of one sample."""
        import torch

        path = self.fmt.path(self.src, index, row)
        if self.rows is None:
            s = writer.load_sample(path)
            return s["input_ids"], s["loss_mask"], torch.stack(list(s["hidden_states"]), dim=1)
        hs, dataset_row = arrow.load_hs(path), self.rows[row]
        if hs["token_ids"].tolist() != list(dataset_row["input_ids"]):
            raise InvalidInput(f"{self.src}: {os.path.basename(path)}' token ids differ from row {row} of the Arrow "
                               "dataset; the directory is not one extraction")
        return hs["token_ids"], torch.tensor(dataset_row["loss_mask"], dtype=torch.long), hs["hidden_states"]

    def ids_and_mask(self, index: int, row: int) -> tuple[list[int], list[int]]:
        """Without the states (memory-mapped)."""
        if self.rows is not None:
            r = self.rows[row]
            return list(r["input_ids"]), list(r["loss_mask"])
        ids, mask = writer.token_ids_in(self.fmt.path(self.src, index, row))
        return ids, mask
