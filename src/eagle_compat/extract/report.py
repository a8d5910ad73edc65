"""What the user's data became: the data report of `extract` (printed at the end, kept in the manifest per run and
for the directory) and of `eagle-compat report DIR` (ours, or any speculators 0.3.0 directory of data_{i}.pt files).

A sample whose assistant reply --max-len cut away has nothing to train on; on a real dataset at --max-len 2048 that
can be a large share of the samples, found only after days of training. The report counts it before the engine is
paid for: samples, tokens, loss tokens and their share, what truncation removed, replies cut partly or wholly,
samples left out, and a length histogram.
"""
from __future__ import annotations

import math
import os
from typing import Any, Iterable

from .._version import __version__

HISTOGRAM_BINS = 8


def of_samples(samples: Iterable[Any], max_len: int | None, left_out: dict[str, list[dict]] | None = None) -> dict:
    """The report of `inputs.Sample`s (their `cut` says what --max-len removed); `left_out`: name -> the samples a
    rule left out ({"line", "index", "reason", ...}; with "cut" where --max-len took part: it counts in the
    truncation figures, which cover every sample of the input that was tokenized)."""
    tally = Tally()
    for s in samples:
        tally.add(s)
    return tally.report(max_len, left_out)


class Tally:
    """`of_samples`, one sample at a time (`add`, then `report`): 16 bytes a sample, none of it held."""

    def __init__(self) -> None:
        from array import array
        self.lengths, self.losses, self.cut_lines = array("q"), array("q"), []
        self.cut = {"samples": 0, "tokens": 0, "loss_tokens": 0, "partly": 0, "wholly": 0}
        self.kinds = {"reasoning": 0, "tool_calls": 0, "replies": 0, "given_as_token_ids": 0}

    def add(self, s: Any) -> None:
        self.lengths.append(len(s.input_ids))
        loss = sum(s.loss_mask)
        self.losses.append(loss)
        self._add_cut(s.cut, s.line)
        if s.cut.replies:  # a conversation: its loss tokens by what the assistant generated
            reasoning, calls = s.cut.reasoning_tokens, s.cut.tool_call_tokens
            self.kinds["reasoning"] += reasoning
            self.kinds["tool_calls"] += calls
            self.kinds["replies"] += loss - reasoning - calls
        else:
            self.kinds["given_as_token_ids"] += loss

    def _add_cut(self, c: Any, line: int, cut: dict | None = None, cut_lines: list | None = None) -> None:
        cut, cut_lines = (self.cut, self.cut_lines) if cut is None else (cut, cut_lines)
        if c.tokens > 0:
            cut["samples"] += 1
            if len(cut_lines) < 50:  # the first 50 are listed (samples come in input order)
                cut_lines.append(line)
        cut["tokens"] += c.tokens
        cut["loss_tokens"] += c.loss_tokens
        cut["partly"] += c.replies_cut_partly > 0
        cut["wholly"] += c.replies_cut_wholly > 0

    def report(self, max_len: int | None, left_out: dict[str, list[dict]] | None = None) -> dict:
        cut, cut_lines = dict(self.cut), list(self.cut_lines)
        left_cut = sorted((i for items in (left_out or {}).values() for i in items if i.get("cut") is not None),
                          key=lambda i: i["line"])
        cut_lines += [i["line"] for i in left_cut if i["cut"].tokens > 0][:50]
        for i in left_cut:
            self._add_cut(i["cut"], i["line"], cut, [])
        report = _totals(self.lengths, self.losses, max_len)
        report["loss_tokens_by_kind"] = dict(self.kinds)
        report["truncation"] = {
            "samples_truncated": cut["samples"], "lines": sorted(cut_lines)[:50], "tokens_cut": cut["tokens"],
            "loss_tokens_cut": cut["loss_tokens"], "samples_with_a_reply_cut_partly": cut["partly"],
            "samples_with_a_reply_cut_wholly": cut["wholly"]}
        report["left_out"] = {name: {"count": len(items), "lines": [i["line"] for i in items][:50],
                                     "reasons": sorted({i["reason"] for i in items})[:5]}
                              for name, items in (left_out or {}).items() if items}
        return report


def of_directory(out_dir: str) -> dict:
    """The report of a finished directory: ours (the manifest's, which knows what truncation removed), or computed
    from the files (speculators 0.3.0's data_{i}.pt, or ours without a stored report)."""
    import json

    from . import writer
    manifest = writer.read_manifest(out_dir)
    if manifest and manifest.get("report"):
        from .layers import problems_of
        # the report covers the whole input; an unfinished directory holds only part of it. The files are counted,
        # not taken from the record: a directory copied or pruned since says so
        present = len([n for n in writer.sample_files(out_dir) if n != "state.json"])
        problems = problems_of(manifest) + strays_named(manifest, out_dir)
        recorded = manifest.get("samples_present")
        if recorded is not None and present != recorded:
            problems.append(f"{present} sample {plural(present, 'file is', 'files are')} in {out_dir}, its record "
                            f"says {recorded} (files copied in, lost or removed since it was written): run the extract "
                            "command again with --resume")
        status, status_note = manifest.get("status"), None
        if status == "running":
            status, status_note = running_state(manifest)
        return {**manifest["report"], "source": f"{out_dir}/{writer.MANIFEST}", "status": status,
                **({"status_note": status_note} if status_note else {}), "samples_present": present,
                "problems": problems,
                "versions_differ": {k: [*old, new] for k, (old, new) in versions_that_differ(manifest).items()}}
    import torch
    names = writer.sample_files(out_dir)
    if not names:
        raise FileNotFoundError(f"{out_dir} holds no sample files (data_{{i}}.pt / .safetensors, or an Arrow dataset)")
    lengths, losses = [], []
    if "state.json" in names:  # an Arrow dataset (its hidden_states/hs_* beside it): rows carry ids and masks
        from . import arrow
        for row in arrow.read_rows(out_dir):
            lengths.append(len(row["input_ids"]))
            losses.append(int(sum(row["loss_mask"])))
    else:
        for name in names:
            sample = writer.load_sample(os.path.join(out_dir, name))
            lengths.append(int(torch.as_tensor(sample["input_ids"]).numel()))
            losses.append(int(torch.as_tensor(sample["loss_mask"]).sum()))
    max_len = None
    config = os.path.join(out_dir, "data_config.json")
    if os.path.exists(config):  # speculators 0.3.0's data_config.json (and ours): data.seq_length
        with open(config) as f:
            cfg = json.load(f)
        max_len = (cfg.get("data") or {}).get("seq_length") or cfg.get("max_len")
    report = _totals(lengths, losses, max_len)
    report["truncation"] = {"note": "not recorded by the run that wrote these files: samples at max_len "
                                    f"({sum(n == max_len for n in lengths) if max_len else 'max_len unknown'}) may "
                                    "have been cut"}
    report["source"] = f"{len(names)} files in {out_dir}"
    if manifest:  # ours, from a release that stored no report
        from .layers import problems_of
        report["problems"] = problems_of(manifest)
    return report


def strays_named(manifest: dict, out_dir: str) -> list[str]:
    """A problem line for the files under `out_dir` that a trainer would take for samples but whose names are none
    the set's layout gives (a subfolder copied in, a file manager's copy), where there are any."""
    from . import formats
    layout = formats.FORMATS.get((manifest.get("settings") or {}).get("format", "pt"))
    strays = formats.not_the_sets_by_name(layout, out_dir) if layout is not None else []
    if not strays:
        return []
    them = plural(len(strays), "it", "them")
    return [f"{len(strays)} {plural(len(strays), 'file')} under {out_dir} {plural(len(strays), 'is', 'are')} not the "
            f"set's but a trainer would take {them} for samples ({', '.join(strays[:5])}"
            f"{', ...' if len(strays) > 5 else ''}): speculators 0.3.0's reads every file under the folder whose name "
            f"ends in \"pt\", subfolders included; move {them} out of the folder"]


def running_state(manifest: dict) -> tuple[str, str | None]:
    """(status, note) of a directory whose record says "running": a run killed outright (SIGKILL, a machine
    restart) never writes its end, so the record's word is checked against its runs' pids. ("running", None) while
    one lives on this host; ("running", note) where the others run on hosts whose processes cannot be seen from
    here; ("incomplete", "pid N not running") where each has ended."""
    import socket
    runs = [r for r in manifest.get("runs") or [] if isinstance(r, dict) and r.get("status") == "running"
            and isinstance(r.get("pid"), int) and r["pid"] > 0]
    if not runs:  # written by a release that recorded no pid: nothing to check
        return "running", None
    here = socket.gethostname()
    local = [r["pid"] for r in runs if r.get("host") == here]
    if any(map(_alive, local)):
        return "running", None
    notes = [f"pid {r['pid']} on {r.get('host')}: cannot be checked from here" for r in runs if r.get("host") != here]
    dead = f"{plural(len(local), 'pid')} {', '.join(map(str, local))} not running"
    if notes:
        return "running", "; ".join(notes + ([dead] if local else []))
    return "incomplete", dead


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: another user's process holds the pid
        return True
    return True


def plural(n: int, one: str, many: str | None = None) -> str:
    """The word for n of them: plural(1, "sample") is "sample", plural(2, "sample") "samples"."""
    return one if n == 1 else many or f"{one}s"


def line_list(lines: list[int], count: int, limit: int = 20) -> str:
    """The input file's lines as the output names them: "line 2"; "lines 2, 5, ..." past `limit` of `count`."""
    shown = ", ".join(map(str, lines[:limit]))
    return f"{plural(count, 'line')} {shown}{', ...' if count > limit else ''}"


VERSIONS_THAT_MATTER = ("eagle_compat", "vllm", "torch", "transformers")


def versions_that_differ(manifest: dict, now: dict | None = None) -> dict[str, tuple[list[str], str]]:
    """{package: (the versions earlier runs of the directory wrote files with, this run's)} for each package whose
    version changed between the directory's runs (or, with `now`, between them and this run). Runs of older releases
    did not record eagle_compat's version per run: the directory's first one stands for them."""
    def of(run: dict) -> dict:
        v = dict(run.get("versions") or {})
        v.setdefault("eagle_compat", manifest.get("eagle_compat"))
        return v
    runs = [of(r) for r in manifest.get("runs", [])  # runs that had files to write (a merge check writes none)
            if isinstance(r, dict) and r.get("versions") and r.get("batches_to_do", 1)]
    if now is None:
        if len(runs) < 2:
            return {}
        runs, now = runs[:-1], runs[-1]
    else:
        now = {**now, "eagle_compat": now.get("eagle_compat") or __version__}
    out = {}
    for key in VERSIONS_THAT_MATTER:
        earlier = sorted({str(r.get(key)) for r in runs if r.get(key)})
        if earlier and now.get(key) and earlier != [str(now[key])]:
            out[key] = (earlier, str(now[key]))
    return out


def _totals(lengths: list[int], losses: list[int], max_len: int | None) -> dict:
    tokens, loss = sum(lengths), sum(losses)
    return {"samples": len(lengths), "tokens": tokens, "loss_tokens": loss,
            "loss_share": round(loss / tokens, 4) if tokens else 0.0, "max_len": max_len,
            "samples_without_loss_tokens": sum(n == 0 for n in losses), "length_histogram": histogram(lengths, max_len)}


def histogram(lengths: list[int], max_len: int | None, bins: int = HISTOGRAM_BINS) -> list[dict]:
    """Equal-width bins up to max_len (or the longest sample): [{"from", "to", "samples"}], `to` inclusive."""
    if not lengths:
        return []
    top = max(max_len or 0, max(lengths))
    width = max(1, math.ceil(top / bins))
    counts = [0] * bins
    for n in lengths:
        counts[min(bins - 1, (max(n, 1) - 1) // width)] += 1
    return [{"from": k * width + 1, "to": min(top, (k + 1) * width), "samples": c} for k, c in enumerate(counts)]


def text(report: dict, title: str = "data report") -> str:
    """The report as the lines `extract` and `eagle-compat report` print."""
    n = report["samples"]
    lines = [f"{title}: {n} {plural(n, 'sample')}, {report['tokens']:,} {plural(report['tokens'], 'token')}, "
             f"{report['loss_tokens']:,} in the loss mask ({100 * report['loss_share']:.1f}%)"]
    kinds = report.get("loss_tokens_by_kind") or {}
    if kinds.get("reasoning") or kinds.get("tool_calls"):
        lines.append(f"  loss tokens: {kinds['reasoning']:,} reasoning, {kinds['tool_calls']:,} tool calls, "
                     f"{kinds['replies']:,} replies" + (f", {kinds['given_as_token_ids']:,} given as token ids"
                                                        if kinds.get("given_as_token_ids") else ""))
    for problem in report.get("problems") or []:
        lines.append(f"  PROBLEM: {problem}")
    status = report.get("status")
    if status not in (None, "complete"):
        files = f"{report.get('samples_present')} of {n} {plural(n, 'sample has its', 'samples have their')} file"
        if report.get("status_note"):
            advice = ": rerun with --resume" if status == "incomplete" else ""
            lines.append(f"  NOTE: the directory is {status} ({report['status_note']}){advice}; {files}: these "
                         "figures describe the whole input")
        else:
            lines.append(f"  NOTE: the directory is {status} ({files}): these figures describe the whole input")
    if report.get("versions_differ"):
        lines.append("  NOTE: its runs wrote files with differing versions: " + "; ".join(
            f"{k} {' / '.join(v)}" for k, v in report["versions_differ"].items()) + " (manifest.json: runs)")
    if empty := report.get("samples_without_loss_tokens"):
        lines.append(f"  {empty} {plural(empty, 'sample has', 'samples have')} no token in the loss mask: nothing to "
                     "train on (kept: --min-loss-tokens 0)")
    cut = report.get("truncation", {})
    if "note" in cut:
        lines.append(f"  truncation: {cut['note']}")
    elif cut:
        k, partly = cut["samples_truncated"], cut["samples_with_a_reply_cut_partly"]
        where = f" ({line_list(cut['lines'], k, 20)})" if k and cut.get("lines") else ""  # older records: no lines
        lines.append(f"  --max-len {report.get('max_len')}: {k} {plural(k, 'sample')} truncated{where}, "
                     f"{cut['tokens_cut']:,} {plural(cut['tokens_cut'], 'token')} cut ({cut['loss_tokens_cut']:,} of "
                     f"them loss tokens); replies cut partly in {partly} {plural(partly, 'sample')}, wholly in "
                     f"{cut['samples_with_a_reply_cut_wholly']}")
    for name, left in report.get("left_out", {}).items():
        lines.append(f"  left out ({name}): {left['count']} {plural(left['count'], 'sample')}, "
                     f"{line_list(left['lines'], left['count'], 10)}: {'; '.join(left['reasons'])}")
    bins = report.get("length_histogram") or []
    if bins:
        peak = max(b["samples"] for b in bins) or 1
        lines.append("  length (tokens)   samples")
        for b in bins:
            bar = "#" * max(1 if b["samples"] else 0, round(30 * b["samples"] / peak))
            lines.append(f"  {b['from']:>6}-{b['to']:<8} {b['samples']:>7}  {bar}")
    return "\n".join(lines)


def check_plot_path(path: str, option: str) -> None:
    """Before any work: matplotlib is installed, writes this file type, and the file's folder can be written."""
    import importlib.util
    import os

    from ..errors import InvalidInput
    if importlib.util.find_spec("matplotlib") is None:
        raise InvalidInput(f"{option} needs matplotlib, which is not installed: pip install matplotlib")
    from matplotlib.backend_bases import FigureCanvasBase
    kinds = sorted(FigureCanvasBase.get_supported_filetypes())
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext and ext not in kinds:  # none: matplotlib's default format (png)
        raise InvalidInput(f"{option} {path!r}: the file type {ext!r} is not one matplotlib writes; "
                           f"allowed: {', '.join(kinds)}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        raise InvalidInput(f"{option} {path!r}: {folder} is not a folder this user can write in")


def plot(report: dict, path: str) -> str:
    """A PNG of the length histogram (matplotlib, if installed)."""
    check_plot_path(path, "--plot")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    bins = report["length_histogram"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar([f"{b['from']}-{b['to']}" for b in bins], [b["samples"] for b in bins], color="#4878a8")
    ax.set_xlabel("sample length (tokens)")
    ax.set_ylabel("samples")
    ax.set_title(f"{report['samples']} samples, {100 * report['loss_share']:.1f}% loss tokens")
    ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
