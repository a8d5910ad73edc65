"""The tiny-model cache under concurrent builders (pytest-xdist workers, two jobs on one machine): a checkpoint is
published whole, by one rename, or not at all (tiny_models.publishing)."""
import os

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


def test_a_folder_with_other_files_is_refused_and_left_as_it_was(tmp_path):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=str(target)):
        tiny_models.build_tiny_model("llama", out_dir=str(target))
    assert os.listdir(target) == ["notes.txt"] and (target / "notes.txt").read_text() == "keep me"


def test_an_interrupted_build_in_the_cache_is_replaced(empty_cache):
    first = tiny_models.build_tiny_model("llama")
    os.remove(os.path.join(first, ".complete"))  # as an older version left it when interrupted
    os.remove(os.path.join(first, "config.json"))
    again = tiny_models.build_tiny_model("llama")
    assert again == first and tiny_models.is_built(again) and os.path.exists(os.path.join(again, "config.json"))
