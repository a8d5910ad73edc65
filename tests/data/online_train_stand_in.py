"""A training script shaped as speculators 0.3.0's scripts/train.py (the names `eagle-compat run --online` looks
for, the same `setup_dataloader` signature), whose `main` counts the batches its loader gives over two epochs, as
the trainer iterates them (`batch_sampler.set_epoch`, then the loader), and prints one line `STAND_IN {json}`."""
import argparse
import json

from speculators.train.data import create_collate_fn, standardize_data_v1  # noqa: F401  (looked up by the runner)
from speculators.train.noise_transforms import AddUniformNoise  # noqa: F401

NOISE_STD = 0.05


def setup_dataloader(file_list, world_size, local_rank, add_noise=True, data_format_version=1):
    raise AssertionError("the script's own data loading ran: the runner did not replace it")


def main(args):
    train = setup_dataloader([], 1, 0, add_noise=True)
    val = setup_dataloader([], 1, 0, add_noise=False)
    seen = []
    for epoch in range(2):
        train.batch_sampler.set_epoch(epoch)
        seen.append([(tuple(b["input_ids"].shape), b["lengths"].tolist()) for b in train])
    print("STAND_IN " + json.dumps({"len": len(train), "val": val is None, "batches": seen}), flush=True)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--total-seq-len", type=int, default=8192)
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()
    main(args)
