"""Training files: atomic writes, a manifest that says what the files are, resume that neither skips nor repeats.

Layout of an output directory (readable by speculators 0.3.0's `Eagle3SampleFileDataset` unchanged):
  data_{i}.pt            {"input_ids": LongTensor[T], "hidden_states": [Tensor[T, H] per layer], "loss_mask": LongTensor[T]}
                         (or data_{i}.safetensors: input_ids, loss_mask, hidden_states.{k})
  data_config.json       speculators' data-generation config, as its script writes it
  manifest.json          eagle_compat's record: layer convention, versions, model checksums, settings
                         (manifest.shard-I-of-N.json for a shard)
`i` is the sample's index in the input file, so shards and resumed runs never collide.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

LAYER_CONVENTION = ("hidden_states[k] is the residual stream leaving decoder layer layer_ids[k] "
                    "(hidden + residual after that layer; HF output_hidden_states[layer_id + 1] for layer_id <= N-2; "
                    "for the last layer N-1 the input of the final norm, i.e. pre-final-norm)")


def atomic_write_bytes(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_file(path: str, write: Any) -> None:
    """`write(tmp_path)` makes the file; then fsync and rename, as atomic_write_bytes (no copy in memory)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    write(tmp)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def atomic_write_json(path: str, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n").encode())


def sample_path(out_dir: str, index: int, fmt: str) -> str:
    return os.path.join(out_dir, f"data_{index}.{'pt' if fmt == 'pt' else 'safetensors'}")


def save_sample(out_dir: str, index: int, sample: dict, fmt: str) -> str:
    import torch

    path = sample_path(out_dir, index, fmt)
    if fmt == "pt":  # torch.save to the file itself: several writer threads scale (a BytesIO copy holds the GIL)
        atomic_write_file(path, lambda tmp: torch.save(sample, tmp))
    else:
        from safetensors.torch import save as st_save

        tensors = {"input_ids": sample["input_ids"], "loss_mask": sample["loss_mask"]}
        tensors.update({f"hidden_states.{k}": h.contiguous() for k, h in enumerate(sample["hidden_states"])})
        atomic_write_bytes(path, st_save(tensors, metadata={"format": "eagle_compat-1"}))
    return path


def load_sample(path: str) -> dict:
    import torch

    if path.endswith(".pt"):
        return torch.load(path, weights_only=True, map_location="cpu")
    from safetensors.torch import load_file

    t = load_file(path)
    n = len([k for k in t if k.startswith("hidden_states.")])
    return {"input_ids": t["input_ids"], "loss_mask": t["loss_mask"],
            "hidden_states": [t[f"hidden_states.{k}"] for k in range(n)]}


def file_sha256(path: str, limit: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if limit is None:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        else:  # large weights: size + first and last `limit` bytes (documented in the manifest)
            size = os.path.getsize(path)
            h.update(str(size).encode())
            h.update(f.read(limit))
            if size > limit:
                f.seek(max(size - limit, limit))
                h.update(f.read(limit))
    return h.hexdigest()


def model_checksums(model_path: str, full_hash_limit: int = 1 << 30) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not os.path.isdir(model_path):
        return {"note": "not a local directory; no checksums"}
    for name in sorted(os.listdir(model_path)):
        path = os.path.join(model_path, name)
        if not os.path.isfile(path) or not name.endswith((".json", ".safetensors", ".bin", ".model", ".py")):
            continue
        size = os.path.getsize(path)
        out[name] = {"size": size, "sha256": file_sha256(path, None if size <= full_hash_limit else 1 << 20),
                     "hashed": "full" if size <= full_hash_limit else "size+first+last MiB"}
    return out


def manifest_name(shard: tuple[int, int]) -> str:
    i, n = shard
    return "manifest.json" if n == 1 else f"manifest.shard-{i}-of-{n}.json"


def settings_differences(old: dict, new: dict) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [f"{k}: was {old.get(k)!r}, now {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]
