"""Run with the reader environment's python (speculators 0.9.0, no vLLM; scripts/_env.sh ensure_reader_env).

Reads every sample of each directory with speculators' own `ArrowDataset(..., on_missing="raise")` (any warning, e.g.
its token-id mismatch warning, is an error here: it would return SampleUnavailable and the trainer would skip the
sample silently), runs its `check_hidden_states` on every hidden_states/hs_{i}.safetensors, and saves what the
trainer would get. usage: python read_with_speculators_arrow.py OUT.pt DIR[:fp8] ...
"""
import importlib.metadata
import os
import sys
import warnings
from pathlib import Path

import torch

from hs_connectors import FileTransfer, FP8Transfer
from speculators.data_generation.offline import check_hidden_states
from speculators.train.data import ArrowDataset

if __name__ == "__main__":
    out, dirs = sys.argv[1], sys.argv[2:]
    warnings.simplefilter("error")
    result = {"speculators": importlib.metadata.version("speculators"), "dirs": {}}
    for spec in dirs:
        path, _, kind = spec.partition(":")
        hs_dir = Path(path) / "hidden_states"
        transfer = FP8Transfer(hs_dir) if kind == "fp8" else FileTransfer(hs_dir)
        ds = ArrowDataset(max_len=4096, datapath=path, on_missing="raise", transfer=transfer)
        items = []
        for i in range(len(ds)):
            item = ds[i]
            if not isinstance(item, dict):
                raise SystemExit(f"{path}: sample {i}: ArrowDataset returned {item!r}, not a sample")
            check_hidden_states(transfer.get_cached(i), ds.data[i]["input_ids"].tolist())
            items.append({k: item[k] for k in ("hidden_states", "verifier_last_hidden_states", "input_ids",
                                               "loss_mask")})
        hs_files = len([f for f in os.listdir(hs_dir) if f.endswith(".safetensors")])
        result["dirs"][spec] = {"count": len(ds), "hs_files": hs_files, "items": items,
                                "seq_len": list(ds.data.with_format(None)["seq_len"])}
        print(f"{spec}: ArrowDataset read {len(ds)} samples; check_hidden_states passed on {len(ds)} hs files "
              f"({hs_files} in hidden_states/)")
    torch.save(result, out)
