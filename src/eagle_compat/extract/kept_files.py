"""The files a set already holds, checked before a run adds to it: the index vouches for those written for these tokens
and unchanged since, the others are opened; a corrected input is taken only where every kept file holds the sample it
now gives."""
from __future__ import annotations

import os
import sys
from array import array
from datetime import datetime, timezone

from . import formats, placement, stages, writer, written_index
from .record import Manifest
from .run_plan import RunPlan


def read_index(p: RunPlan, stamp: str | None, wanted: bytearray | None = None) -> written_index.IndexVerdicts:
    """For each row of the set (those `wanted` marks, or all), what the directory's index says of its file: vouched
    for (written by one of its runs for these tokens, unchanged since: name, size, times, inode), and else the digest
    of the bytes such a run wrote there, to compare once the file is opened. The index's lines are read in the order
    written, the last of a sample deciding (a batch redone wrote it again); a sample's tokens are read only where a
    line is of its file. Nothing is vouched for under --verify-kept (every file is opened, and its bytes compared)."""
    verdicts = written_index.IndexVerdicts(len(p.placed))
    for entry in written_index.index_entries(p.out):
        row = p.placed.position_of(entry["i"])
        if row is None or (wanted is not None and not wanted[row]):
            continue
        verdicts.forget(row)
        path = p.path_at(entry["i"], row)
        if not written_index.entry_names_file(entry, p.out, path, stamp):
            continue
        unchanged = not p.opts.verify_kept and written_index.entry_matches_file(entry, p.out, path, stamp)
        if unchanged or entry.get("h"):
            s = p.placed[row]
            _, ids, mask, _ = p.fmt.expected(p.out, s.index, s.row, s.input_ids, s.loss_mask, "")
            if entry.get("d") == written_index.tokens_digest(ids, mask):  # a line of other tokens: the file is opened
                verdicts.note(row, unchanged, entry.get("h"))
    return verdicts


def todo_and_kept(p: RunPlan, non_finite: dict) -> tuple[placement.Batches, placement.Batches]:
    """This shard's batches to do and those kept: a batch with every file (or left out for non-finite states) is
    kept, any other redone whole. A set whose input is still being read is new: all of its batches are to do."""
    if p.streaming:
        return p.mine, p.mine.select(())
    whole = [all(index in non_finite or os.path.exists(p.path_at(index, row)) for index, row in p.mine.places(j))
             for j in range(len(p.mine))]
    return (p.mine.select([j for j, done in enumerate(whole) if not done]),
            p.mine.select([j for j, done in enumerate(whole) if done]))


def still_non_finite(p: RunPlan, non_finite: dict[int, dict]) -> dict[int, dict]:
    """Under a corrected input, the samples left out for non-finite states that stay out: those the input still gives
    the tokens they had when left out ("d"). Any other (its line changed, or an entry of an earlier release, which
    recorded no digest) is redone: its states were never judged for its tokens now."""
    still = {}
    for index, entry in non_finite.items():
        row = p.placed.position_of(index)
        s = p.placed[row] if row is not None else None
        if s is not None and entry.get("d") == written_index.tokens_digest(s.input_ids, s.loss_mask):
            still[index] = entry
    return still


def check_corrected_input(p: RunPlan, non_finite: dict, states: writer.StatesExpected) -> int:
    """Under a corrected input, every sample file already in --out (any batch's, any shard's) must hold the tokens the
    input now gives its sample, before anything is written: the index vouches for a file written for these tokens and
    unchanged since, any other is opened. A file whose line changed after it was written is refused, naming it (its
    states are of the line as it was). Returns how many files were there."""
    present = bytearray(len(p.placed))
    for index, row in p.every_place(non_finite):
        present[row] = os.path.exists(p.path_at(index, row))
    verdicts = read_index(p, states.stamp, present)
    to_read = array("q", (row for row, there in enumerate(present) if there and not verdicts.vouched[row]))
    with stages.counting("corrected input: files already written read", len(to_read), "file") as read:
        wrong = writer.first_mismatch(p.placed.files_at(p.fmt, p.out, to_read, verdicts), states, on_each=read.add)
    if wrong:
        raise writer.OutputDirectoryConflict(
            f"{wrong.path} is not the sample the corrected input gives there: {wrong.why}. --data differs from the "
            f"input the set's record names (SHA-256 {p.input_corrected_from[:16]}..., now "
            f"{p.settings['data_sha256'][:16]}...), and a file of a line changed after it was written holds the "
            "states of the line as it was. Delete it (--resume then redoes its batch), or extract this input into a "
            "new --out. Nothing was written")
    return sum(present)


def record_correction(p: RunPlan, manifest: Manifest, record: dict | None, non_finite: dict,
                       files: int) -> None:
    """A --resume with a corrected input, said and recorded: the set's settings name the input's digest now, and
    `input_corrections` the one they named before; the samples left out for non-finite states are those still out."""
    redone = len((record or {}).get("left_out_non_finite") or []) - len(non_finite)
    redone_note = (f"; {stages.plural(redone, 'sample')} left out for non-finite states "
                   f"{'is' if redone == 1 else 'are'} redone (the input changed them)") if redone else ""
    print(f"extract: NOTE: --data {p.opts.data} is not the input the set's record names (its SHA-256 was "
          f"{p.input_corrected_from[:16]}..., now {p.settings['data_sha256'][:16]}...): the set goes on with it as a "
          f"corrected input, since each of the {files:,} files already written holds the tokens it gives their "
          f"samples{redone_note}; manifest.json records it (input_corrections)", file=sys.stderr, flush=True)
    manifest["settings"] = {**manifest["settings"], "data_sha256": p.settings["data_sha256"]}
    manifest.setdefault("input_corrections", []).append({
        "data_sha256_was": p.input_corrected_from, "data_sha256": p.settings["data_sha256"],
        "at": datetime.now(timezone.utc).isoformat(), "files_kept": files, "non_finite_redone": redone})
    if non_finite:
        manifest["left_out_non_finite"] = sorted(non_finite.values(), key=lambda e: e["index"])
    else:
        manifest.pop("left_out_non_finite", None)


def states_expected(p: RunPlan, record: dict | None, first_kept: str | None) -> writer.StatesExpected:
    """What every file must hold besides its tokens: the run's stamp, layers, hidden size, and the engine's dtype as
    the set's record (or, for an earlier release's record, its first kept file) says, known before this run's
    engine starts (and refused if it differs). A set converted from fp8 holds bfloat16 whatever its engine ran."""
    recorded_dtype = (record or {}).get("states_dtype") or (record or {}).get("engine_dtype")
    dtype_from = "the directory's engine ran"
    if not recorded_dtype and first_kept:
        try:
            recorded_dtype = writer.read_facts(first_kept).dtype
            dtype_from = f"{os.path.basename(first_kept)} (the record names none) holds"
        except Exception:  # noqa: BLE001 - an unreadable file is named by the kept-file check
            recorded_dtype = None
    # every file of a set begun by this release carries a stamp (an earlier record cannot say: a set begun before
    # stamps and resumed since holds both kinds)
    stamped = record is None or bool(record.get("stamped_files"))
    return writer.StatesExpected(writer.states_stamp(p.settings), len(p.layer_ids), p.hidden_size, recorded_dtype,
                                 dtype_from, stamped=stamped)


def check_kept(p: RunPlan, kept: placement.Batches, non_finite: dict, states: writer.StatesExpected,
                record: dict | None, todo: placement.Batches) -> None:
    """The files kept must be of these very samples (their token ids) and made as this run's would be; the index
    vouches for those the directory's runs wrote, unchanged since: only the others are opened (every one, on
    several threads, with --verify-kept), and their bytes compared with the digest the index recorded of them. No
    stray file of another set, and no extracting into a lossy conversion."""
    opts = p.opts
    kept_rows = bytearray(len(p.placed))
    for _, row in kept.all_places():
        kept_rows[row] = 1
    index = read_index(p, states.stamp, kept_rows) if len(kept) else written_index.IndexVerdicts(0)
    del kept_rows
    to_read = array("q", (row for i, row in kept.all_places() if i not in non_finite and not index.vouched[row]))
    with stages.counting("resume check: kept files read", len(to_read), "file") as read:
        wrong = writer.first_mismatch(p.placed.files_at(p.fmt, opts.out, to_read, index), states,
                                      threads=8 if opts.verify_kept else 1, on_each=read.add)
    if wrong and wrong.changed:
        raise writer.OutputDirectoryConflict(
            f"{wrong.path} was changed since a run of this directory wrote it: {wrong.why}. A trainer would read "
            "states no run made for it: delete it, and --resume redoes its batch. Nothing was written")
    if wrong and wrong.states:
        raise writer.OutputDirectoryConflict(
            f"{wrong.path} is not this run's: {wrong.why}. Files join a directory only from runs of the same "
            "model, --layers, --dtype and --trust-remote-code (the README's shard merge included); remove the "
            "others, or choose another --out")
    formats.refuse_strays(p.fmt, opts.out, p.placed.members(), "Nothing was written", left_out=p.left_out_lines)
    converted = (record or {}).get("converted_from") or {}
    if len(todo) and converted.get("lossy"):
        raise writer.OutputDirectoryConflict(
            f"{opts.out} was converted from {converted.get('format')} with loss ({converted['lossy']}): files "
            "extracted now would sit beside states of another precision. Complete the source and convert it "
            "again, or extract into another --out")
    if wrong:
        raise writer.OutputDirectoryConflict(
            f"{wrong.path} is not the sample it stands for: {wrong.why}. The directory's files were made from a "
            "sample set that differs from this run's (another tokenizer, transformers version, chat template "
            "or option such as --validate / --skip-uncovered): adding to it would pair rows with other "
            "samples' states. Use the same environment and options, or choose another --out")
    if len(kept):
        kept_files = kept.sample_count() - sum(i in non_finite for i, _ in kept.all_places())
        compared = sum(index.content_of(row) is not None for row in to_read)
        stages.say(f"resume: {kept.sample_count():,} of this run's files kept, "
                   f"{stages.plural(len(todo), 'batch', 'batches')} to do: "
                   + kept_files_checked(kept_files - len(to_read), len(to_read), compared))


def kept_files_checked(unchanged: int, opened: int, compared: int) -> str:
    """What the resume check did of the kept files, in words: those the index vouched for were not opened."""
    said = []
    if unchanged:
        said.append(f"{unchanged:,} unchanged since written (the index's record of their name, size, times and "
                    "inode: not opened)")
    if opened:
        without = ("no digest of their bytes recorded" if not compared else
                   f"{compared:,} of them also against the digest of their bytes as written"
                   + (f", the other {opened - compared:,} without one" if compared < opened else ""))
        why_none = (": no line of this directory's index for them, or one of an earlier release"
                    if compared < opened else "")
        said.append(f"{opened:,} opened and checked (token ids, loss mask, the states' stamp, layers, hidden size "
                    f"and dtype; {without}{why_none})")
    return ", ".join(said) or "none has a file (left out for non-finite states)"
