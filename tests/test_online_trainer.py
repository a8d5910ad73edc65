"""speculators 0.3.0's scripts/train.py trained online (`eagle-compat run --online`, online_trainer.py): a batch
the online loader gives equals the batch the script's own loader (speculators' Eagle3SampleFileDataset and collate
function) makes of extract's files for the same samples, every key bit for bit; every rank runs as many batches; the
script runs with its data loading replaced, and another script is refused naming what it lacks. The samples'
states are the stand-in engine's here: test_online.py shows the iterable's equal extract's files on real vLLM."""
from __future__ import annotations

import argparse
import os

import pytest
import torch

from eagle_compat import cli, online, online_trainer
from eagle_compat.errors import InvalidInput
from eagle_compat.extract import job, writer

from helpers import extract_options, write_dataset

N = 22
LAYERS = [0, 2, 5]  # the tiny Llama's: two for the drafter's input, the last for its target
TRAIN_SCRIPT = os.path.join(os.path.dirname(__file__), "data", "speculators_v0_3_0", "train.py")
STAND_IN = os.path.join(os.path.dirname(__file__), "data", "online_train_stand_in.py")


@pytest.fixture(autouse=True)
def installed():
    """speculators 0.3.0 imports on this transformers only under install() (its config classes): load_script
    installs; each test leaves nothing installed."""
    from eagle_compat import uninstall
    yield
    uninstall()


@pytest.fixture
def dataset(tmp_path):
    return write_dataset(tmp_path / "data.jsonl", N, 10, 40, seed=5, conversations_every=3)


def _states(tiny_llama, dataset, **kw):
    return online.HiddenStates(tiny_llama, dataset, layers=LAYERS, batch_size=4, seed=4, show_load_progress=False,
                               **kw)


@pytest.mark.parametrize("total_seq_len", [64, 100])
def test_an_online_batch_is_the_scripts_own_batch_of_extracts_files(tiny_llama, dataset, tmp_path, fake_engine,
                                                                    total_seq_len):
    """Without the script's noise (random): each pack of samples, collated online, against speculators 0.3.0's
    dataset reading extract's files of the same samples in the same order, and its collate function."""
    out = tmp_path / "out"
    job.run(extract_options(tiny_llama, dataset, out, layers=LAYERS, max_len=64))
    script = online_trainer.load_script(TRAIN_SCRIPT)  # speculators 0.3.0's own, unmodified (under install())
    from speculators.train.data import Eagle3SampleFileDataset
    collate, standardize = script["create_collate_fn"](total_seq_len), script["standardize_data_v1"]
    states = _states(tiny_llama, dataset)
    loader = online_trainer.PackedLoader(states, total_seq_len, standardize, None, collate)
    order, packs, count = states.order(0), loader.packs_of(0, 0), len(loader)
    batches = list(loader)  # (its end moves the loader on to the next epoch)
    assert len(batches) == len(packs) == count > 1
    assert any(len(p) > 1 for p in packs)  # packs of several samples: the collate's concatenation is compared
    for pack, got in zip(packs, batches):
        files = [writer.sample_path(str(out), states.samples[order[i]].index, "pt") for i in pack]
        theirs = Eagle3SampleFileDataset(max_len=total_seq_len, file_list=files, standardize_fn=standardize)
        want = collate([theirs[i] for i in range(len(files))])
        assert set(got) == set(want)
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (pack, key)


def test_every_rank_runs_as_many_batches_and_each_epoch_its_own_order(tiny_llama, dataset, fake_engine):
    script = online_trainer.load_script(TRAIN_SCRIPT)
    loaders = [online_trainer.PackedLoader(_states(tiny_llama, dataset, rank=r, world_size=3), 48,
                                           script["standardize_data_v1"], None, script["create_collate_fn"](48))
               for r in range(3)]
    counts = {len(loader) for loader in loaders}
    assert len(counts) == 1 and counts.pop() >= 2
    for loader in loaders:
        count = len(loader)
        assert len(list(loader)) == count  # each rank as many, however its own samples pack
    first = loaders[0]
    first.batch_sampler.set_epoch(0)
    count0, epoch0 = len(first), [b["input_ids"] for b in first]
    first.batch_sampler.set_epoch(1)
    count1, epoch1 = len(first), [b["input_ids"] for b in first]
    assert (len(epoch0), len(epoch1)) == (count0, count1)  # (an epoch's packing may give another count)
    assert any(not torch.equal(a, b) for a, b in zip(epoch0, epoch1))


def test_run_online_runs_the_script_with_its_data_loading_replaced(tiny_llama, dataset, fake_engine, capsys):
    code = cli.main(["run", "--online", "--model", tiny_llama, "--data", dataset, "--layers", "0,2,5",
                     "--batch-size", "4", "--", "python", STAND_IN, "--total-seq-len", "64"])
    out = capsys.readouterr()
    assert code == 0, out.err
    line = next(x for x in out.out.splitlines() if x.startswith("STAND_IN "))
    import json
    seen = json.loads(line[len("STAND_IN "):])
    assert seen["val"] and seen["len"] >= 2 and [len(e) for e in seen["batches"]] == [seen["len"]] * 2
    assert all(shape == [1, 64] for epoch in seen["batches"] for shape, _ in epoch)
    assert fake_engine.started == 1


def test_a_script_that_is_not_speculators_train_is_refused_naming_what_it_lacks(tiny_llama, dataset, tmp_path,
                                                                               fake_engine, capsys):
    other = tmp_path / "train.py"
    other.write_text("def main(args):\n    pass\n\n\ndef parse_args():\n    return None\n")
    code = cli.main(["run", "--online", "--model", tiny_llama, "--data", dataset, "--", str(other)])
    err = capsys.readouterr().err
    assert code == 2 and "is not speculators 0.3.0's scripts/train.py: it defines no setup_dataloader" in err, err
    assert fake_engine.started == 0
    code = cli.main(["run", "--online", "--model", tiny_llama, "--data", dataset])
    assert code == 2 and "no training script" in capsys.readouterr().err


def test_the_script_reads_args_as_its_main_block_sets_them(tiny_llama, dataset, fake_engine):
    """The replaced setup_dataloader reads --total-seq-len from the script's `args`, as the script's own does."""
    script = online_trainer.load_script(TRAIN_SCRIPT)
    script["args"] = argparse.Namespace(total_seq_len=64)
    opened: list = []
    setup = online_trainer.online_setup_dataloader(script, dict(model=tiny_llama, data=dataset, layers=LAYERS,
                                                                 show_load_progress=False), opened)
    loader = setup([], 1, 0, add_noise=True, data_format_version=1)
    assert loader.total_seq_len == 64 and len(opened) == 1
    assert setup([], 1, 0, add_noise=False, data_format_version=1) is None  # no validation loader
    with pytest.raises(InvalidInput, match="--data-format-version 0"):
        setup([], 1, 0, add_noise=True, data_format_version=0)
