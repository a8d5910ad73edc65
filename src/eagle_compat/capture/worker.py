"""Worker-side capture: one implementation, used by eagle_compat's generator and by the speculators shim.

A `CaptureSession` lives inside a vLLM worker. It resolves the model's decoder contract, registers forward hooks
on the requested decoder layers (TP rank 0 only: the residual stream is replicated), records each engine step's
rows, puts them in the order the scheduler scheduled the requests (the V2 model runner sorts a batch by length),
and hands each step's per-layer tensors to a sink.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable

from ..errors import CaptureInvariantError, UnsupportedModel
from . import resolver
from ..remote_errors import reported

log = logging.getLogger("eagle_compat.capture")


def _model_of(worker: Any) -> Any:
    get_model = getattr(worker, "get_model", None)
    if callable(get_model):
        try:
            return get_model()
        except Exception:
            pass
    return worker.model_runner.model


def _is_capture_rank() -> bool:
    try:
        from vllm.distributed import get_tp_group
        return get_tp_group().rank_in_group == 0
    except Exception:
        return True


def runner_batch_order(model_runner: Any) -> list[str] | None:
    """The request order in which the model runner laid out the last step's tokens."""
    state = getattr(model_runner, "execute_model_state", None)
    batch = getattr(state, "input_batch", None)  # V2 runner, 0.22+
    if batch is None and isinstance(state, tuple) and len(state) >= 2:  # V2 runner, 0.12-0.21
        batch = state[1]
    if batch is not None and getattr(batch, "req_ids", None) is not None and not hasattr(model_runner, "input_batch"):
        return [r for r in batch.req_ids if r is not None]
    batch = getattr(model_runner, "input_batch", None)  # V1 runner
    if batch is not None:
        ids = list(batch.req_ids)[: getattr(batch, "num_reqs", len(batch.req_ids))]
        return [r for r in ids if r is not None]
    return None


def keep_vllm_config_current(worker: Any) -> bool:
    """Make the worker's vLLM config current for the rest of this worker process's life, where vLLM has none.

    vLLM 0.20-0.24's CPU fused-MoE torch path (taken in float32) builds a `SiluAndMul` CustomOp inside the forward
    (`fused_moe/cpu_fused_moe.py`, `_CPU_MOE_ACT_FN`); CustomOp construction asks for the current vLLM config,
    which vLLM's workers set only while loading the model, so the profile run fails with "Current vLLM config is
    not set". The process is one of our workers and runs one model: its own config is the right answer.
    Returns whether it had to be set. Can be deleted with support for vLLM < 0.25."""
    config = getattr(worker, "vllm_config", None)
    try:
        state, set_current_vllm_config = _vllm_config_state()
    except (ImportError, KeyError):
        return False
    if config is None or getattr(state, "_current_vllm_config", "absent") is not None:
        return False
    context = set_current_vllm_config(config)
    context.__enter__()  # never left: the worker's lifetime
    _KEPT_CONTEXTS.append(context)
    return True


_KEPT_CONTEXTS: list = []


def _vllm_config_state() -> tuple[Any, Callable]:
    """The module holding vLLM's current-config global, and its context manager."""
    from vllm.config import set_current_vllm_config
    return sys.modules[set_current_vllm_config.__module__], set_current_vllm_config


class CaptureSession:
    def __init__(self, worker: Any, layer_ids: list[int], sink: Callable[[list], None],
                 row_sink: Callable[[list, dict, list], None] | None = None):
        """`sink(per_layer)` gets each step's rows in the scheduler's order. With `row_sink`, each step goes to
        `row_sink(per_layer, rows, order)` instead, unreordered: `rows[request_id] = (first_row, count)` in the
        runner's layout, `order` the scheduler's request order (no reordering copy on the device)."""
        self.worker = worker
        self.row_sink = row_sink
        if keep_vllm_config_current(worker):
            log.info("vLLM config made current for this worker's life (forward-time CustomOps need it)")
        self.layer_ids = list(layer_ids)
        self.sink = sink
        model = _model_of(worker)
        self.contract = resolver.resolve(model, getattr(worker, "vllm_config", None))
        n = self.contract.num_layers
        bad = [i for i in self.layer_ids if not isinstance(i, int) or i < 0 or i >= n]
        if bad:
            raise UnsupportedModel(f"layer ids {bad} out of range: this model has layers 0..{n - 1}")
        self.capture = _is_capture_rank()
        self._step: dict[int, list] | None = None
        self._hooks = []
        _, base = resolver.find_base_model(model)
        if self.capture:
            for i in sorted(set(self.layer_ids)):
                if not (self.contract.start_layer <= i < self.contract.end_layer):
                    raise UnsupportedModel(f"layer {i} is not run by this rank")
                layer = base.layers[i]
                self._hooks.append(layer.register_forward_hook(self._make_hook(i, f"{type(layer).__name__}[{i}]")))
        self._original_execute_model = worker.execute_model
        worker.execute_model = self.execute_model  # instance attribute: only this worker, only while set up

    def _make_hook(self, layer_id: int, name: str):
        kind = self.contract.output_kind

        def hook(module, args, output):
            if self._step is not None:
                self._step.setdefault(layer_id, []).append(resolver.stream_value(output, kind, name))
        return hook

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.worker.__dict__.get("execute_model") == self.execute_model:
            del self.worker.execute_model

    @reported("execute_model")
    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        scheduled = dict(getattr(scheduler_output, "num_scheduled_tokens", {}) or {})
        if not self.capture or not scheduled:
            return self._original_execute_model(scheduler_output, *args, **kwargs)
        self._step = {}
        try:
            out = self._original_execute_model(scheduler_output, *args, **kwargs)
            step, self._step = self._step, None
        finally:
            self._step = None
        self._deliver(step, scheduled, runner_batch_order(self.worker.model_runner))
        return out

    def _deliver(self, step: dict[int, list], scheduled: dict[str, int], runner_order: list[str] | None) -> None:
        import torch

        total = sum(scheduled.values())
        wanted = list(scheduled)  # the scheduler's order == the order the caller added the requests
        per_layer = []
        for i in self.layer_ids:
            parts = step.get(i)
            if not parts:
                raise CaptureInvariantError(f"decoder layer {i} did not run during the step (its hook never fired)")
            h = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
            if h.shape[0] < total:
                raise CaptureInvariantError(
                    f"layer {i} produced {h.shape[0]} rows for {total} scheduled tokens (an output sharded across "
                    "ranks, e.g. by sequence parallelism, would do this; capture does not gather it)")
            per_layer.append(h[:total])  # rows past the scheduled tokens are padding
        if runner_order is not None and runner_order != wanted:
            if sorted(runner_order) != sorted(wanted):
                raise CaptureInvariantError(
                    f"model runner batch {runner_order} does not match the scheduled {wanted}")
        elif runner_order is None and len(scheduled) > 1:
            # equal lengths are common (inputs cut to --max-len): assuming the scheduler's order would swap whole
            # samples with no later check able to see it
            raise UnsupportedModel(
                f"cannot tell in which order {type(self.worker.model_runner).__name__} laid out the {len(scheduled)} "
                "requests of this step (this vLLM keeps its batch elsewhere than eagle_compat reads it); refusing to "
                "guess, which could swap samples' states. One request per step (extract: --batch-size 1; the "
                "generator: one prompt per generate() call) runs on it")
        layout = runner_order if runner_order is not None else wanted
        if self.row_sink is not None:
            self.row_sink(per_layer, row_spans(layout, scheduled), wanted)
            return
        if layout != wanted:
            per_layer = [_reorder(h, layout, wanted, scheduled) for h in per_layer]
        self.sink(per_layer)


def row_spans(layout: list[str], counts: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Where each request's rows are in a step laid out in `layout` order: {request_id: (first_row, count)}."""
    spans, pos = {}, 0
    for rid in layout:
        spans[rid] = (pos, counts[rid])
        pos += counts[rid]
    return spans


def _reorder(h, runner_order: list[str], wanted: list[str], counts: dict[str, int]):
    import torch

    starts, pos = {}, 0
    for rid in runner_order:
        starts[rid] = pos
        pos += counts[rid]
    return torch.cat([h[starts[r]: starts[r] + counts[r]] for r in wanted], 0)


class HostStaging:
    """The fallback hand-over (a batch that does not fit the shared-memory ring, see `handover.py`): each step's rows
    are copied to pinned host memory asynchronously on a side stream, and the batch goes back through the executor's
    RPC queue as per-layer tensors."""

    def __init__(self) -> None:
        self.steps: list[list] = []
        self.requests: list[tuple[str, int]] = []  # (request id, rows) in the order of the staged rows
        self._stream = None

    def add(self, per_layer: list, requests: list[tuple[str, int]] | None = None) -> None:
        import torch

        self.requests.extend(requests or ())
        if not per_layer or not per_layer[0].is_cuda:
            self.steps.append([(h, None) for h in per_layer])
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        staged = []
        with torch.cuda.stream(self._stream):
            for h in per_layer:
                host = torch.empty(h.shape, dtype=h.dtype, pin_memory=True)
                host.copy_(h, non_blocking=True)
                h.record_stream(self._stream)  # the GPU rows stay allocated until the copy is done
                staged.append(host)
        event = self._stream.record_event()
        self.steps.append([(host, event) for host in staged])

    def clear(self) -> None:
        self.steps.clear()
        self.requests.clear()

    def collect(self) -> list | None:
        import torch

        if not self.steps:
            self.requests.clear()
            return None
        for step in self.steps:
            for _, event in step:
                if event is not None:
                    event.synchronize()
        layers = len(self.steps[0])
        out = [torch.cat([step[j][0] for step in self.steps], 0) for j in range(layers)]
        self.clear()
        return out


class CaptureWorkerExtension:
    """vLLM worker extension of eagle_compat's own generator (`worker_extension_cls`). Method names are prefixed:
    vLLM refuses an extension whose attribute names collide with the worker's."""

    @reported("eagle_compat_setup")
    def eagle_compat_setup(self, layer_ids: list[int]) -> dict:
        from .handover import RingStaging

        old = getattr(self, "_eagle_compat_session", None)
        if old is not None:
            old.close()
        if getattr(self, "_eagle_compat_staging", None) is None:  # the driver's ring outlives a re-setup
            self._eagle_compat_staging = RingStaging(HostStaging())
        self._eagle_compat_session = CaptureSession(self, layer_ids, self._eagle_compat_staging.fallback.add,
                                                    row_sink=self._eagle_compat_staging.add)
        return self._eagle_compat_session.contract.as_dict()

    @reported("eagle_compat_map")
    def eagle_compat_map(self, slot: int, path: str, nbytes: int, pin: bool) -> dict:
        """Map (and on GPU pin) one shared-memory buffer of the driver's ring (see handover.py)."""
        return self._eagle_compat_staging.map(slot, path, nbytes, pin, capture=self._eagle_compat_session.capture)

    @reported("eagle_compat_unmap")
    def eagle_compat_unmap(self, slot: int) -> None:
        self._eagle_compat_staging.unmap(slot)

    @reported("eagle_compat_begin")
    def eagle_compat_begin(self, batch_id: str, plan: dict | None) -> None:
        """Where each request of a batch goes (None: the fallback through the RPC queue)."""
        self._eagle_compat_staging.begin(batch_id, plan)

    @reported("eagle_compat_finish")
    def eagle_compat_finish(self, batch_id: str) -> dict:
        """Waits for the batch's copies; {"rows": {request_id: tokens}} (or {"fallback": per-layer tensors})."""
        return self._eagle_compat_staging.finish(batch_id)

    @reported("eagle_compat_abandon")
    def eagle_compat_abandon(self) -> None:
        self._eagle_compat_staging.abandon()

    @reported("eagle_compat_handshake")
    def eagle_compat_handshake(self) -> dict:
        from .handshake import worker_report
        return worker_report("generator")

    @reported("eagle_compat_describe")
    def eagle_compat_describe(self) -> dict:
        return resolver.resolve(_model_of(self), getattr(self, "vllm_config", None)).as_dict()
