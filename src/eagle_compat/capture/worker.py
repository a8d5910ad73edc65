"""Worker-side capture: one implementation, used by eagle_compat's generator and by the speculators shim.

A `CaptureSession` lives inside a vLLM worker. It resolves the model's decoder contract, registers forward hooks
on the requested decoder layers (TP rank 0 only: the residual stream is replicated), records each engine step's
rows, puts them in the order the scheduler scheduled the requests (the V2 model runner sorts a batch by length),
and hands each step's per-layer tensors to a sink.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from ..errors import UnsupportedModel
from . import resolver
from .remote_errors import reported

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


class CaptureSession:
    def __init__(self, worker: Any, layer_ids: list[int], sink: Callable[[list], None]):
        self.worker = worker
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
                raise UnsupportedModel(f"decoder layer {i} did not run during the step (its hook never fired)")
            h = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
            if h.shape[0] < total:
                raise UnsupportedModel(
                    f"layer {i} produced {h.shape[0]} rows for {total} scheduled tokens: the output is sharded "
                    "across ranks (sequence parallelism), which capture does not gather")
            per_layer.append(h[:total])  # rows past the scheduled tokens are padding
        if runner_order is not None and runner_order != wanted:
            if sorted(runner_order) != sorted(wanted):
                raise UnsupportedModel(f"model runner batch {runner_order} does not match the scheduled {wanted}")
            per_layer = [_reorder(h, runner_order, wanted, scheduled) for h in per_layer]
        elif runner_order is None and len(set(scheduled.values())) > 1:
            raise UnsupportedModel(
                f"cannot tell the batch order of {type(self.worker.model_runner).__name__}; refusing to guess")
        self.sink(per_layer)


def _reorder(h, runner_order: list[str], wanted: list[str], counts: dict[str, int]):
    import torch

    starts, pos = {}, 0
    for rid in runner_order:
        starts[rid] = pos
        pos += counts[rid]
    return torch.cat([h[starts[r]: starts[r] + counts[r]] for r in wanted], 0)


class CaptureWorkerExtension:
    """vLLM worker extension of eagle_compat's own generator (`worker_extension_cls`). Method names are prefixed:
    vLLM refuses an extension whose attribute names collide with the worker's."""

    @reported("eagle_compat_setup")
    def eagle_compat_setup(self, layer_ids: list[int]) -> dict:
        old = getattr(self, "_eagle_compat_session", None)
        if old is not None:
            old.close()
        self._eagle_compat_steps = []
        self._eagle_compat_session = CaptureSession(self, layer_ids, self._eagle_compat_steps.append)
        return self._eagle_compat_session.contract.as_dict()

    @reported("eagle_compat_reset")
    def eagle_compat_reset(self) -> None:
        self._eagle_compat_steps.clear()

    @reported("eagle_compat_collect")
    def eagle_compat_collect(self) -> list | None:
        """Per requested layer, every captured row of the steps since the last reset, on the CPU."""
        import torch

        steps = self._eagle_compat_steps
        if not steps:
            return None
        out = [torch.cat([s[j] for s in steps], 0).cpu() for j in range(len(steps[0]))]
        steps.clear()
        return out

    @reported("eagle_compat_describe")
    def eagle_compat_describe(self) -> dict:
        return resolver.resolve(_model_of(self), getattr(self, "vllm_config", None)).as_dict()
