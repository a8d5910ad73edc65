"""What eagle_compat reads of a model before an engine starts: its text config (through multimodal wrappers), the token
ids it takes (checked before they reach the engine), and the engine's default share of the device's memory."""
from __future__ import annotations

import numbers
import os
from typing import Any, Sequence

from . import detect
from .errors import InvalidInput


def model_text_config(model_path: str, trust_remote_code: bool = False) -> Any:
    """The language model's config: `num_hidden_layers`, `vocab_size`.

    Read from config.json where possible: multimodal wrappers such as Kimi-K2.5 have model types that older
    transformers do not know (vLLM registers its own config class for them)."""
    import json
    from types import SimpleNamespace

    if os.path.isfile(model_path):
        raise InvalidInput(f"model {model_path!r} is a file; give the model's directory (with config.json) or a hub id")
    path = os.path.join(model_path, "config.json")
    if os.path.isdir(model_path) and not os.path.isfile(path):
        # not AutoConfig's to guess: transformers 4 takes a model type from the folder's *name* ("empty_model" gave
        # an MPT config of 24 layers), so a wrong folder would run with made-up layer counts
        raise InvalidInput(f"model {model_path!r} has no config.json; give the model's directory")
    if os.path.isfile(path):
        try:
            with open(path) as f:
                raw = json.load(f)
        except (OSError, ValueError) as exc:
            raise InvalidInput(f"{path} cannot be read as JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise InvalidInput(f"{path} is not a model config (a JSON object), got {type(raw).__name__}")
        from_file = None
        for candidate in (raw.get("text_config"), raw.get("language_config"), raw):
            if isinstance(candidate, dict) and "num_hidden_layers" in candidate:
                if "vocab_size" not in candidate and "vocab_size" in raw:  # a wrapper may keep it at the top
                    candidate = {**candidate, "vocab_size": raw["vocab_size"]}
                from_file = SimpleNamespace(**candidate)
                if "vocab_size" in candidate:  # else transformers' config class knows its default (Gemma-3)
                    return from_file
                break
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:  # no config.json, an unknown model type, a hub id that cannot be reached
        if os.path.isfile(path) and from_file is not None:
            return from_file  # a wrapper transformers does not know: its vocabulary comes from vLLM's config later
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidInput(f"model {model_path!r}: transformers cannot read its config ({first})") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not hasattr(text, "num_hidden_layers"):
        raise InvalidInput(f"{model_path}: cannot find num_hidden_layers in its config")
    return text


def default_gpu_memory_utilization() -> float:
    """The command line's default: on CPU vLLM reserves this fraction of host memory per NUMA node, and 0.8 fails on
    small machines. Asks torch whether CUDA is there (seconds): call it after the cheap checks."""
    return 0.8 if detect.feature("cuda_available") else 0.3


def validate_token_ids(token_ids: Any, *, vocab_size: int, max_len: int, truncate: bool) -> list[list[int]]:
    """Every check generate() makes before anything reaches the engine."""
    try:
        import torch
        if isinstance(token_ids, torch.Tensor):
            if token_ids.dim() != 2 or token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
                raise InvalidInput(f"a token-id tensor must be 2-D and integer, got shape {tuple(token_ids.shape)} "
                                   f"dtype {token_ids.dtype}")
            token_ids = token_ids.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise InvalidInput(f"token_ids must be a list of token-id lists, got {type(token_ids).__name__}")
    if len(token_ids) == 0:
        raise InvalidInput("token_ids is an empty batch; give at least one sequence")
    out: list[list[int]] = []
    for n, seq in enumerate(token_ids):
        if hasattr(seq, "tolist"):
            seq = seq.tolist()
        if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence):
            raise InvalidInput(f"sequence {n} is a {type(seq).__name__}, not a list of token ids")
        if len(seq) == 0:
            raise InvalidInput(f"sequence {n} is empty; every sequence needs at least one token")
        ids = []
        for pos, t in enumerate(seq):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise InvalidInput(f"sequence {n}, position {pos}: token id {t!r} is not an int")
            if not 0 <= int(t) < vocab_size:
                raise InvalidInput(f"sequence {n}, position {pos}: token id {int(t)} outside the vocabulary "
                                   f"[0, {vocab_size - 1}]")
            ids.append(int(t))
        if len(ids) > max_len:
            if not truncate:
                raise InvalidInput(
                    f"sequence {n} has {len(ids)} tokens; at most max_model_len - 1 = {max_len} fit (one slot is "
                    "the sampled token). Raise max_model_len, shorten it, or pass truncate=True.")
            ids = ids[:max_len]
        out.append(ids)
    return out
