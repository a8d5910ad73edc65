"""Where a model named on the command line lives: a local folder, or a Hugging Face hub name already in the local
cache (`HF_HUB_CACHE`, else `HF_HOME/hub`), as vLLM and transformers take it. Nothing is downloaded: a name not in
the cache is refused with the command that fetches it. Light on purpose (no torch, no transformers): it runs before
the cheap checks' refusals, which come in about a second.
"""
from __future__ import annotations

import os

from .errors import InvalidInput


def looks_like_hub_name(name: str) -> bool:
    """`org/name` or `name`, as the hub spells repositories; not a path (absolute, relative with ./ or ../, ~)."""
    if not name or name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name:
        return False
    return all(part and all(c.isalnum() or c in "-_." for c in part) for part in name.split("/"))


def cached_snapshot(name: str, revision: str | None = None) -> str | None:
    """The local cache's snapshot folder of hub repository `name` (at `revision`, default its main ref), or None."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # transformers needs the hub client; without it there is no cache to look in
        return None
    try:
        return snapshot_download(name, revision=revision, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None


def hub_cache_dir() -> str:
    try:
        from huggingface_hub import constants
        return constants.HF_HUB_CACHE
    except ImportError:
        home = os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))
        return os.environ.get("HF_HUB_CACHE", os.path.join(home, "hub"))


def local_model_path(name: str, option: str = "--model") -> str:
    """`name` itself where it exists; else its snapshot in the local Hugging Face cache; else InvalidInput saying
    what was looked for and how to get the model."""
    if os.path.exists(name):
        if not os.path.isdir(name):
            raise InvalidInput(f"{option} {name!r} is a file; give the model's directory (config.json and weights) or "
                               "a Hugging Face name in the local cache")
        return name
    if not looks_like_hub_name(name):
        raise InvalidInput(f"{option} {name!r}: no such directory")
    snapshot = cached_snapshot(name)
    if snapshot is not None:
        return snapshot
    raise InvalidInput(
        f"{option} {name!r}: no such directory, and no model of that name in the local Hugging Face cache "
        f"({hub_cache_dir()}; HF_HUB_CACHE or HF_HOME move it). eagle-compat does not download models: fetch it "
        f"first, e.g. `hf download {name}` (huggingface_hub's command line), then give the same name again, or "
        "give a local folder")
