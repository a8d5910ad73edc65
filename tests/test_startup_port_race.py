"""Engines starting at once on one host can be handed the same torch.distributed port: vLLM's `get_open_port()`
releases the port it found before the worker binds it (vllm#39015). Seen in our CI on 0.16.0: EADDRINUSE at worker
start-up, two test processes starting engines at once. Here the race is made certain without timing: vLLM's port
choice hands the first start a port this test holds listening; later starts get vLLM's own choice. From 0.28 both
executors' workers meet at a file store: no port to lose, the engine tests skip there (the 0.16.0 pass runs them).
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import socket

import pytest

import eagle_compat
from eagle_compat import VllmHiddenStatesGenerator, WorkerError, detect, remote_errors

from helpers import assert_matches_hf, prompts


EXECUTORS = {False: "vllm.v1.executor.multiproc_executor", True: "vllm.v1.executor.uniproc_executor"}


def needs_a_port():
    if not detect.feature("workers_meet_at_released_port"):
        pytest.skip("this vLLM's spawned workers meet at a file store: no port to lose (0.28+)")


@contextlib.contextmanager
def first_start_handed_a_taken_port(monkeypatch, in_process=False):
    executor_module = importlib.import_module(EXECUTORS[in_process])

    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("", 0))
    held.listen()
    taken = held.getsockname()[1]
    handed: list[int] = []
    vllms_choice = executor_module.get_open_port

    def get_open_port():
        handed.append(taken if not handed else vllms_choice())
        return handed[-1]

    monkeypatch.setattr(executor_module, "get_open_port", get_open_port)
    try:
        yield taken, handed
    finally:
        held.close()


@pytest.mark.engine
@pytest.mark.parametrize("in_process, ranks", [(False, 1), (True, 1), (False, 2)],
                         ids=["spawned", "in_process", "spawned-tp2"])
def test_generator_start_that_lost_the_port_race_starts_again_and_matches_hf(tiny_llama, monkeypatch, caplog,
                                                                            in_process, ranks):
    """With two ranks, rank 0 fails to bind and rank 1 waits on the held port (a client of no store) until vLLM
    ends the failed start's workers."""
    needs_a_port()
    if ranks > 1:
        if len(os.sched_getaffinity(0)) < ranks:
            pytest.skip("tensor parallel 2 on CPU needs two cores")
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    layer_ids = [0, 2, 5]
    with first_start_handed_a_taken_port(monkeypatch, in_process) as (taken, handed):
        with caplog.at_level(logging.WARNING, logger="eagle_compat"):
            gen = VllmHiddenStatesGenerator(tiny_llama, layer_ids=layer_ids, max_model_len=256,
                                            gpu_memory_utilization=0.3, dtype="float32", in_process=in_process,
                                            tensor_parallel_size=ranks)
    with gen:
        assert handed[0] == taken and len(handed) == 2 and handed[1] != taken
        assert "lost the race for its torch.distributed port" in caplog.text
        batch = prompts(3, 5, 40, seed=3)
        assert_matches_hf(gen.generate(batch), tiny_llama, batch, layer_ids, precision="fp32")


@pytest.mark.engine
def test_control_the_taken_port_fails_a_start_that_is_not_run_again(tiny_llama, monkeypatch):
    """Without a second start, the held port fails start-up: the test above exercises the race, not luck."""
    needs_a_port()
    monkeypatch.setattr(remote_errors, "START_ATTEMPTS", 1)
    with first_start_handed_a_taken_port(monkeypatch) as (taken, handed):
        with pytest.raises(WorkerError, match="EADDRINUSE") as info:
            VllmHiddenStatesGenerator(tiny_llama, layer_ids=[0], max_model_len=256, gpu_memory_utilization=0.3,
                                      dtype="float32")
    assert handed == [taken] and info.value.method == "worker start-up"


@pytest.mark.engine
def test_speculators_generator_start_that_lost_the_port_race_starts_again(tiny_llama, monkeypatch):
    needs_a_port()
    eagle_compat.install()
    try:
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator as Shim

        layer_ids = [0, 2, 5]
        with first_start_handed_a_taken_port(monkeypatch) as (taken, handed):
            gen = Shim(tiny_llama, layer_ids=layer_ids, max_model_len=256, gpu_memory_utilization=0.3)
        try:
            assert handed[0] == taken and len(handed) == 2
            batch = prompts(2, 5, 40, seed=4)
            assert_matches_hf(gen.generate(batch), tiny_llama, batch, layer_ids, precision="bf16")
        finally:
            gen.executor.shutdown()
    finally:
        eagle_compat.uninstall()


def _worker_start_failure(message: str) -> Exception:
    try:
        try:
            raise RuntimeError("WorkerProc initialization failed due to an exception in a background process")
        except RuntimeError as exc:
            raise WorkerError("DistNetworkError", message, "", "worker start-up") from exc
    except WorkerError as exc:
        return exc


def test_only_a_lost_port_race_is_started_again():
    taken = _worker_start_failure("The server socket has failed to listen on any local network address. port: 1, "
                                  "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")
    other = _worker_start_failure("connection refused")
    in_this_process = RuntimeError("wrapped")
    in_this_process.__context__ = OSError("EADDRINUSE: address already in use")  # a one-rank executor's own start
    assert remote_errors.lost_port_race(taken) and remote_errors.lost_port_race(in_this_process)
    assert not remote_errors.lost_port_race(other)

    starts: list[int] = []

    def start(failure):
        def attempt():
            starts.append(1)
            raise failure
        return attempt

    with pytest.raises(WorkerError, match="EADDRINUSE"):
        remote_errors.retrying_lost_port_race(start(taken), attempts=3)
    assert len(starts) == 3
    starts.clear()
    with pytest.raises(WorkerError, match="connection refused"):
        remote_errors.retrying_lost_port_race(start(other), attempts=3)
    assert len(starts) == 1
    assert remote_errors.retrying_lost_port_race(lambda: "engine", attempts=3) == "engine"
