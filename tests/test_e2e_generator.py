"""eagle_compat.VllmHiddenStatesGenerator on real CPU vLLM: fp32 parity with HF (<= 1e-4), bf16 by default,
clear errors for bad input with the engine still usable afterwards, worker errors with their traceback."""
from __future__ import annotations

import os

import pytest
import torch

from eagle_compat import InvalidInput, VllmHiddenStatesGenerator, tiny_models

from helpers import assert_matches_hf, assert_workers_hold_only_the_last_batch, prompts

pytestmark = pytest.mark.engine

FAMILIES = {"llama": 6, "deepseek_v3": 4}


@pytest.fixture(scope="module", params=list(FAMILIES))
def fp32_generator(request):
    n = FAMILIES[request.param]
    path = tiny_models.build_tiny_model(request.param)
    layer_ids = [n - 1, 0, (n - 1) // 2, n - 2]  # deliberately unsorted: results follow this order
    gen = VllmHiddenStatesGenerator(path, layer_ids=layer_ids, max_model_len=512, gpu_memory_utilization=0.3,
                                    dtype="float32")
    yield request.param, path, layer_ids, gen
    gen.close()


def test_fp32_parity_with_hf(fp32_generator):
    family, path, layer_ids, gen = fp32_generator
    shared = prompts(1, 20, 20, seed=9)[0]
    batch = prompts(6, 5, 200, seed=4) + prompts(3, 10, 40, seed=5, prefix=shared)
    results = gen.generate(batch)
    worst = assert_matches_hf(results, path, batch, layer_ids, precision="fp32")
    print(f"\n{family} eagle_compat generator fp32 worst abs error per layer: {worst}")
    contract = gen.describe()
    assert contract["output_kind"] == "pair" and contract["num_layers"] == FAMILIES[family]


def test_big_batch_equals_alone_fp32(fp32_generator):
    family, path, layer_ids, gen = fp32_generator
    batch = prompts(36, 200, 300, seed=6)
    assert len(batch) > 32 and sum(map(len, batch)) > 8192
    together = gen.generate(batch)
    again = gen.generate(batch)
    for i in (0, 33, 35):
        alone = gen.generate([batch[i]])[0]
        for x, y, z in zip(alone["hidden_states"], together[i]["hidden_states"], again[i]["hidden_states"]):
            assert (x - y).abs().max() <= 1e-4 and (y - z).abs().max() <= 1e-4


def test_the_workers_hear_that_each_batchs_requests_finished(fp32_generator):
    """A step's finished requests reach the workers with the next output; the one after a batch's last step schedules
    nothing and is not sent, so its finished ids must go with the next batch (scheduling.schedule): otherwise the V1
    runner keeps every request for the engine's life and the V2 runner fails after max_num_seqs ('No free
    indices', vLLM 0.27.1 on the H200)."""
    assert_workers_hold_only_the_last_batch(fp32_generator[3])


@pytest.mark.parametrize("bad, message", [
    ([], "empty batch"),
    ([[]], "sequence 0 is empty"),
    ([[1, 2, -3]], r"token id -3 outside the vocabulary \[0, 511\]"),
    ([[1, 512]], r"token id 512 outside the vocabulary"),
    ([[1, 2.5]], "token id 2.5 is not an int"),
    ([[1, True]], "token id True is not an int"),
    ("hello", "must be a list of token-id lists"),
    ([[5] * 600], r"600 tokens; at most max_model_len - 1 = 511"),
])
def test_bad_input_is_refused_before_the_engine_and_engine_stays_usable(fp32_generator, bad, message):
    family, path, layer_ids, gen = fp32_generator
    with pytest.raises(InvalidInput, match=message):
        gen.generate(bad)
    ok = gen.generate([[7, 8, 9]])
    assert ok[0]["hidden_states"][0].shape == (3, 256)


def test_truncate_only_when_asked(fp32_generator):
    _, _, _, gen = fp32_generator
    out = gen.generate([[5] * 600], truncate=True)
    assert out[0]["input_ids"].shape[0] == 511


def test_layer_id_errors():
    path = tiny_models.build_tiny_model("llama")
    for layer_ids, message in (([6], r"layer id 6 out of range; this model has layers 0..5"),
                               ([1, 1], r"layer ids \[1\] repeated"), ([-1], "out of range"),
                               (["2"], "is not an int")):
        with pytest.raises(InvalidInput, match=message):
            VllmHiddenStatesGenerator(path, layer_ids=layer_ids)


@pytest.mark.parametrize("options, message", [
    (dict(max_num_seqs=0), r"max_num_seqs=0; must be an int >= 1"),
    (dict(max_num_batched_tokens=0), r"max_num_batched_tokens=0; must be None"),
    (dict(max_num_batched_tokens=16, max_model_len=512), r"max_num_batched_tokens=16; .* >= max_model_len \(512\)"),
    (dict(shm_limit_bytes=-1), r"shm_limit_bytes=-1; must be None"),
    (dict(shm_limit_bytes="1G"), r"shm_limit_bytes='1G'; must be None"),
    (dict(load_format=None), r"load_format=None; must be one of vLLM's load formats"),
])
def test_generator_options_are_refused_before_anything_loads(options, message):
    path = tiny_models.build_tiny_model("llama")
    with pytest.raises(InvalidInput, match=message):
        VllmHiddenStatesGenerator(path, **options)


def test_the_shm_limit_variable_and_the_model_path_are_checked_first(monkeypatch, tmp_path):
    import pathlib
    monkeypatch.setenv("EAGLE_COMPAT_SHM_LIMIT_BYTES", "1G")
    with pytest.raises(InvalidInput, match=r"EAGLE_COMPAT_SHM_LIMIT_BYTES='1G'; must be a whole number of bytes"):
        VllmHiddenStatesGenerator(tiny_models.build_tiny_model("llama"))
    monkeypatch.delenv("EAGLE_COMPAT_SHM_LIMIT_BYTES")
    with pytest.raises(InvalidInput, match="has no config.json"):  # a Path is read as a path, not a TypeError
        VllmHiddenStatesGenerator(pathlib.Path(tmp_path))
    with pytest.raises(InvalidInput, match=r"model_path=3; must be a model directory"):
        VllmHiddenStatesGenerator(3)


def test_token_ids_are_checked_against_a_vocabulary_the_config_may_leave_to_transformers(tmp_path):
    """A multimodal config whose text part omits vocab_size (Gemma-3 writes only what differs from the class's
    defaults) used to read as vocab_size 0, and the token-id check was off: ids past the embedding reached vLLM."""
    import json

    from eagle_compat.model_facts import model_text_config
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 2, "hidden_size": 64},
        "vision_config": {"model_type": "siglip_vision_model"}}))
    text = model_text_config(str(tmp_path))
    assert text.num_hidden_layers == 2 and text.vocab_size > 0  # transformers' Gemma-3 default
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2,
                                                      "vocab_size": None}))
    with pytest.raises(InvalidInput, match="its config says vocab_size=None"):
        VllmHiddenStatesGenerator(str(tmp_path))
    # a wrapper transformers does not know: read from the file, its vocabulary left to vLLM's config
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "some_vl_wrapper",
                                                      "text_config": {"num_hidden_layers": 4}}))
    assert model_text_config(str(tmp_path)).num_hidden_layers == 4


def test_batch_options_are_checked(fp32_generator):
    _, _, _, gen = fp32_generator
    with pytest.raises(InvalidInput, match=r"truncate='no'; must be True or False"):
        gen.generate([[1, 2]], truncate="no")
    with pytest.raises(InvalidInput, match=r"prefetch=1.5; must be an int >= 0"):
        next(gen.generate_batches([[[1, 2]]], prefetch=1.5))


def test_worker_exception_reaches_the_caller_with_type_and_traceback(fp32_generator):
    from eagle_compat import WorkerError

    _, _, _, gen = fp32_generator
    with pytest.raises(WorkerError) as info:
        gen._rpc0("eagle_compat_setup", [99])
    err = info.value
    assert err.exc_type == "UnsupportedModel" and "out of range" in str(err)
    assert "Traceback" in err.remote_traceback
    # the previous capture setup is gone with the failed call: set it up again and use the engine
    gen._rpc0("eagle_compat_setup", gen.layer_ids)
    assert gen.generate([[7, 8]])[0]["hidden_states"][0].shape[0] == 2


def test_failure_inside_vllms_own_worker_code_keeps_its_type_and_traceback(fp32_generator):
    """A failure in vLLM's worker loop (not in eagle_compat's worker code) reaches vLLM's driver as str(exc)
    only; the generator recovers the worker's traceback from what the worker logged."""
    from eagle_compat import WorkerError, engine

    _, _, _, gen = fp32_generator
    with pytest.raises(WorkerError, match="no_such_worker_method") as info:
        gen._translated(engine.rpc.rpc_rank0, "no_such_worker_method")(gen.executor, "no_such_worker_method")
    assert info.value.exc_type == "AttributeError" and "Traceback" in info.value.remote_traceback
    assert gen.generate([[7, 8]])[0]["hidden_states"][0].shape[0] == 2  # the engine is still usable


def test_worker_start_up_failure_names_the_real_cause(tmp_path):
    """vLLM itself only says 'WorkerProc initialization failed … See stack trace for root cause'."""
    import shutil

    from safetensors.torch import load_file, save_file

    from eagle_compat import WorkerError

    src = tiny_models.build_tiny_model("llama")
    bad = tmp_path / "bad-llama"
    shutil.copytree(src, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.bogus_module.weight"] = torch.zeros(3)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WorkerError, match="bogus_module") as info:
        VllmHiddenStatesGenerator(str(bad), max_model_len=256, gpu_memory_utilization=0.3)
    # vLLM names the unknown weight with a ValueError (0.32) or a KeyError (0.16)
    assert info.value.exc_type in ("ValueError", "KeyError") and "Traceback" in info.value.remote_traceback


def test_results_own_their_memory(fp32_generator, tmp_path):
    """States arrive through shared memory; each returned tensor must still be its own (torch.save of a view would
    write the whole batch)."""
    _, _, _, gen = fp32_generator
    out = gen.generate([[7] * 50, [8] * 60])
    h = out[0]["hidden_states"][0]
    assert h.untyped_storage().nbytes() == h.numel() * h.element_size()
    # the ring's files are unlinked once both sides mapped them (other processes' files are not ours to judge)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"eagle-compat-{os.getpid()}-")]


def test_cpu_rotary_kernel_bug_is_worked_around_for_deepseek_without_rope_scaling():
    """A DeepSeek checkpoint without rope scaling runs CPU vLLM's C++ rotary kernel on strided q/k views, which
    leaves most heads unrotated (silently wrong states); the resolver switches those rotary embeddings to their
    native implementation."""
    path = tiny_models.build_tiny_model("deepseek_v3_plain_rope")
    batch = prompts(3, 20, 60, seed=8)
    with VllmHiddenStatesGenerator(path, layer_ids=[0, 1, 2, 3], max_model_len=256, gpu_memory_utilization=0.3,
                                   dtype="float32") as gen:
        results = gen.generate(batch)
        contract = gen.describe()
    assert any("rotary" in w for w in contract["workarounds"]), contract
    assert_matches_hf(results, path, batch, [0, 1, 2, 3], precision="fp32")


def test_pipelined_batches_equal_generate_and_fallback_is_taken(fp32_generator, caplog):
    """generate_batches (engine thread running ahead, and inline) gives generate()'s results; each tensor owns its
    storage (torch.save writes one sample); a batch that does not fit the shared-memory limit falls back."""
    import io
    import logging

    _, _, layer_ids, gen = fp32_generator
    batches = [prompts(4, 5, 150, seed=20 + k) for k in range(3)]
    expected = [gen.generate(b) for b in batches]
    for prefetch in (1, 0):
        for want, got in zip(expected, gen.generate_batches(iter(batches), prefetch=prefetch)):
            for x, y in zip(want, got):
                assert torch.equal(x["input_ids"], y["input_ids"]) and len(y["hidden_states"]) == len(layer_ids)
                assert all(torch.equal(a, b) for a, b in zip(x["hidden_states"], y["hidden_states"]))
    h = expected[0][1]["hidden_states"][0]
    buf = io.BytesIO()
    torch.save(h, buf)
    assert len(buf.getvalue()) < h.numel() * h.element_size() + 4096
    ring = gen._ring
    limit = ring.limit_bytes
    ring.limit_bytes = 1024  # smaller than any batch
    try:
        with caplog.at_level(logging.WARNING, logger="eagle_compat.generator"):
            fell_back = gen.generate(batches[2])
        assert gen.handover_stats["fallback_batches"] >= 1 and "instead of shared memory" in caplog.text
        assert "hand-over limit" in caplog.text
        for x, y in zip(expected[2], fell_back):
            assert all(torch.equal(a, b) for a, b in zip(x["hidden_states"], y["hidden_states"]))
    finally:
        ring.limit_bytes = limit


def test_batches_of_many_steps_queue_without_filling_vllms_message_rings():
    """Here one batch takes ~15 engine steps (~32 calls): more calls than vLLM's shared-memory message rings hold
    (10 each way). The driver bounds its unanswered calls (CALLS_IN_FLIGHT); without that bound driver and worker
    each wait for the other, forever (seen: the first batch never returns). Results equal HF."""
    import threading

    from eagle_compat import engine

    path = tiny_models.build_tiny_model("llama")
    batches = [prompts(40, 20, 60, seed=40 + k) for k in range(4)]
    with VllmHiddenStatesGenerator(path, layer_ids=[1, 3], max_model_len=128, max_num_batched_tokens=128,
                                   gpu_memory_utilization=0.3, dtype="float32") as gen:
        assert engine.rpc.can_queue_calls(gen.executor)
        got: list = []
        runner = threading.Thread(target=lambda: got.extend(gen.generate_batches(iter(batches), prefetch=0)),
                                  daemon=True)
        runner.start()
        runner.join(timeout=180)
        if runner.is_alive():
            pytest.fail("generate_batches hung: the driver filled vLLM's message rings")
        assert len(got) == len(batches)
        for batch, results in zip(batches[::3], got[::3]):
            assert_matches_hf(results, path, batch, [1, 3], precision="fp32")


def test_where_calls_cannot_be_queued_each_completes_first_with_the_same_results(fp32_generator, monkeypatch):
    """Releases without MultiprocExecutor.futures_queue (0.11.x) take the path where each call completes before the
    next is sent: same results, in order, also through generate_batches' engine thread."""
    from eagle_compat import engine

    _, _, layer_ids, gen = fp32_generator
    batches = [prompts(3, 5, 120, seed=60 + k) for k in range(4)]
    queued = list(gen.generate_batches(iter(batches), prefetch=0))
    monkeypatch.setattr(engine.rpc, "can_queue_calls", lambda executor: False)
    one_by_one = list(gen.generate_batches(iter(batches), prefetch=1))
    assert all(f.done() for _, f in gen._sent)  # nothing was left outstanding
    for want, got in zip(queued, one_by_one):
        for x, y in zip(want, got):
            assert all(torch.equal(a, b) for a, b in zip(x["hidden_states"], y["hidden_states"]))


def test_an_engine_built_at_a_scripts_top_level_is_refused_with_the_fix(tmp_path):
    """vLLM's workers are spawned and re-import the main script: without `if __name__ == "__main__":` the engine is
    built again in each starting worker, and vLLM said only "WorkerProc initialization failed"."""
    import subprocess
    import sys

    script = tmp_path / "no_main_guard.py"
    script.write_text("from eagle_compat import VllmHiddenStatesGenerator, tiny_models\n"
                      "gen = VllmHiddenStatesGenerator(tiny_models.build_tiny_model('llama'), layer_ids=[1], "
                      "max_model_len=64, gpu_memory_utilization=0.3)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    last = proc.stderr.strip().splitlines()
    assert proc.returncode != 0
    assert any(line.startswith("eagle_compat.errors.WorkerError: InvalidInput") and 'if __name__ == "__main__":'
               in line for line in last), proc.stderr[-3000:]


def test_a_missed_deadline_closes_the_generator_rather_than_read_replies_out_of_step(tmp_path):
    """vLLM's step deadline (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, here 0 once the engine is up: every call misses it)
    raises TimeoutError without reading the reply, so each later reply would be read as the answer to the call after
    it (seen: the hand-over ring got a step's ModelRunnerOutput as its buffer's reply). The generator closes instead
    and says so; it stays closed. (Set after the engine starts: eagle_compat's own calls carry the same deadline,
    its start-up calls included.) A subprocess: vLLM may cache its environment once an engine core ran in this one."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "deadline.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {here!r})\n"
        "from helpers import prompts\n"
        "from eagle_compat import InvalidInput, VllmHiddenStatesGenerator, tiny_models\n"
        "if __name__ == '__main__':\n"
        "    gen = VllmHiddenStatesGenerator(tiny_models.build_tiny_model('llama'), layer_ids=[1, 3],\n"
        "                                    max_model_len=256, gpu_memory_utilization=0.3)\n"
        "    os.environ['VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS'] = '0'\n"
        "    try:\n"
        "        list(gen.generate_batches(iter([prompts(8, 100, 200, seed=k) for k in range(6)]), prefetch=0))\n"
        "        print('RESULT no error')\n"
        "    except Exception as exc:\n"
        "        print('RESULT', type(exc).__name__, gen.executor is None)\n"
        "    try:\n"
        "        gen.generate([[5, 6, 7]])\n"
        "    except InvalidInput as exc:\n"
        "        print('AFTER', exc)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(("RESULT", "AFTER"))]
    assert lines == ["RESULT TimeoutError True", "AFTER this generator is closed"], (
        proc.stdout[-2000:] + proc.stderr[-3000:])
    assert "replies can no longer be matched to their calls" in proc.stderr


def test_a_hung_worker_ends_the_call_at_its_deadline_and_closes_the_generator(tmp_path):
    """A worker that hangs without dying (here stopped with SIGSTOP) used to hang eagle_compat's own calls (begin,
    finish, map, ...) forever: vLLM gives collective_rpc no deadline. Every call now has the step deadline
    (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS where set, here 4 s): TimeoutError, and the generator closes (its replies
    can no longer be matched to calls). A subprocess: the worker is stopped and then killed."""
    import subprocess
    import sys

    script = tmp_path / "hung.py"
    script.write_text(
        "import os, signal, time\n"
        "import psutil\n"
        "from eagle_compat import VllmHiddenStatesGenerator, tiny_models\n"
        "if __name__ == '__main__':\n"
        "    gen = VllmHiddenStatesGenerator(tiny_models.build_tiny_model('llama'), layer_ids=[1, 3],\n"
        "                                    max_model_len=256, gpu_memory_utilization=0.3)\n"
        "    workers = [p for p in psutil.Process().children(recursive=True) if 'Worker' in p.name()]\n"
        "    print('WORKERS', len(workers), flush=True)\n"
        "    for w in workers:\n"
        "        os.kill(w.pid, signal.SIGSTOP)\n"
        "    os.environ['VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS'] = '4'\n"
        "    t = time.time()\n"
        "    try:\n"
        "        gen.generate([[5, 6, 7, 8]])\n"
        "        print('RESULT no error', flush=True)\n"
        "    except Exception as exc:\n"
        "        print('RESULT', type(exc).__name__, gen.executor is None, int(time.time() - t) < 120, flush=True)\n"
        "    finally:\n"
        "        for w in workers:\n"
        "            os.kill(w.pid, signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=400)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(("RESULT", "WORKERS"))]
    assert lines and lines[0] != "WORKERS 0", proc.stdout[-2000:] + proc.stderr[-3000:]
    assert lines[1:] == ["RESULT TimeoutError True True"], proc.stdout[-2000:] + proc.stderr[-3000:]
