"""What the user's data became (docs/adr/0029-extract-defaults.md): extract's data report, --min-loss-tokens, and
`eagle-compat report DIR` on our layout and on speculators 0.3.0's. The stand-in engine of test_extract_integrity.py
replaces vLLM: these tests are about what was cut, kept and counted."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from eagle_compat.extract import job, report, writer

from test_extract_integrity import _opts, _write_lines, model  # noqa: F401 (fixtures)

MAX_LEN = 48


@pytest.fixture
def chats(tmp_path):
    """Two conversations; the second one's user turn alone is longer than --max-len: its reply is cut away."""
    return _write_lines(tmp_path / "chats.jsonl", [
        {"conversations": [{"role": "user", "content": "w1 w2 w3"},
                           {"role": "assistant", "content": "w4 w5 w6 w7"}]},
        {"conversations": [{"role": "user", "content": " ".join(f"w{i}" for i in range(10, 10 + 2 * MAX_LEN))},
                           {"role": "assistant", "content": "w8 w9 w10"}]},
        {"input_ids": list(range(7, 7 + MAX_LEN + 10)), "loss_mask": [0] * (MAX_LEN - 2) + [1] * 12},
    ])


def test_a_sample_whose_reply_was_cut_away_is_reported_and_left_out(model, chats, tmp_path, fake_engine):
    out = tmp_path / "out"
    summary = job.run(_opts(model, chats, out, max_len=MAX_LEN))
    rep = summary["report"]
    assert rep["samples"] == 2  # line 2 left out: nothing to train on
    cut = rep["truncation"]
    assert cut["samples_truncated"] == 2 and cut["samples_with_a_reply_cut_wholly"] == 1  # line 2, left out
    assert cut["samples_with_a_reply_cut_partly"] == 0 and cut["loss_tokens_cut"] == 3 + 10  # line 2 reply, line 3 end
    left = rep["left_out"]["--min-loss-tokens"]
    assert left["count"] == 1 and left["lines"] == [2] and left["reasons"] == ["its replies were cut away by --max-len"]
    assert not os.path.exists(writer.sample_path(str(out), 1, "pt"))  # its index keeps its number, without a file
    manifest = json.load(open(out / "manifest.json"))
    assert manifest["report"]["left_out"] == rep["left_out"] and manifest["settings"]["min_loss_tokens"] == 1
    assert manifest["runs"][-1]["report"]["samples"] == 2
    assert sum(b["samples"] for b in rep["length_histogram"]) == 2
    text = report.text(rep)
    assert "left out (--min-loss-tokens): 1 sample, line 2: its replies were cut away by --max-len" in text
    assert f"--max-len {MAX_LEN}: 2 samples truncated (lines 2, 3)" in text and cut["lines"] == [2, 3]


def test_min_loss_tokens_0_keeps_every_sample_and_reports_the_empty_ones(model, chats, tmp_path, fake_engine):
    out = tmp_path / "out"
    rep = job.run(_opts(model, chats, out, max_len=MAX_LEN, min_loss_tokens=0))["report"]
    assert rep["samples"] == 3 and rep["samples_without_loss_tokens"] == 1 and not rep["left_out"]
    assert rep["truncation"]["samples_with_a_reply_cut_wholly"] == 1
    kept = writer.load_sample(writer.sample_path(str(out), 1, "pt"))
    assert len(kept["input_ids"]) == MAX_LEN and int(kept["loss_mask"].sum()) == 0
    assert "1 sample has no token in the loss mask" in report.text(rep)
    with pytest.raises(writer.OutputDirectoryConflict, match=r"min_loss_tokens: was 0, now 1"):
        job.run(_opts(model, chats, out, max_len=MAX_LEN, resume=True))  # another sample set: refused


def test_a_bad_min_loss_tokens_is_refused_before_anything(model, chats, tmp_path):
    from eagle_compat import InvalidInput
    with pytest.raises(InvalidInput, match=r"--min-loss-tokens -1; must be an int >= 0"):
        job.run(_opts(model, chats, tmp_path / "out", min_loss_tokens=-1))
    assert not (tmp_path / "out").exists()


def _report(*args):
    proc = subprocess.run([sys.executable, "-m", "eagle_compat.cli", "report", *map(str, args)], capture_output=True,
                          text=True, timeout=300)
    return proc


def test_report_reads_our_directories_and_speculators_0_3_0_ones(model, chats, tmp_path, fake_engine):
    ours = tmp_path / "ours"
    job.run(_opts(model, chats, ours, max_len=MAX_LEN))
    proc = _report(ours, "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout)
    assert got["samples"] == 2 and got["left_out"]["--min-loss-tokens"]["lines"] == [2]
    assert got["source"].endswith("manifest.json")
    # speculators 0.3.0's layout: data_{i}.pt and data_config.json, no manifest (what its own script writes)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    for i, n in enumerate((5, 9, 9, 30)):
        torch.save({"input_ids": torch.arange(n), "hidden_states": [torch.zeros(n, 4)],
                    "loss_mask": torch.tensor([0] * (n - 2) + [1, 1])}, theirs / f"data_{i}.pt")
    # the shape speculators 0.3.0's script writes: the length is data.seq_length (a top-level max_len was read)
    json.dump({"version": "2.0", "data": {"seq_length": 30, "num_samples": 4}}, open(theirs / "data_config.json", "w"))
    proc = _report(theirs)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"{theirs}: 4 samples, 53 tokens, 8 in the loss mask (15.1%)"), proc.stdout
    assert "samples at max_len (1) may have been cut" in proc.stdout
    data = _report(theirs, "--json")
    assert [b["samples"] for b in json.loads(data.stdout)["length_histogram"]] == [0, 1, 2, 0, 0, 0, 0, 1]
    empty = _report(tmp_path)
    assert empty.returncode == 2 and "holds no sample files" in empty.stderr
    # an Arrow set without our manifest (speculators 0.8-0.9's own layout): from its rows (it raised KeyError)
    arrow = tmp_path / "arrow"
    job.run(_opts(model, chats, arrow, max_len=MAX_LEN, format="arrow"))
    os.unlink(arrow / "manifest.json")
    proc = _report(arrow)
    assert proc.returncode == 0 and proc.stdout.startswith(f"{arrow}: 2 samples"), proc.stdout + proc.stderr[-2000:]


def test_the_length_histogram_plot_needs_matplotlib_and_says_so(model, chats, tmp_path, fake_engine):
    import importlib.util
    out = tmp_path / "out"
    job.run(_opts(model, chats, out, max_len=MAX_LEN))
    png = tmp_path / "lengths.png"
    proc = _report(out, "--plot", png)
    if importlib.util.find_spec("matplotlib") is None:
        assert proc.returncode == 2 and "needs matplotlib, which is not installed: pip install matplotlib" in proc.stderr
        pytest.skip("matplotlib is not installed here: the refusal was checked, not the drawing")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_plot_file_that_cannot_be_written_is_refused_before_the_run(model, chats, tmp_path, no_engine):
    """`extract --report-plot` draws after the run: a bad path was a traceback and exit 1 after days of work."""
    import importlib.util
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed here: its absence is refused first (the test above)")
    for bad, says in ((tmp_path / "no" / "such" / "x.png", "is not a folder this user can write in"),
                      (tmp_path / "x.txt", "the file type 'txt' is not one matplotlib writes; allowed: ")):
        proc = subprocess.run([sys.executable, "-m", "eagle_compat.cli", "extract", "--model", model, "--data", chats,
                               "--out", str(tmp_path / "out"), "--report-plot", str(bad)], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_report_names_files_that_would_train_a_drafter_wrongly(model, chats, tmp_path, fake_engine, monkeypatch, capsys):
    """Directories written before extract checked the layers, and conversions of speculators 0.3.0's own output that
    read its data_config.json's order: `report` says so and exits 1."""
    from eagle_compat import cli
    from eagle_compat import options as options_mod
    from eagle_compat.extract import layers as layers_mod
    with monkeypatch.context() as m:
        m.setattr(layers_mod, "check_training_layers", lambda *a: None)  # an earlier release
        m.setattr(options_mod, "check_training_layers", lambda *a: None)
        job.run(_opts(model, chats, tmp_path / "old", layers=[2, 0, 5], max_len=MAX_LEN))
    assert cli.main(["report", str(tmp_path / "old")]) == 1
    assert re.search(r"PROBLEM: its layers: layers \[2, 0, 5\] .* not in ascending order: .* \(written by an earlier "
                     r"release, which did not check this\)", capsys.readouterr().out)
    job.run(_opts(model, chats, tmp_path / "good", layers=[0, 2, 5], max_len=MAX_LEN))
    assert cli.main(["report", str(tmp_path / "good")]) == 0 and "PROBLEM" not in capsys.readouterr().out
    record = json.load(open(tmp_path / "good" / "manifest.json"))
    record["settings"]["made_by"] = "speculators 0.3.0 data generation (data_config.json)"
    record["converted_from"] = {"format": "pt", "slot_order": [1, 2, 0]}  # config [5, 0, 2], files [0, 2, 5]
    json.dump(record, open(tmp_path / "good" / "manifest.json", "w"))
    assert cli.main(["report", str(tmp_path / "good")]) == 1
    assert "the slots are permuted. Convert the source again" in capsys.readouterr().out


def test_a_resume_with_other_versions_is_said_at_the_run_and_in_the_report(model, chats, tmp_path, fake_engine,
                                                                           monkeypatch, capsys):
    """Resuming after an upgrade (a capture fix, a new vLLM) is allowed, but the set then holds states of both: the
    run says so, and so does `eagle-compat report` (data_config.json keeps only the last run's versions)."""
    from eagle_compat import detect
    out = tmp_path / "out"
    job.run(_opts(model, chats, out, max_len=MAX_LEN, shard=(0, 2), batch_size=1))  # each shard has a batch
    assert "differing versions" not in report.text(report.of_directory(str(out)))
    real = detect.installed_versions()

    class Upgraded:
        def as_dict(self):
            return {**real.as_dict(), "vllm": "9.9.9"}
    monkeypatch.setattr(detect, "installed_versions", lambda: Upgraded())
    capsys.readouterr()
    job.run(_opts(model, chats, out, max_len=MAX_LEN, shard=(1, 2), batch_size=1))
    assert re.search(r"NOTE: this directory's files so far were written with vllm \S+; this run uses vllm 9\.9\.9",
                     capsys.readouterr().err)
    text = report.text(report.of_directory(str(out)))
    assert re.search(r"NOTE: its runs wrote files with differing versions: vllm \S+ / 9\.9\.9", text), text


def test_the_report_counts_the_files_rather_than_trust_the_record(model, chats, tmp_path, fake_engine):
    """A directory copied or pruned after its run: the record says complete, a file is gone. The report said
    nothing (it took the count from the record); now a PROBLEM line names both counts."""
    out = tmp_path / "out"
    job.run(_opts(model, chats, out, max_len=MAX_LEN))
    assert "PROBLEM" not in report.text(report.of_directory(str(out)))
    os.unlink(next(out.glob("data_*.pt")))
    text = report.text(report.of_directory(str(out)))
    assert re.search(r"PROBLEM: 1 sample file is in .*, its record says 2", text), text


def _left_running(tmp_path, pid: int, host: str) -> str:
    """A directory as a run killed outright leaves it (written by hand): its record still says "running", one of its
    two sample files was written."""
    out = tmp_path / "out"
    out.mkdir(parents=True)
    (out / "data_0.pt").write_bytes(b"")  # counted by name: the report reads no sample of ours
    rep = {"samples": 2, "tokens": 20, "loss_tokens": 6, "loss_share": 0.3, "max_len": 16,
           "samples_without_loss_tokens": 0, "length_histogram": [], "left_out": {},
           "truncation": {"samples_truncated": 0, "lines": [], "tokens_cut": 0, "loss_tokens_cut": 0,
                          "samples_with_a_reply_cut_partly": 0, "samples_with_a_reply_cut_wholly": 0}}
    run = {"shard": "0/1", "pid": pid, "host": host, "status": "running", "batches_to_do": 1}
    json.dump({"settings": {"model": "m"}, "status": "running", "runs": [run], "report": rep},
              open(out / "manifest.json", "w"))
    return str(out)


def _ended_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()  # reaped: the pid names no process
    return proc.pid


def test_a_running_record_whose_process_is_gone_is_reported_incomplete(tmp_path, capsys):
    """A run killed with SIGKILL (or a machine restart) never records its end: the report called the directory
    running forever. Its pid, on this host, says whether it still is."""
    import socket

    from eagle_compat import cli
    pid = _ended_pid()
    out = _left_running(tmp_path, pid, socket.gethostname())
    rep = report.of_directory(out)
    assert rep["status"] == "incomplete" and rep["status_note"] == f"pid {pid} not running"
    assert cli.main(["report", out]) == 0
    text = capsys.readouterr().out
    assert (f"NOTE: the directory is incomplete (pid {pid} not running): rerun with --resume; 1 of 2 samples have "
            "their file") in text, text
    assert "directory is running" not in text


def test_a_running_record_whose_process_lives_or_runs_elsewhere_stays_running(tmp_path):
    import socket
    text = report.text(report.of_directory(_left_running(tmp_path, os.getpid(), socket.gethostname())))
    assert "NOTE: the directory is running (1 of 2 samples have their file)" in text and "--resume" not in text, text
    # another host's process table cannot be read from here: said, not guessed
    other = report.of_directory(_left_running(tmp_path / "other", _ended_pid(), "elsewhere.example"))
    assert other["status"] == "running" and other["status_note"].endswith(
        "on elsewhere.example: cannot be checked from here"), other


def test_the_report_counts_in_the_singular_and_names_the_truncated_lines():
    from eagle_compat.extract.inputs import Cut, Sample
    one = [Sample(0, [5], [1], line=4, cut=Cut(tokens=3, loss_tokens=1, replies_cut_partly=1))]
    rep = report.of_samples(one, 1, {"--min-loss-tokens": [
        {"line": 2, "index": 1, "reason": "no reply", "cut": Cut(tokens=1, replies_cut_wholly=1)}]})
    assert rep["truncation"]["lines"] == [2, 4]
    rep["samples_without_loss_tokens"] = 1
    text = report.text(rep)
    assert text.startswith("data report: 1 sample, 1 token, 1 in the loss mask"), text
    assert "  1 sample has no token in the loss mask" in text
    assert ("--max-len 1: 2 samples truncated (lines 2, 4), 4 tokens cut (1 of them loss tokens); replies cut partly "
            "in 1 sample, wholly in 1") in text, text
    assert "left out (--min-loss-tokens): 1 sample, line 2: no reply" in text
    # past 20 the lines end in "..."
    rep["truncation"].update(samples_truncated=30, lines=list(range(1, 31)))
    assert ("30 samples truncated (lines 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, ...), "
            in report.text(rep))


def test_the_report_names_files_a_trainer_would_take_that_are_not_the_sets(model, chats, tmp_path, fake_engine):
    """Files copied in after the set was completed (a subfolder, a file manager's copy): speculators 0.3.0's trainer
    walks the folder and takes every file whose name ends in "pt". The report said nothing; now a PROBLEM line
    names them and says to move them out."""
    out = tmp_path / "out"
    job.run(_opts(model, chats, out, max_len=MAX_LEN))
    (out / "shard1").mkdir()
    first = next(out.glob("data_*.pt"))
    for copy in (out / "shard1" / first.name, out / f"{first.stem} (copy).pt"):
        copy.write_bytes(first.read_bytes())
    text = report.text(report.of_directory(str(out)))
    assert re.search(rf"PROBLEM: 2 files under {re.escape(str(out))} are not the set's but a trainer would take "
                     rf"them for samples \({re.escape(first.stem)} \(copy\)\.pt, shard1/{first.name}\)", text), text
    assert "move them out" in text
