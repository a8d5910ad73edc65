"""The training-file layout of speculators 0.8-0.9 (`--format arrow`, and fp8 with `--format arrow-fp8`).

Layout of an output directory, as speculators' `ArrowDataset(datapath)` reads it (`load_from_disk(datapath)` and
`FileTransfer(datapath / "hidden_states")`):
  data-00000-of-00001.arrow, dataset_info.json, state.json
                       the Arrow dataset (`datasets.save_to_disk`, torch format), one row per sample, columns
                       input_ids [seq_len] int64, loss_mask [seq_len] int64, seq_len int64
  hidden_states/hs_{r}.safetensors
                       row r's states, as vLLM's ExampleHiddenStatesConnector writes them: `hidden_states`
                       [seq_len, num_layers, hidden] (the engine's dtype) and `token_ids` [seq_len] int64. The
                       trainer takes `hidden_states[:, :-1]` as the auxiliary layers and `hidden_states[:, -1]` as
                       the verifier's last hidden state, so the last slot must be the final pre-norm state.
                       `arrow-fp8`: `hidden_states` float8_e4m3fn and `hidden_states_scales` [seq_len, 1, 1] fp32, as
                       hs-connectors' FP8HiddenStatesConnector writes them (read back with its `FP8Transfer`).
  manifest.json, .eagle-compat.lock
                       as for the other formats (writer.py)
Rows are the samples in input order (lines skipped with --skip-uncovered have no row): row r holds the sample whose
index (`i` of data_{i} in the other formats) is the r-th smallest present. The dataset is written by the run that
completes the set, like data_config.json for the other formats: before that, `ArrowDataset` cannot open the directory
at all, so a partial set is never mistaken for a whole one.
"""
from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable
from typing import Any

from . import atomic_io, writer

HS_DIR = "hidden_states"
HS_FILE = re.compile(r"^hs_(\d+)\.safetensors$")
DATASET_FILE = re.compile(r"^(data-\d+-of-\d+\.arrow|dataset_info\.json|state\.json)$")
SCALES_KEY = "hidden_states_scales"  # hs_connectors.fp8_utils.SCALES_KEY


def hs_path(out_dir: str, row: int) -> str:
    return os.path.join(out_dir, HS_DIR, f"hs_{row}.safetensors")


def quantize_fp8(hs: Any) -> tuple[Any, Any]:
    """hs-connectors' FP8 format (hs_connectors/fp8_utils.py, 0.9.0): one fp32 scale per token over all layers and
    hidden dims, scale = amax / 448 (clamped at 1e-12), fp8 = (x / scale).to(float8_e4m3fn)."""
    import torch

    fp8 = torch.float8_e4m3fn
    x = hs.float()
    amax = x.abs().amax(dim=tuple(range(1, x.dim())), keepdim=True)
    scale = (amax / torch.finfo(fp8).max).clamp(min=1e-12)
    return (x / scale).to(fp8), scale


def dequantize_fp8(q: Any, scale: Any, dtype: Any) -> Any:
    """As hs-connectors' FP8Transfer reads it back (`fp8.to(dtype) * scale.to(dtype)`)."""
    return q.to(dtype) * scale.to(dtype)


def hs_bytes(input_ids: Any, hidden_states: list | Any, fmt: str = "arrow", stamp: str | None = None) -> bytes:
    import torch
    from safetensors.torch import save

    hs = hidden_states if isinstance(hidden_states, torch.Tensor) else torch.stack(list(hidden_states), dim=1)
    tensors = {"token_ids": torch.as_tensor(input_ids, dtype=torch.long).contiguous()}
    if fmt == "arrow-fp8":
        tensors["hidden_states"], tensors[SCALES_KEY] = (t.contiguous() for t in quantize_fp8(hs))
    else:
        tensors["hidden_states"] = hs.contiguous()
    return save(tensors, metadata={writer.STAMP_KEY: stamp} if stamp else None)


def save_hs(out_dir: str, row: int, input_ids: Any, hidden_states: list | Any, fmt: str = "arrow",
            layer_ids: list[int] | None = None, stamp: str | None = None) -> str:
    writer.require_finite(row, hidden_states, layer_ids)
    writer.require_varying(row, input_ids, hidden_states, layer_ids)
    path = hs_path(out_dir, row)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = hs_bytes(input_ids, hidden_states, fmt, stamp)
    atomic_io.atomic_write_bytes(path, data)
    return atomic_io.WrittenFile.at(path, atomic_io.content_digest(data))


def load_hs(path: str, dtype: Any = None) -> dict:
    """{"token_ids", "hidden_states" [T, L, H]}; fp8 files dequantized (to `dtype`, default bf16, as FP8Transfer)."""
    import torch
    from safetensors.torch import load_file

    t = load_file(path)
    if SCALES_KEY in t:
        t["hidden_states"] = dequantize_fp8(t["hidden_states"], t.pop(SCALES_KEY), dtype or torch.bfloat16)
    return t


def hs_files(out_dir: str) -> list[str]:
    d = os.path.join(out_dir, HS_DIR)
    if not os.path.isdir(d):
        return []
    return sorted((f for f in os.listdir(d) if HS_FILE.match(f)), key=lambda f: (len(f), f))


def is_arrow_dir(path: str) -> bool:
    return os.path.exists(os.path.join(path, "state.json")) or bool(hs_files(path))


def _features() -> Any:
    import datasets

    seq = getattr(datasets, "List", None) or datasets.Sequence  # datasets >= 4 names it List
    return datasets.Features({"input_ids": seq(datasets.Value("int64")), "loss_mask": seq(datasets.Value("int64")),
                              "seq_len": datasets.Value("int64")})


def write_dataset(out_dir: str, rows: Iterable[tuple[list[int], list[int]]]) -> None:
    """The Arrow dataset of (input_ids, loss_mask) rows, streamed (bounded memory), in torch format as speculators'
    preprocessing leaves it. Written into a temporary directory, then moved in with state.json last, and only then
    are the earlier dataset's data files that the new one does not have removed: until the new state.json is in
    place the earlier dataset stays whole (a run that dies between the moves leaves extra data files that the next
    completing run removes)."""
    import datasets

    tmp = os.path.join(out_dir, f".arrow-dataset.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        from datasets.arrow_writer import ArrowWriter

        staged = os.path.join(tmp, "rows.arrow")
        with ArrowWriter(features=_features(), path=staged) as w:  # row by row: memory stays bounded
            for ids, mask in rows:
                w.write({"input_ids": list(ids), "loss_mask": list(mask), "seq_len": len(ids)})
            w.finalize()
        ds = datasets.Dataset.from_file(staged)
        ds.set_format(type="torch")
        final = os.path.join(tmp, "final")
        from datasets.utils import logging as ds_logging

        bars = ds_logging.is_progress_bar_enabled()
        ds_logging.disable_progress_bar()  # one line per run is printed by the caller
        try:
            ds.save_to_disk(final)
        finally:
            if bars:
                ds_logging.enable_progress_bar()
        new = os.listdir(final)
        for name in new:  # on disk before they are moved in (atomic_io.fsync_renames then syncs the moves)
            atomic_io.fsync_file(os.path.join(final, name))
        order = sorted(new, key=lambda n: (n == "state.json", n == "dataset_info.json", n))
        for name in order:
            os.replace(os.path.join(final, name), os.path.join(out_dir, name))
        for name in os.listdir(out_dir):  # data files of the earlier dataset that the new one does not have
            if DATASET_FILE.match(name) and name.endswith(".arrow") and name not in new:
                os.unlink(os.path.join(out_dir, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_rows(out_dir: str) -> Any:
    """The Arrow dataset (memory-mapped), without the torch format: rows are plain lists."""
    import datasets

    return datasets.load_from_disk(out_dir).with_format(None)
