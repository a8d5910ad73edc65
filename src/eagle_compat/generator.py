"""eagle_compat's own hidden-states generator: speculators 0.3.0's API, built on eagle_compat's engine adapters
and its one capture implementation (hooks resolved per model family inside the workers)."""
from __future__ import annotations

import collections
import logging
import os
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from . import engine, environment, leftovers, settings
from .capture import handshake
from .remote_errors import (WorkerErrorLog, record_start_error, reply_from_worker, retrying_lost_port_race,
                            translate)
from .capture.handover import HostRing, sample_block_bytes, tensors_from_lease
from .errors import InvalidInput, WorkerError
from .model_facts import model_text_config, validate_token_ids
from .options import (ENGINE_DTYPES, check_batch_options, check_engine_options,  # noqa: F401 - this module's API
                      check_generator_options, checked_for, default_layer_ids, validate_layer_ids)

log = logging.getLogger("eagle_compat.generator")

WORKER_EXTENSION = "eagle_compat.capture.worker.CaptureWorkerExtension"
QUEUED_BATCHES = 2  # sent but not yet collected, besides the one being sent: the GPU's work queue
# vLLM's shared-memory message rings hold 10 messages each way: with more calls unanswered, the worker would wait for
# the driver to read replies while the driver waits for room to send, forever.
CALLS_IN_FLIGHT = 8
# vLLM's deadline for a step (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, default 300 s) runs from when the call is sent; a
# queued step may wait behind CALLS_IN_FLIGHT / 2 others. Where the user set no deadline, keep 300 s per step.
assert engine.rpc.STEP_DEADLINE_S >= 300 * (CALLS_IN_FLIGHT // 2 + 1)
QUEUED_CALL_TIMEOUT_ENV = {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(engine.rpc.STEP_DEADLINE_S)}


def _result_of_rank0(future: Future) -> Any:
    """A submitted call's reply: rank 0's for collective calls (a list per rank), the step's output otherwise."""
    value = future.result()
    return value[0] if isinstance(value, list) else value


def refuse_inside_a_spawned_import() -> None:
    """vLLM starts its workers with `spawn`, and each re-imports the caller's main script: an engine built at the
    script's top level is built again inside every starting worker. Python refuses that there, and the driver only
    hears vLLM's "WorkerProc initialization failed". Refuse with the fix, where the driver reads worker errors."""
    import multiprocessing

    if not getattr(multiprocessing.current_process(), "_inheriting", False):
        return
    exc = InvalidInput("VllmHiddenStatesGenerator was created while a vLLM worker process was starting: vLLM starts "
                       "workers with 'spawn', which re-imports your main script, so an engine built at its top level "
                       "is built again in every worker. Put it under `if __name__ == \"__main__\":`.")
    record_start_error(exc)
    raise exc


@dataclass
class _Batch:
    id: str
    token_lists: list[list[int]]
    request_ids: list[str]
    offsets: dict[str, tuple[int, int]]
    slot: Any
    pending: set
    dtype: Any
    calls: list = field(default_factory=list)  # (method, Future) in the order sent


class VllmHiddenStatesGenerator:
    """Extract the residual stream leaving chosen decoder layers during prefill (speculators 0.3.0's contract).

    `layer_ids=[i]` is the stream leaving layer i (HF `hidden_states[i+1]` for i <= N-2; for the last layer N-1 it
    is the *input* of the final norm). Results come back in the order of `layer_ids`.
    """

    def __init__(self, model_path: str, layer_ids: list[int] | None = None, max_model_len: int = 2048,
                 gpu_memory_utilization: float = 0.8, tensor_parallel_size: int = 1, *, dtype: str = "auto",
                 trust_remote_code: bool = False, kv_cache_memory_bytes: int | None = None,
                 max_num_seqs: int = engine.configs.MAX_NUM_SEQS, max_num_batched_tokens: int | None = None,
                 load_format: str = "auto", shm_limit_bytes: int | None = None, show_load_progress: bool = True,
                 in_process: bool = False):
        refuse_inside_a_spawned_import()
        engine.process_env.require_vllm()
        if not isinstance(model_path, (str, os.PathLike)):
            raise InvalidInput(f"model_path={model_path!r}; must be a model directory or hub id (a str or a path)")
        model_path = os.fspath(model_path)
        if not isinstance(max_model_len, int) or max_model_len < 2:
            raise InvalidInput(f"max_model_len={max_model_len!r}; must be an int >= 2")
        check_generator_options(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                load_format=load_format, shm_limit_bytes=shm_limit_bytes, max_model_len=max_model_len)
        check_engine_options(tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
                             kv_cache_memory_bytes=kv_cache_memory_bytes, dtype=dtype)
        # in_process: vLLM's one-rank executor in this process (no spawned worker to import vLLM again: start-up in
        # seconds); its calls run in the caller's thread, one at a time and without a deadline: for short runs
        if in_process and tensor_parallel_size != 1:
            raise InvalidInput(f"in_process=True runs one worker in this process; tensor_parallel_size="
                               f"{tensor_parallel_size} needs one process per rank: leave in_process off")
        if not os.path.exists(model_path) and "/" not in model_path:
            raise InvalidInput(f"model_path {model_path!r} is neither a local directory nor a hub id")
        self.model_path = model_path
        self.tensor_parallel_size = tensor_parallel_size
        self.max_model_len = max_model_len
        self._request_counter = 0
        self.executor = None
        self.worker_pids: list[int] = []  # each rank's process (this one's pid where in_process)
        self._ring = None
        self._busy = threading.Lock()  # one batch at a time reaches the engine
        self._sent: collections.deque[tuple[str, Future]] = collections.deque()  # (method, reply) maybe unread
        text_config = model_text_config(model_path, trust_remote_code)
        self.num_layers = int(text_config.num_hidden_layers)
        self.hidden_size = int(getattr(text_config, "hidden_size", 0) or 0)
        self.vocab_size = int(getattr(text_config, "vocab_size", 0) or 0)  # else vLLM's config says, below
        if hasattr(text_config, "vocab_size") and self.vocab_size < 1:
            raise InvalidInput(f"model {model_path!r}: its config says vocab_size={text_config.vocab_size!r}; "
                               "a positive vocabulary size is needed to check token ids")
        self.layer_ids = (default_layer_ids(self.num_layers) if layer_ids is None
                          else list(layer_ids) if checked_for(layer_ids, self.num_layers)  # by the extract job
                          else validate_layer_ids(layer_ids, self.num_layers))
        from transformers import AutoTokenizer
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        except Exception as exc:  # noqa: BLE001 - token ids can still be given directly
            log.warning("no tokenizer for %s (%s); eos_token_id unknown", model_path, exc)
            self.tokenizer = None
        environment.require_cpu_platform_ready()  # before anything reaches the engine
        worker_env = engine.process_env.default_worker_env(dtype, tensor_parallel_size)
        self._env_restore = engine.process_env.apply_env({**worker_env, **QUEUED_CALL_TIMEOUT_ENV})
        try:
            self.vllm_config = engine.configs.build_vllm_config(
                model_path, worker_extension_cls=WORKER_EXTENSION, max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
                dtype=dtype, trust_remote_code=trust_remote_code, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory_bytes=kv_cache_memory_bytes,
                load_format=load_format, show_load_progress=show_load_progress, in_process=in_process)
            self.vocab_size = self.vocab_size or int(self.vllm_config.model_config.get_vocab_size() or 0)
            if self.vocab_size < 1:  # token ids could not be checked: an id past the embedding gives wrong states
                raise InvalidInput(f"model {model_path!r}: no vocab_size in its config (or its text config); "
                                   "a positive vocabulary size is needed to check token ids")
            executor_cls = engine.rpc.executor_class(in_process)
            self._processes = leftovers.EngineProcesses()  # what the engine starts: close() ends what is left
            self.executor = retrying_lost_port_race(lambda: self._start_executor(executor_cls))
            replies = handshake.require_patched_workers(
                self._translated(self.executor.collective_rpc, "collective_rpc"), "generator")
            self.worker_pids = [r.get("pid") for r in replies]
            self.contract = self._rpc0("eagle_compat_setup", self.layer_ids)
            self._ring = HostRing(self._rpc0, limit_bytes=shm_limit_bytes)
            budget = self._translated(engine.kv_cache.kv_budget, "determine_available_memory")(
                self.executor, gpu_memory_utilization, explicit_bytes=kv_cache_memory_bytes)
            kv_cache_config = engine.kv_cache.build_kv_cache_config(self.vllm_config, self.executor, budget)
            self.scheduler = engine.scheduling.build_scheduler(self.vllm_config, kv_cache_config)
            self._translated(engine.rpc.initialize_workers, "initialize_from_config")(
                self.executor, kv_cache_config, self.vllm_config.parallel_config.world_size)
        except BaseException:
            self.close()
            raise

    def _start_executor(self, executor_cls: type) -> Any:
        previous = getattr(self, "_worker_errors", None)
        if previous is not None:  # a start that lost the port race
            previous.close()
        self._worker_errors = WorkerErrorLog()  # workers' own tracebacks, for failures inside vLLM's code
        with self._worker_errors.spawning():
            executor = executor_cls(vllm_config=self.vllm_config)
        self._processes.record(engine.rpc.worker_pids(executor))
        return executor

    # ------------------------------------------------------------------------------------------------------------
    def _translated(self, fn: Any, method: str) -> Any:
        return translate(fn, method, log=getattr(self, "_worker_errors", None), executor=self.executor)

    def _rpc0(self, method: str, *args: Any) -> Any:
        """A call that waits for its reply. Queued replies are read first, here, in order: vLLM's blocking call would
        read them itself and, after one whose deadline passed unread, hand each reply to the call after it."""
        if self.executor is not None:
            self._room_for(CALLS_IN_FLIGHT)
        try:
            return self._translated(engine.rpc.rpc_rank0, method)(self.executor, method, *args)
        except BaseException as exc:  # e.g. KeyboardInterrupt in a notebook while vLLM waits for the reply
            self._close_unless_replied(exc)
            raise

    @property
    def eos_token_id(self) -> int | None:
        return getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None

    def generate(self, token_ids: list[list[int]] | Any, *, truncate: bool = False) -> list[dict]:
        """Hidden states of every prompt token for each layer id. Returns, per sequence, a dict with
        `input_ids` (LongTensor [T]), `hidden_states` (list, per layer id, of [T, hidden] tensors on the CPU) and
        `loss_mask` (None). Each hidden-state tensor has its own storage (in shared host memory)."""
        check_batch_options(truncate=truncate)
        if self.executor is None:
            raise InvalidInput("this generator is closed")
        if not self._busy.acquire(blocking=False):
            raise InvalidInput("this generator is running generate_batches(); finish or close that iteration first")
        try:
            return self._run_batch(token_ids, truncate)
        finally:
            self._busy.release()

    def generate_batches(self, batches: Iterable[Any], *, truncate: bool = False,
                         prefetch: int = 1) -> Iterator[list[dict]]:
        """`generate()` for each batch of `batches`, pipelined: the engine computes batch k+1 while the caller
        handles batch k (at most `prefetch` finished batches wait in between; 0 runs everything in the caller's
        thread). Yields each batch's results, in order, equal to what `generate()` returns for it. Where `batches`
        has a `cancel()` (batches that wait for their input), it is called when the caller stops early (an error,
        Ctrl-C) before the engine's thread is joined, so that thread's wait for the next batch ends then."""
        check_batch_options(truncate=truncate, prefetch=prefetch)
        if self.executor is None:
            raise InvalidInput("this generator is closed")
        if not self._busy.acquire(blocking=False):
            raise InvalidInput("this generator is already running a batch")
        try:
            if prefetch <= 0:
                yield from self._engine_batches(batches, truncate)
                return
            yield from self._pipelined(batches, truncate, prefetch)
        finally:
            self._busy.release()

    def _pipelined(self, batches: Iterable[Any], truncate: bool, prefetch: int) -> Iterator[list[dict]]:
        handed: queue.Queue = queue.Queue(maxsize=prefetch)
        stop = threading.Event()

        def put(item: tuple) -> bool:
            while not stop.is_set():
                try:
                    handed.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    continue
            return False

        def engine_loop() -> None:
            engine_batches = self._engine_batches(batches, truncate)
            try:
                for results in engine_batches:
                    if stop.is_set() or not put(("batch", results)):
                        return
                    del results
                put(("end", None))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                put(("error", exc))
            finally:
                engine_batches.close()

        thread = threading.Thread(target=engine_loop, name="eagle-compat-engine", daemon=True)
        thread.start()
        ended = False
        try:
            while True:
                kind, value = handed.get()
                if kind == "end":
                    ended = True
                    return
                if kind == "error":
                    raise value
                yield value
                del value  # the caller's results alone keep their buffer leased
        finally:
            stop.set()
            cancel = getattr(batches, "cancel", None)
            if not ended and cancel is not None:  # before the join: the engine thread may wait for the next batch
                cancel()
            thread.join()
            while not handed.empty():
                handed.get_nowait()

    def _engine_batches(self, batches: Iterable[Any], truncate: bool) -> Iterator[list[dict]]:
        """Runs the batches back to back and yields each one's results, in order. Every call of a batch (plan, steps,
        collect) is sent at once where vLLM can queue calls (`rpc.can_queue_calls`): the driver schedules and sends
        batch k+1 while the worker still computes batch k, as vLLM's own batch queue does, so the GPU never waits
        for the driver. Up to QUEUED_BATCHES batches are in flight; a batch's results are read when its reply is in."""
        inflight: collections.deque[_Batch] = collections.deque()

        def oldest() -> list[dict]:
            results = self._collect(inflight[0])  # still in `inflight` if this fails: _fail gives its buffer back
            inflight.popleft()
            return results

        try:
            for token_ids in batches:
                try:
                    inflight.append(self._send(token_ids, truncate))
                except InvalidInput:
                    while inflight:  # the batches before a bad one are still delivered
                        yield oldest()
                    raise
                while len(inflight) > QUEUED_BATCHES:
                    yield oldest()
            while inflight:
                yield oldest()
        except BaseException:
            self._fail(*inflight)
            raise

    def _run_batch(self, token_ids: Any, truncate: bool) -> list[dict]:
        batch = self._send(token_ids, truncate)
        try:
            return self._collect(batch)
        except BaseException:
            self._fail(batch)
            raise

    def _send(self, token_ids: Any, truncate: bool) -> "_Batch":
        """Validate, choose the batch's hand-over buffer, then send the worker its plan, every step the scheduler
        makes of it, and the call that collects it. A step's requests are finished as soon as it is sent: prefill
        is all we want, and the worker runs calls in order, so their KV blocks are free for the next step."""
        import torch

        token_lists = validate_token_ids(token_ids, vocab_size=self.vocab_size,
                                         max_len=self.max_model_len - 1, truncate=truncate)
        batch_id = f"eagle_{self._request_counter}"
        self._request_counter += 1
        request_ids = [f"{batch_id}_{i}" for i in range(len(token_lists))]
        dtype = self.vllm_config.model_config.dtype
        layers, hidden = len(self.layer_ids), self.hidden_size
        itemsize = torch.empty((), dtype=dtype).element_size()
        offsets, total_bytes = {}, 0
        for rid, ids in zip(request_ids, token_lists):
            offsets[rid] = (total_bytes, len(ids))
            total_bytes += sample_block_bytes(len(ids), layers, hidden, itemsize)
        slot, why = self._ring.acquire(total_bytes) if hidden else (None, "hidden size unknown")
        if slot is None:
            self._ring.fallbacks += 1
            log.warning("this batch goes through the RPC queue instead of shared memory: %s", why)
        plan = None if slot is None else {"slot": slot.id, "dtype": str(dtype), "hidden": hidden, "requests": offsets}
        batch = _Batch(batch_id, token_lists, request_ids, offsets, slot, set(), dtype)
        try:
            batch.calls.append(("eagle_compat_begin", self._submit("eagle_compat_begin", batch_id, plan)))
            for rid, ids in zip(request_ids, token_lists):
                self.scheduler.add_request(engine.scheduling.make_request(rid, ids, self.eos_token_id))
                batch.pending.add(rid)
            while True:
                out = engine.scheduling.schedule(self.scheduler)  # an empty output's finished ids go with the next
                if out.total_num_scheduled_tokens == 0:
                    break
                # a step not sent keeps the finished ids it carries (the last batch's) for the next one
                try:
                    self._room_for(2)
                except BaseException:
                    engine.scheduling.keep_finished_ids(self.scheduler, out)
                    raise
                try:
                    futures = self._translated(engine.rpc.submit_step, "execute_model")(self.executor, out)
                except BaseException as exc:
                    engine.scheduling.keep_finished_ids(self.scheduler, out)
                    self._close_unless_replied(exc)
                    raise
                calls = [("execute_model", f) for f in futures]
                self._sent.extend(calls)
                batch.calls.extend(calls)
                done = list(out.num_scheduled_tokens)
                engine.scheduling.abort(self.scheduler, done)
                batch.pending.difference_update(done)
            if batch.pending:
                raise RuntimeError(f"{len(batch.pending)} requests were never scheduled (KV cache too small for "
                                   "them?)")
            batch.calls.append(("eagle_compat_finish", self._submit("eagle_compat_finish", batch_id)))
        except BaseException:
            self._fail(batch)
            raise
        return batch

    def _submit(self, method: str, *args: Any) -> Future:
        self._room_for(1)
        try:
            # where vLLM cannot queue calls (0.11.x) this waits for the reply itself: a deadline there, or an
            # interrupt, leaves it unread
            future = self._translated(engine.rpc.submit, method)(self.executor, method, *args)
        except BaseException as exc:
            self._close_unless_replied(exc)
            raise
        self._sent.append((method, future))
        return future

    def _close_unless_replied(self, exc: BaseException) -> None:
        """A failure that is not the worker's own reply (a deadline passed, an interrupted wait, a lost worker) leaves
        that reply unread, so every later reply would be read against the wrong call: the engine is shut down then
        (this generator is closed), never read out of step. On every path: queued, blocking, 0.11.x's steps."""
        if self.executor is None:
            return
        cause = exc.__cause__ if isinstance(exc, WorkerError) and exc.__cause__ is not None else exc
        if isinstance(cause, Exception) and reply_from_worker(cause):
            if self._world_size() == 1:
                return
            # vLLM reads the ranks' replies in order and raises at the first failed one: the other ranks' replies to
            # this call stay queued, and each later call would read them as its own until a collective deadlocks
            log.error("a worker failed a call of a %d-worker engine, whose other replies stay unread; this generator "
                      "is closed: start a new one (extract: rerun with --resume)", self._world_size())
            self.close()
            return
        if getattr(exc, "exc_type", None) != "WorkerDied":  # that one names its cause itself
            log.error("the engine's replies can no longer be matched to their calls (%s: %s); this generator is "
                      "closed: start a new one (extract: rerun with --resume)", type(cause).__name__, cause)
        self.close()

    def _world_size(self) -> int:
        parallel = getattr(getattr(self, "vllm_config", None), "parallel_config", None)
        return int(getattr(parallel, "world_size", 1) or 1)

    def _room_for(self, calls: int) -> None:
        """Wait for the oldest replies until `calls` more fit under CALLS_IN_FLIGHT. A worker's failure stays on its
        future, reported when its batch is collected."""
        while self._sent and len(self._sent) + calls > CALLS_IN_FLIGHT:
            try:
                self._await(*self._sent.popleft())
            except WorkerError:
                if self.executor is None:
                    raise

    def _await(self, method: str, future: Future) -> Any:
        """A queued call's reply. A failure that is not the worker's own reply (a deadline passed, an interrupted
        wait, a lost worker) leaves that reply unread, so every later reply would be read against the wrong call:
        the engine is shut down then (this generator is closed), never read out of step."""
        try:
            return self._translated(_result_of_rank0, method)(future)
        except BaseException as exc:
            self._close_unless_replied(exc)
            raise

    def _collect(self, batch: "_Batch") -> list[dict]:
        """Wait for a sent batch's calls (in the order sent, so the first failure is the one reported) and return
        its results."""
        import torch

        reply = None
        for method, future in batch.calls:
            reply = self._await(method, future)
        batch.calls.clear()
        while self._sent and self._sent[0][1].done():  # answered: do not keep their replies (fallback tensors) alive
            self._sent.popleft()
        reply = reply or {}
        if batch.slot is None:
            return self._results_from_fallback(batch, reply.get("fallback"), reply.get("fallback_rows"))
        rows = reply.get("rows") or {}
        missing = [(rid, n) for rid, (_, n) in batch.offsets.items() if rows.get(rid) != n]
        if missing:
            raise RuntimeError(f"captured rows do not match the prompts for {len(missing)} requests, e.g. "
                               f"{missing[0][0]}: {rows.get(missing[0][0])} rows for {missing[0][1]} tokens")
        lease = self._ring.lease(batch.slot)
        batch.slot = None  # handed out: the results' lifetime decides when it is free again
        layers, hidden = len(self.layer_ids), self.hidden_size
        return [{"input_ids": torch.as_tensor(ids, dtype=torch.long),
                 "hidden_states": tensors_from_lease(lease, batch.dtype, batch.offsets[rid][0], len(ids), layers,
                                                     hidden),
                 "loss_mask": None}
                for rid, ids in zip(batch.request_ids, batch.token_lists)]

    def _fail(self, *batches: "_Batch | None") -> None:
        """After an error: abort what is still queued, forget the worker's plans (after every call sent before),
        give the buffers back."""
        batches = tuple(b for b in batches if b is not None)
        for batch in batches:
            if batch.pending:
                try:
                    engine.scheduling.abort(self.scheduler, sorted(batch.pending))
                except Exception:  # noqa: BLE001 - the original error matters more
                    pass
                batch.pending.clear()
        try:
            self._rpc0("eagle_compat_abandon")
        except Exception:  # noqa: BLE001 - the original error matters more
            pass
        self._sent.clear()
        for batch in batches:
            batch.calls.clear()
            if batch.slot is not None and self._ring is not None:
                self._ring.release(batch.slot.id)
                batch.slot = None

    @staticmethod
    def _results_from_fallback(batch: "_Batch", states: list | None, spans: list | None) -> list[dict]:
        """Each sample's rows of a batch returned through the RPC queue, by the worker's record of which request each
        staged row is: every sample's count is checked, and the order the scheduler ran them in does not matter."""
        import torch

        if not states:
            raise RuntimeError("no hidden states were captured")
        where, offset = {}, 0
        for rid, n in spans or ():
            if rid in where:  # a prompt split over steps would interleave with others: refuse, never guess
                raise RuntimeError(f"request {rid}'s rows arrived in more than one step")
            where[rid], offset = (offset, n), offset + n
        if offset != states[0].shape[0]:
            raise RuntimeError(f"captured {states[0].shape[0]} rows, the worker's record accounts for {offset}")
        asked = dict(zip(batch.request_ids, batch.token_lists))
        wrong = [f"{rid}: {where[rid][1] if rid in where else 0} rows for {len(ids)} tokens"
                 for rid, ids in asked.items() if where.get(rid, (0, None))[1] != len(ids)]
        wrong += [f"{rid}: {n} rows for a request not in this batch"
                  for rid, (_, n) in where.items() if rid not in asked]
        if wrong:
            raise RuntimeError(f"captured rows do not match the prompts for {len(wrong)} requests, e.g. {wrong[0]}")
        results = []
        for rid, ids in zip(batch.request_ids, batch.token_lists):
            start, n = where[rid]
            results.append({"input_ids": torch.as_tensor(ids, dtype=torch.long),
                            # owned tensors: a view would make torch.save write the whole batch's buffer
                            "hidden_states": [h[start:start + n].clone() for h in states],
                            "loss_mask": None})
        return results

    def reserve_host_buffers(self, tokens_per_batch: int, count: int = 5) -> int:
        """Create `count` hand-over buffers for batches of up to `tokens_per_batch` tokens now (each is a /dev/shm
        allocation and, on GPU, a pinning: ~0.1-0.3 s per GiB) rather than during the first batches. The pipeline
        keeps up to QUEUED_BATCHES + 3 in use (in flight, prefetched, the caller's), more with a writer pool; more are
        created on demand. Returns how many were reserved."""
        import torch

        itemsize = torch.empty((), dtype=self.vllm_config.model_config.dtype).element_size()
        nbytes = sample_block_bytes(tokens_per_batch, len(self.layer_ids), self.hidden_size, itemsize)
        return self._ring.reserve(nbytes, count) if self._ring is not None and self.hidden_size else 0

    @property
    def handover_stats(self) -> dict:
        """Shared-memory ring: buffers, bytes, peak bytes, batches that fell back to the RPC queue."""
        ring = self._ring
        if ring is None:
            return {}
        return {"buffers": len(ring.slots), "pinned": sum(s.pinned for s in ring.slots.values()),
                "bytes": ring.total_bytes, "peak_bytes": ring.peak_bytes, "fallback_batches": ring.fallbacks}

    def describe(self) -> dict:
        """The resolved decoder contract (wrapper path, layer class, signature, output kind, capture strategy)."""
        return dict(self.contract)

    def close(self) -> None:
        executor, self.executor = self.executor, None
        if getattr(self, "_sent", None) is not None:
            self._sent.clear()  # their replies can no longer come
        ring, self._ring = getattr(self, "_ring", None), None
        if ring is not None:
            ring.close(rpc_ok=False)  # the workers' mappings end with them
        processes, self._processes = getattr(self, "_processes", None), None
        if processes is not None:
            processes.record()  # what runs below the workers now: a worker the shutdown kills orphans its children
        if executor is not None:
            try:
                executor.shutdown()
            except Exception:  # noqa: BLE001
                log.warning("exception during executor shutdown", exc_info=True)
        if processes is not None:  # vLLM's shutdown may leave some (older releases, a child of a worker, a hang)
            ended = processes.end()
            if ended:
                log.warning("ended %d process(es) of this generator's engine that were still running after its "
                            "shutdown: %s", len(ended), "; ".join(ended))
        if getattr(self, "_worker_errors", None) is not None:
            self._worker_errors.close()
            self._worker_errors = None
        engine.process_env.release_env(getattr(self, "_env_restore", []))
        self._env_restore = []

    def __enter__(self) -> "VllmHiddenStatesGenerator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
