"""Online training (eagle_compat.online.HiddenStates): the order (DistributedSampler's), a restart at a sample, the
rank split, the bounded read-ahead, an engine error reaching the loop, the DataLoader-worker refusal and bad input
refused before any engine starts run against stand-in engines; the samples' equality with extract's files (bit for
bit, fp32 engine, same batches) and no process left after the training process exits run on real CPU vLLM."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
import torch

from eagle_compat import online
from eagle_compat.generator import VllmHiddenStatesGenerator as RealGenerator  # (tests put stand-ins in its place)
from eagle_compat.errors import InvalidInput

from helpers import FakeEngine, in_newest_pass_only, write_dataset

N = 22


@pytest.fixture
def dataset(tmp_path):
    return write_dataset(tmp_path / "data.jsonl", N, 10, 40, seed=5, conversations_every=3)


def _ids(samples) -> list[list[int]]:
    return [s["input_ids"].tolist() for s in samples]


def _states(tiny_llama, dataset, **kw) -> online.HiddenStates:
    kw.setdefault("layers", [0, 5])
    kw.setdefault("batch_size", 4)
    return online.HiddenStates(tiny_llama, dataset, show_load_progress=False, **kw)


@pytest.mark.parametrize("n,world_size", [(22, 1), (22, 3), (7, 4), (8, 4)])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_the_order_is_distributed_samplers(n, world_size, shuffle, drop_last):
    from torch.utils.data import DistributedSampler
    for rank in range(world_size):
        for epoch in (0, 3):
            sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=7,
                                         drop_last=drop_last)
            sampler.set_epoch(epoch)
            assert online.epoch_order(n, epoch, seed=7, shuffle=shuffle, rank=rank, world_size=world_size,
                                      drop_last=drop_last) == list(sampler)


def test_the_ranks_split_the_samples_evenly_and_together_yield_every_one(tiny_llama, dataset, fake_engine):
    every = _ids(_states(tiny_llama, dataset, shuffle=False, world_size=1, rank=0))
    assert len(every) == N
    per_rank = [_ids(_states(tiny_llama, dataset, seed=3, world_size=4, rank=r)) for r in range(4)]
    assert {len(p) for p in per_rank} == {6}  # 22 padded to 24: every rank runs as many steps
    seen = [tuple(ids) for p in per_rank for ids in p]
    assert sorted(set(seen)) == sorted(set(map(tuple, every)))
    assert len(seen) - len(set(seen)) == 2  # the padding repeats two samples, as DistributedSampler does


def test_each_epoch_is_another_fixed_order_and_a_sample_is_what_its_file_would_hold(tiny_llama, dataset,
                                                                                      fake_engine):
    states = _states(tiny_llama, dataset, seed=1)
    first, second = _ids(states), _ids(states)  # the iteration's end moves on to the next epoch
    assert first != second and sorted(first) == sorted(second)
    again = _states(tiny_llama, dataset, seed=1)
    again.set_epoch(1)
    assert _ids(again) == second
    sample = next(iter(_states(tiny_llama, dataset, shuffle=False)))
    assert set(sample) == {"input_ids", "hidden_states", "loss_mask"}
    assert sample["loss_mask"].dtype == torch.long and len(sample["hidden_states"]) == 2


@pytest.mark.parametrize("stop_after", [5, 8, 22])
def test_a_restart_from_the_saved_state_goes_on_with_the_next_sample(tiny_llama, dataset, fake_engine, stop_after):
    """A trainer checkpoints the state after `stop_after` samples, dies, and a new process loads it: it yields the
    rest of the order, not a sample twice and none left out, then the next epoch (22: the epoch's end)."""
    whole = _states(tiny_llama, dataset, seed=2)
    epoch0, epoch1 = _ids(whole), _ids(whole)
    states = _states(tiny_llama, dataset, seed=2)
    taken, saved = [], None
    for sample in states:
        taken.append(sample["input_ids"].tolist())
        if len(taken) == stop_after:
            saved = json.loads(json.dumps(states.state_dict()))  # what a checkpoint keeps
            break
    restarted = _states(tiny_llama, dataset, seed=2)
    restarted.load_state_dict(saved)
    restarted.set_epoch(saved["epoch"])  # a trainer's loop sets the epoch it resumes: no effect on the position
    rest = _ids(restarted)
    assert taken + rest == epoch0  # (after the epoch's last sample: none)
    assert _ids(restarted) == epoch1


def test_a_state_saved_under_another_order_is_refused_naming_what_differs(tiny_llama, dataset, fake_engine):
    saved = _states(tiny_llama, dataset, seed=2, world_size=2, rank=1).state_dict()
    with pytest.raises(InvalidInput, match=r"seed: saved 2, here 3"):
        _states(tiny_llama, dataset, seed=3, world_size=2, rank=1).load_state_dict(saved)
    with pytest.raises(InvalidInput, match=r"world_size: saved 2, here 4.*rank: saved 1, here 0"):
        _states(tiny_llama, dataset, seed=2, world_size=4, rank=0).load_state_dict(saved)


class PipelinedStandIn:
    """The real generator's pipelining (VllmHiddenStatesGenerator.generate_batches and its engine thread) over the
    stand-in's states, counting the batches its engine has taken."""

    def __new__(cls, model_path, layer_ids=None, **kwargs):
        class Pipelined(RealGenerator):
            def __init__(self):  # no engine: the stand-in's states
                self.fake, self.executor, self._busy = FakeEngine(model_path, layer_ids), object(), threading.Lock()

            def _engine_batches(self, batches, truncate):
                for token_ids in batches:
                    cls.taken += 1
                    cls.took.set()
                    yield self.fake.generate(token_ids)

            def close(self):
                self.executor = None
        return Pipelined()


def test_the_engine_runs_at_most_read_ahead_batches_ahead_of_the_loop(tiny_llama, dataset, monkeypatch):
    """The loop holds its first sample; the engine takes batches until read_ahead finished ones wait, plus the one
    it holds for the queue and the one the loop is in, and no more (22 samples: 6 batches of 4)."""
    from eagle_compat import generator
    monkeypatch.setattr(generator, "VllmHiddenStatesGenerator", PipelinedStandIn)
    PipelinedStandIn.taken, PipelinedStandIn.took = 0, threading.Event()
    states = _states(tiny_llama, dataset, read_ahead=1)
    samples = iter(states)
    next(samples)
    bound = 1 + 1 + 1  # the loop's batch, read_ahead finished, one computed and waiting for room
    deadline = time.monotonic() + 30
    while PipelinedStandIn.taken < bound and time.monotonic() < deadline:
        PipelinedStandIn.took.wait(1)
        PipelinedStandIn.took.clear()
    assert PipelinedStandIn.taken == bound
    time.sleep(1)  # an unbounded engine thread would take all six batches in far less
    assert PipelinedStandIn.taken == bound
    assert len(list(samples)) == N - 1 and PipelinedStandIn.taken == 6


def test_an_engine_error_reaches_the_loop_with_its_cause_after_the_samples_before_it(tiny_llama, dataset,
                                                                                    fake_engine, monkeypatch):
    real_generate, calls = fake_engine.generate, []

    def generate(self, token_ids):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("worker 0 died: CUDA error: an illegal memory access")
        return real_generate(self, token_ids)
    monkeypatch.setattr(fake_engine, "generate", generate)
    taken = []
    with pytest.raises(RuntimeError, match="illegal memory access"):
        for sample in _states(tiny_llama, dataset, shuffle=False):
            taken.append(sample)
    assert len(taken) == 8  # the two batches before it


def test_a_dataloader_worker_is_refused_with_the_way_out(tiny_llama, dataset, fake_engine):
    from torch.utils.data import DataLoader
    loader = DataLoader(_states(tiny_llama, dataset), batch_size=None, num_workers=1,
                        multiprocessing_context="fork")
    with pytest.raises(Exception, match=r"num_workers=0"):
        next(iter(loader))
    spawned = DataLoader(_states(tiny_llama, dataset), batch_size=None, num_workers=1,
                         multiprocessing_context="spawn")
    with pytest.raises(InvalidInput, match=r"cannot be sent to another process.*num_workers=0"):
        next(iter(spawned))
    assert fake_engine.started == 0
    assert len(list(DataLoader(_states(tiny_llama, dataset), batch_size=None, num_workers=0))) == N


@pytest.mark.parametrize("bad,match", [
    ({"batch_size": 0}, r"batch_size=0; must be an int >= 1"),
    ({"read_ahead": 0}, r"read_ahead=0; must be an int >= 1"),
    ({"shuffle": 1}, r"shuffle=1; must be True or False"),
    ({"rank": 2, "world_size": 2}, r"rank=2 with world_size=2"),
    ({"rank": 0}, r"give both, or neither"),
    ({"layers": [0, 99]}, r"99"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization=1.5; must be in \(0, 1\]"),
    ({"load_format": ""}, r"load_format=''; must be one of vLLM's load formats"),
])
def test_bad_options_are_refused_before_any_engine_starts(tiny_llama, dataset, fake_engine, bad, match):
    with pytest.raises(InvalidInput, match=match):
        _states(tiny_llama, dataset, **bad)
    assert fake_engine.started == 0


def test_a_bad_line_is_refused_naming_it_before_any_engine_starts(tiny_llama, dataset, fake_engine):
    lines = open(dataset).read().splitlines(keepends=True)
    lines[13] = json.dumps({"input_ids": [5, 6, 7], "loss_mask": [1.0, 0.0, 1.0]}) + "\n"
    with open(dataset, "w") as f:
        f.writelines(lines)
    with pytest.raises(InvalidInput, match=r"data\.jsonl:14: "):
        _states(tiny_llama, dataset)
    assert fake_engine.started == 0


# ---- real CPU vLLM ---------------------------------------------------------------------------------------------
# (the iterable's own code does not depend on the release; the generator it drives runs on each in its own suites)
newest_pass_only = in_newest_pass_only("the iterable's code is the same on every release; its generator is tested on "
                                       "each by test_e2e_generator.py")

@pytest.mark.engine
@newest_pass_only
def test_the_samples_are_bit_for_bit_extracts_files_and_equal_hf(tiny_llama, dataset, tmp_path):
    """In the input's order and extract's batches (shuffle off, one rank, the same batch size), every tensor the
    iterable yields equals the file extract wrote for that sample, bit for bit; and HF transformers (fp32)."""
    from eagle_compat.extract import job, writer

    from helpers import assert_matches_hf, extract_options
    out = tmp_path / "out"
    job.run(extract_options(tiny_llama, dataset, out, max_len=64, dtype="float32", gpu_memory_utilization=0.3))
    files = [writer.load_sample(writer.sample_path(str(out), i, "pt")) for i in range(N)]
    with _states(tiny_llama, dataset, shuffle=False, max_len=64, dtype="float32",
                 gpu_memory_utilization=0.3) as states:
        samples = [{k: (v if k != "hidden_states" else [h.clone() for h in v]) for k, v in s.items()}
                   for s in states]
    assert len(samples) == len(files) == N
    for n, (got, want) in enumerate(zip(samples, files)):
        assert torch.equal(got["input_ids"], want["input_ids"]), n
        assert torch.equal(got["loss_mask"], want["loss_mask"]), n
        assert len(got["hidden_states"]) == len(want["hidden_states"]) == 2
        for layer, (g, w) in enumerate(zip(got["hidden_states"], want["hidden_states"])):
            assert g.dtype == w.dtype == torch.float32 and torch.equal(g, w), (n, layer)
    assert_matches_hf(samples, tiny_llama, _ids(samples), [0, 5], precision="fp32")


TRAINER = textwrap.dedent("""
    import os, signal, sys
    from eagle_compat.online import HiddenStates


    def main(model, data, how):
        states = HiddenStates(model, data, layers=[0, 5], batch_size=4, max_len=64, dtype="float32",
                              gpu_memory_utilization=0.3, show_load_progress=False)
        for n, sample in enumerate(states):
            if n == 2:
                print("training", flush=True)
                if how == "sigterm":
                    os.kill(os.getpid(), signal.SIGTERM)
                    signal.pause()
                sys.exit(0)  # no close(): the loop's process simply ends


    if __name__ == "__main__":  # vLLM's workers are spawned: they import this script again
        main(*sys.argv[1:])
""")


def _tagged(tag: str) -> list[str]:
    """The processes whose environment carries `tag` (the trainer's and everything it started)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if tag.encode() in f.read():
                    with open(f"/proc/{pid}/cmdline", "rb") as c:
                        command = c.read().replace(b"\0", b" ").decode(errors="replace")
                    found.append(f"{pid} {command[:100]}")
        except OSError:
            continue
    return found


@pytest.mark.engine
@newest_pass_only
@pytest.mark.parametrize("how", ["exit", "sigterm"])
def test_no_engine_process_outlives_the_training_process(tiny_llama, dataset, tmp_path, how):
    """The training process ends while the engine runs ahead (sys.exit without close(), or SIGTERM): every process
    it started ends with it (vLLM's workers and what they started)."""
    tag = f"EAGLE_COMPAT_TEST_TRAINER={uuid.uuid4().hex}"
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    env = {**os.environ, tag.split("=")[0]: tag.split("=")[1]}
    proc = subprocess.run([sys.executable, str(script), tiny_llama, dataset, how], env=env, capture_output=True,
                          text=True, timeout=600)
    assert "training" in proc.stdout, proc.stderr[-3000:]
    assert proc.returncode == (-signal.SIGTERM if how == "sigterm" else 0), proc.stderr[-3000:]
    deadline = time.monotonic() + 30  # a process being killed is gone within moments; none may stay
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _tagged(tag), _tagged(tag)
