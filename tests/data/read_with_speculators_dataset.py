"""Shaped like speculators 0.3.0's train.py on the data side: imports speculators' trainer reader at its top (fails
on transformers 5 without eagle_compat) and loads every sample of a data directory with it."""
import sys

import torch
from speculators.train.data import Eagle3SampleFileDataset

if __name__ == "__main__":
    data_dir, out = sys.argv[1], sys.argv[2]
    dataset = Eagle3SampleFileDataset(datapath=data_dir, max_len=4096)
    samples = [dataset[i] for i in range(len(dataset))]
    torch.save({"count": len(dataset), "first": samples[0]}, out)
    print(f"read {len(dataset)} samples")
