"""speculators 0.3.0's `scripts/train.py`, unmodified, trained online: `eagle-compat run ... -- python
scripts/train.py ARGS` runs the script in this process with its `setup_dataloader` replaced by one whose loader takes
samples from `online.HiddenStates`, no files written or read.

The script builds its training data in `setup_dataloader(file_list, world_size, local_rank, add_noise,
data_format_version)`: speculators' `Eagle3SampleFileDataset` over the files, a multipack batch sampler and its
collate function. The replacement keeps what reaches the trainer: each sample goes through what the dataset's
`__getitem__` does after its `torch.load` (`trainer_sample`: standardize, hidden states as float32, lengths and
positions, the script's noise, `shift_batch`), consecutive samples of this rank's order are packed into
`--total-seq-len` tokens, and speculators' own collate function makes each batch: a batch equals what the script's
own loader gives for the same samples from extract's files, bit for bit (tests/test_online_trainer.py).

Decided: every rank runs as many batches an epoch (the fewest any rank's packing gives: FSDP's collectives wait for
every rank); the script's validation loader is none (a second engine, or the training engine's time, for a few
batches of loss; the trainer logs that it skips validation). The trainer resumes at an epoch's start, as it does
from files.
"""
from __future__ import annotations

import inspect
import os
import runpy
import sys
from typing import Any, Callable, Iterator

from .errors import InvalidInput

SCRIPT_NAMES = ("setup_dataloader", "parse_args", "main", "create_collate_fn", "standardize_data_v1",
                "AddUniformNoise", "NOISE_STD")
SETUP_PARAMETERS = ["file_list", "world_size", "local_rank", "add_noise", "data_format_version"]


def trainer_sample(sample: dict, standardize: Callable[[dict], dict], transform: Any = None) -> dict:
    """What speculators 0.3.0's Eagle3SampleFileDataset.__getitem__ makes of a sample file's dict (speculators/train/
    data.py, after its torch.load): the same steps, in the same order."""
    import torch
    from speculators.train.data import shift_batch

    data = standardize(sample)
    data = {k: v.to(torch.float) if "hidden_states" in k else v for k, v in data.items()}
    seq_len = data["input_ids"].shape[0]
    data["lengths"] = torch.tensor([seq_len], dtype=torch.long)
    data["position_ids"] = torch.arange(seq_len, dtype=torch.long)
    if transform:
        data = transform(data)
    return shift_batch(data)


def packs(lengths: list[int], total_seq_len: int) -> list[range]:
    """Consecutive samples packed into `total_seq_len` tokens each, their lengths as the trainer sees them (one less
    than the sample's: shift_batch). A sample longer than that goes alone (the collate function cuts it)."""
    out, start, used = [], 0, 0
    for k, n in enumerate(lengths):
        if k > start and used + n - 1 > total_seq_len:
            out.append(range(start, k))
            start, used = k, 0
        used += n - 1
    if start < len(lengths):
        out.append(range(start, len(lengths)))
    return out


class PackedLoader:
    """The trainer's loader: `len()` batches an epoch, each speculators' collate of a pack of this rank's samples.
    It is its own `batch_sampler` (the trainer calls `batch_sampler.set_epoch(epoch)` before each epoch)."""

    def __init__(self, states: Any, total_seq_len: int, standardize: Callable[[dict], dict], transform: Any,
                 collate: Callable[[list[dict]], dict]):
        self.states, self.total_seq_len = states, total_seq_len
        self.standardize, self.transform, self.collate = standardize, transform, collate
        self._lengths = [len(s.input_ids) for s in states.samples]

    @property
    def batch_sampler(self) -> "PackedLoader":
        return self

    def set_epoch(self, epoch: int) -> None:
        self.states.set_epoch(epoch)

    def packs_of(self, rank: int, epoch: int) -> list[range]:
        from .online import epoch_order
        s = self.states
        order = epoch_order(len(self._lengths), epoch, seed=s.seed, shuffle=s.shuffle, rank=rank,
                            world_size=s.world_size, drop_last=s.drop_last)
        return packs([self._lengths[k] for k in order], self.total_seq_len)

    def __len__(self) -> int:
        epoch = self.states.epoch
        return min(len(self.packs_of(rank, epoch)) for rank in range(self.states.world_size))

    def __iter__(self) -> Iterator[dict]:
        epoch, count = self.states.epoch, len(self)
        samples = iter(self.states)
        try:
            for pack in self.packs_of(self.states.rank, epoch)[:count]:
                yield self.collate([trainer_sample(next(samples), self.standardize, self.transform) for _ in pack])
        finally:
            samples.close()  # the rest of the epoch is not trained on: the engine's thread stops
        self.states.set_epoch(epoch + 1)


def online_setup_dataloader(script: dict, states_options: dict, opened: list) -> Callable[..., Any]:
    """The script's `setup_dataloader`, online: its training loader a PackedLoader, its validation loader none.
    Each HiddenStates made goes into `opened` (closed when the script ends)."""
    def setup_dataloader(file_list: list, world_size: int, local_rank: int, add_noise: bool = True,
                         data_format_version: int = 1) -> PackedLoader | None:
        from .online import HiddenStates
        if not add_noise:  # the validation loader (the script asks for it without noise): none, said by the trainer
            return None
        if data_format_version != 1:
            raise InvalidInput(f"--data-format-version {data_format_version}: online samples are of version 1 (what "
                               "extract writes); leave the option out")
        total = script["args"].total_seq_len
        transform = script["AddUniformNoise"](std=script["NOISE_STD"],
                                              tensors=("hidden_states", "verifier_last_hidden_states"))
        # the script gives the sampler its local rank as the rank (one node), as here
        states = HiddenStates(**states_options, rank=local_rank, world_size=world_size)
        opened.append(states)
        return PackedLoader(states, total, script["standardize_data_v1"], transform, script["create_collate_fn"](total))
    return setup_dataloader


def load_script(path: str) -> dict:
    """The training script's globals, its `if __name__ == "__main__"` block not run; refused where it is not
    speculators 0.3.0's scripts/train.py (naming what it lacks). Under install(): speculators 0.3.0 imports on the
    installed transformers only patched (patches/), as for `eagle-compat run` without --online."""
    from .installer import install

    if not os.path.isfile(path):
        raise InvalidInput(f"training script {path!r}: no such file")
    install()
    ran = runpy.run_path(path, run_name="__eagle_compat_run__")
    # runpy returns a copy: the functions' own globals are what `main` looks names up in
    script = ran["main"].__globals__ if callable(ran.get("main")) else ran
    missing = [name for name in SCRIPT_NAMES if name not in script]
    setup = script.get("setup_dataloader")
    parameters = list(inspect.signature(setup).parameters) if callable(setup) else []
    if missing or parameters != SETUP_PARAMETERS:
        raise InvalidInput(f"training script {path!r} is not speculators 0.3.0's scripts/train.py: "
                           + (f"it defines no {', '.join(missing)}" if missing else
                              f"its setup_dataloader takes ({', '.join(parameters)}), not "
                              f"({', '.join(SETUP_PARAMETERS)})")
                           + ". `eagle-compat run` replaces that script's data loading only")
    return script


def run_script(command: list[str], states_options: dict) -> int:
    """Runs `command` (`[python] scripts/train.py ARGS`) in this process, its data loading online."""
    if command and os.path.basename(command[0]).startswith("python"):
        command = command[1:]
    if not command:
        raise InvalidInput("no training script: give it after --, e.g. `-- python scripts/train.py "
                           "--verifier-name-or-path MODEL ...`")
    script = load_script(command[0])
    opened: list = []
    script["setup_dataloader"] = online_setup_dataloader(script, states_options, opened)
    saved_argv = sys.argv
    sys.argv = list(command)
    try:
        script["args"] = script["parse_args"]()  # as its __main__ block does: setup_dataloader reads it
        script["main"](script["args"])
    finally:
        sys.argv = saved_argv
        for states in opened:
            states.close()
        from .installer import uninstall
        uninstall()
    return 0


ONLINE_USAGE = ("usage: eagle-compat run --online --model MODEL --data DATA.jsonl [--layers IDS] [--batch-size N] "
                "[--max-len N] [--seed N] [--dtype D] [--gpu-memory-utilization F] [--read-ahead N] "
                "[--trust-remote-code] [python] scripts/train.py ARGS...\n"
                "       speculators 0.3.0's scripts/train.py, unmodified, its data from the engine: no file written")


def parse_online(argv: list[str]) -> tuple[dict, list[str]]:
    """`run --online`'s options (extract's, of the same names and meanings) and the training command after them."""
    import argparse

    from .extract import job_options
    from .extract.conversation import LOSS_MASKS

    default, parse_layers = job_options.defaults(), job_options.parse_layers  # extract's, declared there once
    parser = argparse.ArgumentParser(prog="eagle-compat run --online", usage=ONLINE_USAGE, add_help=False)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--layers", type=parse_layers)
    parser.add_argument("--batch-size", type=int, default=default["batch_size"])
    parser.add_argument("--max-len", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default=default["dtype"])
    parser.add_argument("--gpu-memory-utilization", type=float)
    parser.add_argument("--read-ahead", type=int, default=2)
    parser.add_argument("--min-loss-tokens", type=int, default=default["min_loss_tokens"])
    parser.add_argument("--loss-mask", default=default["loss_mask"], choices=LOSS_MASKS)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    try:
        args = parser.parse_args(argv)
    except SystemExit:  # argparse has printed what is wrong
        raise InvalidInput(ONLINE_USAGE) from None
    options = dict(model=args.model, data=args.data, layers=args.layers, batch_size=args.batch_size,
                   max_len=args.max_len, seed=args.seed, dtype=args.dtype,
                   gpu_memory_utilization=args.gpu_memory_utilization, read_ahead=args.read_ahead,
                   min_loss_tokens=args.min_loss_tokens, loss_mask=args.loss_mask,
                   trust_remote_code=args.trust_remote_code)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return options, command


def main(argv: list[str]) -> int:
    """`eagle-compat run --online ...`: exit status 2 for a bad command line or input, the script's otherwise."""
    from .errors import EagleCompatError
    if argv[:1] in (["-h"], ["--help"]):
        print(ONLINE_USAGE)
        return 0
    try:
        options, command = parse_online(argv)
        return run_script(command, options)
    except EagleCompatError as exc:
        print(f"eagle-compat run --online: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:
        return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
