"""The tiny-model cache under concurrent builders (pytest-xdist workers, two jobs on one machine): a checkpoint is
published whole, by one rename, or not at all (tiny_models.publishing)."""
import os
import re
import socket
import subprocess

import pytest

from eagle_compat import tiny_models


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_COMPAT_TINY_MODELS", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_checkpoint_is_not_visible_at_its_path_until_it_is_complete(empty_cache, monkeypatch):
    seen = []
    save_tokenizer = tiny_models.save_tokenizer

    def while_building(model_dir, *args, **kwargs):  # weights written, tokenizer not yet
        seen.extend(p for p in os.listdir(empty_cache) if not p.startswith("."))
        return save_tokenizer(model_dir, *args, **kwargs)

    monkeypatch.setattr(tiny_models, "save_tokenizer", while_building)
    path = tiny_models.build_tiny_model("llama")
    assert seen == [], f"a reader would have found the half-built {seen}"
    assert tiny_models.is_built(path) and os.path.exists(os.path.join(path, "tokenizer_config.json"))
    assert os.listdir(empty_cache) == [os.path.basename(path)]  # no private folder left behind


def test_two_racing_builders_get_the_same_complete_checkpoint(empty_cache, monkeypatch):
    save_tokenizer = tiny_models.save_tokenizer
    other = []

    def another_builder_finishes_first(model_dir, *args, **kwargs):
        if not other:
            other.append(None)
            other[0] = tiny_models.build_tiny_model("llama")  # publishes while this build is half done
        return save_tokenizer(model_dir, *args, **kwargs)

    monkeypatch.setattr(tiny_models, "save_tokenizer", another_builder_finishes_first)
    path = tiny_models.build_tiny_model("llama")
    assert path == other[0] and tiny_models.is_built(path)
    assert os.listdir(empty_cache) == [os.path.basename(path)]
    from transformers import AutoConfig
    assert AutoConfig.from_pretrained(path).num_hidden_layers == tiny_models.num_layers("llama")


@pytest.mark.parametrize("where", ["elsewhere", "inside the cache"])
def test_a_folder_with_other_files_is_refused_and_left_as_it_was(tmp_path, empty_cache, where):
    target = (tmp_path if where == "elsewhere" else empty_cache) / "mine"
    target.mkdir(parents=True)
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=re.escape(str(target))):
        tiny_models.build_tiny_model("llama", out_dir=str(target))
    assert os.listdir(target) == ["notes.txt"] and (target / "notes.txt").read_text() == "keep me"


def test_an_interrupted_build_in_the_cache_is_replaced(empty_cache):
    first = tiny_models.build_tiny_model("llama")
    os.remove(os.path.join(first, ".complete"))  # as an older version left it when interrupted
    os.remove(os.path.join(first, "config.json"))
    again = tiny_models.build_tiny_model("llama")
    assert again == first and tiny_models.is_built(again) and os.path.exists(os.path.join(again, "config.json"))


def test_an_incomplete_folder_another_builder_completes_meanwhile_is_kept(empty_cache, monkeypatch):
    """Two builders find an older version's incomplete folder; one publishes over it while the other is about to set
    it aside: the published checkpoint must stay, not be deleted as if it were still incomplete."""
    first = tiny_models.build_tiny_model("llama")
    os.remove(os.path.join(first, ".complete"))
    set_aside = tiny_models._set_aside

    def the_other_builder_publishes_first(out_dir, aside):
        open(os.path.join(out_dir, "published-by-the-other"), "w").close()
        open(os.path.join(out_dir, ".complete"), "w").close()
        return set_aside(out_dir, aside)

    monkeypatch.setattr(tiny_models, "_set_aside", the_other_builder_publishes_first)
    again = tiny_models.build_tiny_model("llama")
    assert again == first and tiny_models.is_built(again)
    assert os.path.exists(os.path.join(again, "published-by-the-other"))
    assert os.listdir(empty_cache) == [os.path.basename(first)]


def test_a_rename_that_fails_for_another_reason_is_raised_and_leaves_nothing(empty_cache, monkeypatch):
    rename = os.rename

    def read_only(src, dest):
        if ".building-" in str(src):
            raise PermissionError(1, "Operation not permitted", str(dest))
        return rename(src, dest)

    monkeypatch.setattr(os, "rename", read_only)
    with pytest.raises(PermissionError, match="Operation not permitted"):
        tiny_models.build_tiny_model("llama")
    assert os.listdir(empty_cache) == []


@pytest.mark.parametrize("host", ["this host", "another host"])
def test_the_private_folder_of_a_builder_that_died_here_is_dropped_and_another_hosts_is_left(empty_cache, host):
    """A builder killed here leaves hundreds of MB behind; a cache shared by containers holds other hosts' folders,
    whose PIDs (another PID namespace) say nothing about their builders here."""
    built = tiny_models.build_tiny_model("llama")
    dead = subprocess.Popen(["true"])
    dead.wait()
    owner = socket.gethostname() if host == "this host" else "another-host"
    abandoned = empty_cache / f".{os.path.basename(built)}.building-{dead.pid}-0badc0de-{owner}"
    abandoned.mkdir()
    (abandoned / "model.safetensors").write_bytes(b"half")
    os.remove(os.path.join(built, ".complete"))
    tiny_models.build_tiny_model("llama")
    if host == "this host":
        assert not abandoned.exists() and os.listdir(empty_cache) == [os.path.basename(built)]
    else:
        assert abandoned.exists()
