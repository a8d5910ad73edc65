"""Capture machinery on toy modules (no engine): the hook's out-of-place sum survives in-place fused add-norm,
the resolver refuses what it cannot capture, worker errors keep type/message/traceback, batch reordering."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from eagle_compat import remote_errors
from eagle_compat.capture import resolver
from eagle_compat.capture.worker import _reorder
from eagle_compat.errors import UnsupportedModel, WorkerError


class LlamaDecoderLayer(nn.Module):
    """Mimics vLLM's layers: fused add-norm that overwrites hidden/residual IN PLACE (as on GPU)."""

    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states.clone()
        else:
            residual.add_(hidden_states)        # in place, like fused_add_rms_norm on CUDA
            hidden_states.copy_(residual * 0.5)  # overwrite the incoming tensor in place
        return hidden_states * self.scale, residual


class Base(nn.Module):
    def __init__(self, n=3, layer_cls=LlamaDecoderLayer):
        super().__init__()
        self.layers = nn.ModuleList([layer_cls(1.0 + i) for i in range(n)])
        self.start_layer, self.end_layer = 0, n

    def forward(self, x):
        h, r = x, None
        for layer in self.layers:
            h, r = layer(None, h, r)
        return h, r


class Top(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.model = base


def _reference_stream(base, x):
    """Run without hooks, recording h+r after each layer *before* anything mutates it."""
    out, h, r = [], x.clone(), None
    for layer in base.layers:
        h, r = layer(None, h, r)
        out.append((h + r).clone())
    return out


def test_hook_sum_survives_next_layers_in_place_norm():
    base = Base()
    x = torch.randn(5, 8)
    want = _reference_stream(base, x)
    got, kept = {}, {}

    def make(i):
        def hook(mod, args, output):
            got[i] = resolver.stream_value(output, "pair", f"layer{i}")
            kept[i] = output  # the naive way: keep references, add later
        return hook
    for i, layer in enumerate(base.layers):
        layer.register_forward_hook(make(i))
    base(x.clone())
    for i in range(len(base.layers)):
        torch.testing.assert_close(got[i], want[i])
    # keeping references instead is silently wrong: the next layer overwrote them
    naive = kept[0][0] + kept[0][1]
    assert not torch.allclose(naive, want[0])


def test_resolver_finds_wrapped_language_model_and_refuses_unknown_layers():
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.language_model = Top(Base())
    path, base = resolver.find_base_model(Wrapper())
    assert path == "language_model.model" and isinstance(base, Base)

    class MysteryLayer(LlamaDecoderLayer):
        pass
    with pytest.raises(UnsupportedModel, match="MysteryLayer.*not in eagle_compat's family table"):
        resolver.resolve(Top(Base(layer_cls=MysteryLayer)), platform="cpu")


def test_resolver_refuses_an_unverified_family_unless_allowed(monkeypatch):
    from eagle_compat.capture import families
    unverified = next(f for f in families.FAMILIES if f.unverified)
    layer_cls = type(unverified.layer_classes[0], (LlamaDecoderLayer,), {})
    monkeypatch.delenv(families.ALLOW_UNVERIFIED_ENV, raising=False)
    with pytest.raises(UnsupportedModel, match=f"family '{unverified.name}' is unverified: .*"
                                               f"{families.ALLOW_UNVERIFIED_ENV}={unverified.name}"):
        resolver.resolve(Top(Base(layer_cls=layer_cls)), platform="cpu")
    monkeypatch.setenv(families.ALLOW_UNVERIFIED_ENV, f"other,{unverified.name}")
    contract = resolver.resolve(Top(Base(layer_cls=layer_cls)), platform="cpu")
    assert contract.family == unverified.name and any("unverified" in w for w in contract.workarounds)


def test_stream_value_refuses_three_tensor_outputs():
    t = torch.ones(2, 2)
    with pytest.raises(UnsupportedModel, match="tuple of 3"):
        resolver.stream_value((t, t, t), "pair", "X[0]")
    assert torch.equal(resolver.stream_value((t, None), "pair", "X[0]"), t)
    assert torch.equal(resolver.stream_value(t, "tensor", "X[0]"), t)


def test_reorder_rows_to_scheduled_order():
    counts = {"a": 2, "b": 3, "c": 1}
    runner = ["c", "a", "b"]  # e.g. the V2 runner sorts by length
    h = torch.tensor([[30.], [10.], [11.], [20.], [21.], [22.]])
    out = _reorder(h, runner, ["a", "b", "c"], counts)
    assert out[:, 0].tolist() == [10., 11., 20., 21., 22., 30.]


@pytest.mark.parametrize("exc", [AssertionError(), KeyError("k"), ValueError("bad value 7")])
def test_worker_errors_keep_type_message_and_traceback(exc):
    @remote_errors.reported("some_rpc")
    def fails():
        raise exc
    with pytest.raises(remote_errors.RemoteFailure) as info:
        fails()
    # what vLLM's executor makes of it in the driver
    driver_side = RuntimeError(f"Worker failed with error '{info.value}', please check the stack trace above")
    err = remote_errors.decode(driver_side)
    assert isinstance(err, WorkerError)
    assert err.exc_type == type(exc).__name__
    assert "Traceback" in err.remote_traceback and "fails" in err.remote_traceback
    assert type(exc).__name__ in str(err) and str(err).strip()


def test_empty_vllm_worker_error_is_never_empty():
    def rpc():
        raise RuntimeError("Worker failed with error '', please check the stack trace above for the root cause")
    with pytest.raises(WorkerError, match="RuntimeError in a vLLM worker"):
        remote_errors.translate(rpc, "execute_model")()


def _config(enforce_eager=True, cudagraph_mode="NONE", pp=1, sp_moe=False):
    from types import SimpleNamespace
    return SimpleNamespace(model_config=SimpleNamespace(enforce_eager=enforce_eager),
                           compilation_config=SimpleNamespace(cudagraph_mode=cudagraph_mode),
                           parallel_config=SimpleNamespace(pipeline_parallel_size=pp, use_sequence_parallel_moe=sp_moe))


class _CompiledBase(Base):
    do_not_compile = False


@pytest.mark.parametrize("config, base, message", [
    (_config(enforce_eager=False, cudagraph_mode="FULL_AND_PIECEWISE"), Base(), "needs eager mode"),
    (_config(enforce_eager=False), _CompiledBase(), "needs eager mode"),
    (_config(pp=2), Base(), "pipeline_parallel_size=2"),
    (_config(sp_moe=True), Base(), "sequence-parallel MoE"),
])
def test_engine_modes_that_capture_cannot_see_are_refused(config, base, message):
    with pytest.raises(UnsupportedModel, match=message):
        resolver.check_engine_mode(config, base)


def test_eager_engine_is_accepted():
    resolver.check_engine_mode(_config(), Base())


def test_worker_keeps_its_vllm_config_current_only_where_vllm_left_none(monkeypatch):
    """vLLM 0.20-0.24 build a CustomOp inside the CPU float32 MoE forward, which needs a current config."""
    import types

    from eagle_compat.capture import worker as capture_worker

    state, _ = capture_worker._vllm_config_state()  # the real vLLM has the global this relies on
    assert hasattr(state, "_current_vllm_config")

    class FakeWorker:
        vllm_config = object()

    entered = []

    class Context:
        def __init__(self, config):
            self.config = config

        def __enter__(self):
            entered.append(self.config)

    fake_state = types.SimpleNamespace(_current_vllm_config=FakeWorker.vllm_config)
    monkeypatch.setattr(capture_worker, "_vllm_config_state", lambda: (fake_state, Context))
    monkeypatch.setattr(capture_worker, "_KEPT_CONTEXTS", [])
    assert capture_worker.keep_vllm_config_current(FakeWorker()) is False  # vLLM has one: left alone
    fake_state._current_vllm_config = None
    assert capture_worker.keep_vllm_config_current(FakeWorker()) is True
    assert entered == [FakeWorker.vllm_config] and len(capture_worker._KEPT_CONTEXTS) == 1


def test_ipex_fused_moe_with_routing_bias_is_refused():
    """vLLM 0.11.0's IPEX fused MoE on CPU ignores DeepSeek's e_score_correction_bias: silently wrong."""
    class IPEXFusedMOE:
        pass

    class FusedMoE(nn.Module):
        def __init__(self, bias):
            super().__init__()
            self.cpu_fused_moe = IPEXFusedMOE()
            self.e_score_correction_bias = bias

    biased, unbiased = nn.Sequential(FusedMoE(torch.zeros(4))), nn.Sequential(FusedMoE(None))
    resolver.check_known_wrong_kernels([unbiased])  # softmax routing without bias: IPEX is exact
    with pytest.raises(UnsupportedModel, match="e_score_correction_bias"):
        resolver.check_known_wrong_kernels([unbiased, biased])


def test_native_rotary_switch_only_where_the_cpu_kernel_would_run():
    """vLLM 0.11-0.13's CustomOp sends CPU to forward_cuda (the C++ rotary kernel, wrong on DeepSeek's strided
    q/k); 0.14+ send scaled RoPE to forward_native already; plain RoPE has its own kernel-backed forward_cpu."""
    class CustomOp(nn.Module):
        def forward_native(self, *a):
            return "native"

        def forward_cuda(self, *a):
            return "kernel"

        def forward_cpu(self, *a):  # 0.11-0.13 default
            return self.forward_cuda(*a)

    def rope(base, method):
        cls = type("DeepseekScalingRotaryEmbedding", (base,), {})
        module = cls()
        module._forward_method = getattr(module, method)
        return module

    old_default = rope(CustomOp, "forward_cpu")
    old_default._forward_method.__func__.__qualname__ = "CustomOp.forward_cpu"
    already_native = rope(CustomOp, "forward_native")
    own_kernel = rope(CustomOp, "forward_cuda")
    layer = nn.ModuleList([old_default, already_native, own_kernel])
    assert resolver.use_native_rotary([layer]) == 2
    assert all(m._forward_method() == "native" for m in layer)


def test_cpu_ops_that_reach_cuda_kernels_by_default_run_natively():
    class OldDefault(nn.Module):  # vLLM 0.11-0.13: CustomOp.forward_cpu -> forward_cuda
        def forward_native(self, *a):
            return "native"

        def forward_cuda(self, *a):
            return "kernel"

        def forward_cpu(self, *a):
            return self.forward_cuda(*a)

    class NewDefault(OldDefault):  # 0.14+: CustomOp.forward_cpu -> forward_native
        def forward_cpu(self, *a):
            return self.forward_native(*a)

    for cls in (OldDefault, NewDefault):
        cls.forward_cpu.__qualname__ = "CustomOp.forward_cpu"
    old, new = OldDefault(), NewDefault()
    old._forward_method, new._forward_method = old.forward_cpu, new.forward_cpu
    assert resolver.use_native_custom_ops([nn.ModuleList([old, new])]) == 1
    assert old._forward_method() == "native" and new._forward_method.__func__ is NewDefault.forward_cpu


def test_handover_ring_reuses_bounds_and_falls_back(tmp_path):
    """The driver's ring without an engine (a fake worker): buffers are reused once their tensors are gone, idle ones
    beyond keep_free are unmapped, the limit makes a batch fall back with a reason, tensors own their storage."""
    import gc

    from eagle_compat.capture.handover import HostRing, tensors_from_lease

    calls = []
    ring = HostRing(lambda method, *args: calls.append((method, args[0])) or {"registered": False},
                    directory=str(tmp_path), keep_free=1)
    a, why = ring.acquire(3 << 20)
    assert a is not None and why is None and a.nbytes == 3 << 20 and not list(tmp_path.iterdir())  # unlinked
    lease = ring.lease(a)
    hs = tensors_from_lease(lease, torch.bfloat16, 1024, tokens=5, layers=2, hidden=8)
    hs[1].fill_(2.0)
    assert hs[0].shape == (5, 8) and hs[1].untyped_storage().nbytes() == 5 * 8 * 2 and float(hs[0].sum()) == 0.0
    del lease
    b, _ = ring.acquire(3 << 20)
    assert b.id != a.id  # a is still leased through hs
    del hs
    gc.collect()
    c, _ = ring.acquire(2 << 20)
    assert c.id == a.id  # back in the ring
    ring.release(b.id)
    ring.release(c.id)
    ring.acquire(1 << 20)  # two idle, keep_free=1: one is unmapped first
    assert ("eagle_compat_unmap", b.id) in calls or ("eagle_compat_unmap", c.id) in calls
    ring.limit_bytes = 4 << 20
    slot, why = ring.acquire(8 << 20)
    assert slot is None and "hand-over limit" in why


def _holder(path):
    """Another process that holds `path` as a live driver does (its flock), told to let go by closing its stdin."""
    import subprocess
    import sys
    code = ("import fcntl, os, sys\n"
            f"fd = os.open({str(path)!r}, os.O_CREAT | os.O_RDWR, 0o600)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\n"
            "sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"  # a hook, not a timing window
    return proc


def test_hand_over_files_of_live_drivers_in_other_pid_namespaces_are_kept(tmp_path):
    """`docker --ipc=host`: containers share /dev/shm but not /proc. A live driver whose PID this /proc does not
    show must keep its buffer (the old sweep removed it: the worker then created a new file and the driver read
    zeros); a file nobody holds is removed, whatever PID its name carries."""
    import os

    from eagle_compat.capture import handover
    invisible_pid = int(open("/proc/sys/kernel/pid_max").read()) + 7  # no process here can have it
    live = tmp_path / f"eagle-compat-{invisible_pid}-00ff00ff00ff00ff.bin"
    making = tmp_path / f".eagle-compat-{invisible_pid}-0123456789abcdef.bin.new"
    holders = [_holder(live), _holder(making)]
    try:
        (tmp_path / f"eagle-compat-{os.getpid()}-abcdef0123456789.bin").write_bytes(b"x")  # nobody holds it
        (tmp_path / "eagle-compat-1-0.bin").write_bytes(b"x")  # the old naming, nobody holds it
        (tmp_path / "other-file.bin").write_bytes(b"x")
        handover.HostRing(lambda *a: {}, directory=str(tmp_path))  # a new ring sweeps first
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, making.name, "other-file.bin"])
    finally:
        for h in holders:
            h.stdin.close()
            h.wait()
    assert sorted(handover.sweep_stale(str(tmp_path))) == sorted([live.name, making.name])  # their owners are gone


def test_the_worker_opens_the_drivers_buffer_and_never_creates_one(tmp_path):
    from eagle_compat.capture import handover
    staging = handover.RingStaging(fallback=None)
    missing = tmp_path / "eagle-compat-1-0123456789abcdef.bin"
    with pytest.raises(handover.HandoverError, match="does not exist"):
        staging.map(0, str(missing), 1 << 20, pin=False)
    assert not missing.exists()  # torch.from_file(shared=True) alone would have made it


def test_a_ring_buffer_is_the_same_memory_in_driver_and_worker(tmp_path):
    """Driver and worker in one process here: the worker's reply carries what it reads at the buffer's start, the
    nonce the driver wrote; a worker that mapped another file is refused."""
    from eagle_compat.capture import handover
    staging = handover.RingStaging(fallback=None)

    def rpc(method, *args):
        return staging.map(*args) if method == "eagle_compat_map" else staging.unmap(*args)
    ring = handover.HostRing(rpc, directory=str(tmp_path), pin=False)
    slot, why = ring.acquire(1 << 20)
    assert slot is not None, why
    buf, _ = staging.buffers[slot.id]
    buf[100:104] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)  # the worker writes; the driver reads it
    assert bytes(slot.mm[100:104]) == bytes([1, 2, 3, 4])
    assert not list(tmp_path.iterdir())  # the name is gone once both sides hold their mapping

    def other_file(method, *args):
        if method != "eagle_compat_map":
            return None
        sid, path, nbytes, pin = args
        other = tmp_path / "somewhere-else.bin"
        other.write_bytes(bytes(nbytes))
        return staging.map(sid, str(other), nbytes, pin)
    with pytest.raises(handover.HandoverError, match="another file"):
        handover.HostRing(other_file, directory=str(tmp_path), pin=False)._create(1 << 20)


def test_results_kept_by_the_caller_cannot_grow_the_ring_past_its_default_bound(tmp_path, monkeypatch):
    """Kept results pin their batch's whole buffer. With no bound, a caller keeping one sample per batch grew the
    ring until /dev/shm was nearly full; now a quarter of the filesystem by default, then batches fall back to the RPC
    queue with a reason that says what holds the buffers."""
    import os
    from types import SimpleNamespace

    from eagle_compat.capture import handover
    monkeypatch.delenv(handover.LIMIT_ENV, raising=False)
    fs = SimpleNamespace(f_blocks=64, f_frsize=1 << 20, f_bavail=64)  # a 64 MiB /dev/shm, as Docker's default
    monkeypatch.setattr(os, "statvfs", lambda path: fs)
    monkeypatch.setattr(handover, "HEADROOM", 0)
    ring = handover.HostRing(lambda *a: {}, directory=str(tmp_path), pin=False)
    assert ring.limit_bytes == 16 << 20
    kept = []
    for _ in range(40):  # the caller keeps every batch's results
        slot, why = ring.acquire(4 << 20)
        if slot is None:
            break
        kept.append(ring.lease(slot))
    assert ring.total_bytes <= 16 << 20 and len(kept) == 4
    assert "4 buffers (16 MiB) are held by results the caller still references" in why, why


def _fallback_round(steps, request_ids, token_lists):
    """The worker's fallback staging fed `steps` (each: the order the scheduler ran requests in, with their row
    counts), then the driver's reading of its reply. Row r of request q holds q*1000 + r."""
    from eagle_compat.capture import handover
    from eagle_compat.capture.worker import HostStaging
    from eagle_compat.generator import VllmHiddenStatesGenerator, _Batch

    staging = handover.RingStaging(HostStaging())
    staging.begin("b", None)
    for step in steps:
        rows, pos, values = {}, 0, []
        for rid, n in step:
            rows[rid] = (pos, n)
            pos += n
            q = int(rid.rsplit("_", 1)[1])
            values += [q * 1000 + r for r in range(n)]
        per_layer = [torch.tensor(values, dtype=torch.float32)[:, None].repeat(1, 4)]
        staging.add(per_layer, rows, [rid for rid, _ in step])
    reply = staging.finish("b")
    batch = _Batch("b", token_lists, request_ids, {}, None, set(), torch.float32)
    return VllmHiddenStatesGenerator._results_from_fallback(batch, reply["fallback"], reply.get("fallback_rows"))


def test_the_rpc_fallback_gives_each_sample_its_own_rows_in_any_scheduler_order():
    """A batch that does not fit the shared-memory ring comes back through the RPC queue as one tensor per layer; the
    driver cut it by the prompts' lengths in submission order, checking only the total: had the scheduler run them in
    another order, or two counts swapped, samples would have held each other's states with no error. Now the worker
    records which request each row is, and the driver checks every sample's count."""
    ids, tokens = ["b_0", "b_1", "b_2"], [[5] * 3, [6] * 2, [7] * 3]
    # the scheduler ran b_2 before b_0, over two steps
    results = _fallback_round([[("b_2", 3), ("b_1", 2)], [("b_0", 3)]], ids, tokens)
    for q, res in enumerate(results):
        assert res["hidden_states"][0][:, 0].tolist() == [q * 1000 + r for r in range(len(tokens[q]))]
    with pytest.raises(RuntimeError, match=r"do not match the prompts for 2 requests.*b_0: 2 rows for 3 tokens"):
        _fallback_round([[("b_0", 2), ("b_1", 3), ("b_2", 3)]], ids, tokens)
    with pytest.raises(RuntimeError, match="more than one step"):
        _fallback_round([[("b_0", 2), ("b_1", 2)], [("b_0", 1), ("b_2", 3)]], ids, tokens)


def test_cpu_sdpa_attention_with_one_cached_mask_is_refused_for_mixed_sliding_windows():
    """vLLM 0.11.0's CPU TorchSDPA caches one set of masks per step for every layer: Gemma 2's global layers attended
    with layer 0's window (the matrix's generator/gemma2 cell on 0.11.0, windows of 32). A model whose layers share
    one window, or another backend, is not refused."""
    from eagle_compat.capture.resolver import check_known_wrong_kernels

    class TorchSDPABackendImpl:
        def __init__(self, window):
            self.sliding_window = window

        def _run_sdpa_forward(self, metadata):
            return metadata.get_attn_bias("decoder")  # the cached masks

    class Attention(nn.Module):
        def __init__(self, window, impl_cls=TorchSDPABackendImpl):
            super().__init__()
            self.sliding_window, self.impl = window, impl_cls(window)

    def layers(*windows, impl_cls=TorchSDPABackendImpl):
        return [nn.Sequential(Attention(w, impl_cls)) for w in windows]

    with pytest.raises(UnsupportedModel, match=r"different sliding windows \(32, None\).*silently wrong"):
        check_known_wrong_kernels(layers(32, None, 32, None))
    check_known_wrong_kernels(layers(32, 32))  # one window for every layer: the cached masks are right
    cross = layers(32, None)
    cross[1][0].impl.attn_type = "encoder_decoder"  # the cache is kept per attention type
    check_known_wrong_kernels(cross)

    class OtherBackendImpl(TorchSDPABackendImpl):
        pass
    check_known_wrong_kernels(layers(32, None, impl_cls=OtherBackendImpl))
