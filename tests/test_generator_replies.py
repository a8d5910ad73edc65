"""A reply left unread keeps the generator one reply behind (docs/adr/0018-queued-calls.md): a KeyboardInterrupt inside
a blocking call (a notebook), a deadline missed by 0.11.x's blocking steps. Any failure that is not the worker's own
reply closes the generator, on every path; a worker's own failure reply keeps it open (the stream of replies is still in
step). No engine: the generator's executor is a stand-in and vLLM's calls are replaced where eagle_compat makes them."""
from __future__ import annotations

import collections

import pytest

from eagle_compat import engine, generator


class Executor:
    shut_down = 0

    def shutdown(self):
        Executor.shut_down += 1


def _generator():
    gen = object.__new__(generator.VllmHiddenStatesGenerator)
    gen.executor, gen._sent, gen._env_restore, gen._ring, gen._worker_errors = Executor(), collections.deque(), [], None, None
    Executor.shut_down = 0
    return gen


@pytest.mark.parametrize("path", ["blocking", "unqueued_step"])
@pytest.mark.parametrize("failure", [KeyboardInterrupt, TimeoutError])
def test_a_call_whose_reply_is_left_unread_closes_the_generator(monkeypatch, path, failure):
    def fails(*args, **kwargs):
        raise failure("RPC call to execute_model timed out." if failure is TimeoutError else "")
    gen = _generator()
    if path == "blocking":  # _rpc0: vLLM's own blocking collective_rpc
        monkeypatch.setattr(engine.rpc, "rpc_rank0", fails)
        call = lambda: gen._rpc0("eagle_compat_describe")  # noqa: E731
    else:  # _submit where vLLM cannot queue calls (0.11.x): the call waits for its reply inside
        monkeypatch.setattr(engine.rpc, "submit", fails)
        call = lambda: gen._submit("eagle_compat_finish", "b0")  # noqa: E731
    with pytest.raises(failure):
        call()
    assert gen.executor is None and Executor.shut_down == 1
    with pytest.raises(generator.InvalidInput, match="closed"):
        gen.generate([[1, 2, 3]])


def test_a_workers_own_failure_reply_keeps_the_generator_open(monkeypatch):
    def worker_failed(*args, **kwargs):
        raise RuntimeError("Worker failed with error 'boom', please check the stack trace above for the root cause")
    gen = _generator()
    monkeypatch.setattr(engine.rpc, "rpc_rank0", worker_failed)
    with pytest.raises(Exception, match="boom"):
        gen._rpc0("eagle_compat_describe")
    assert gen.executor is not None and Executor.shut_down == 0
