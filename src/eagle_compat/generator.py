"""eagle_compat's own hidden-states generator: speculators 0.3.0's API, built on eagle_compat's engine adapters
and its one capture implementation (hooks resolved per model family inside the workers)."""
from __future__ import annotations

import logging
import numbers
import os
from typing import Any, Sequence

from . import engine
from .capture import handshake
from .capture.remote_errors import WorkerErrorLog, translate
from .capture.worker import receive
from .errors import InvalidInput

log = logging.getLogger("eagle_compat.generator")

WORKER_EXTENSION = "eagle_compat.capture.worker.CaptureWorkerExtension"


def model_text_config(model_path: str, trust_remote_code: bool = False) -> Any:
    """The language model's config: `num_hidden_layers`, `vocab_size`.

    Read from config.json where possible: multimodal wrappers such as Kimi-K2.5 have model types that older
    transformers do not know (vLLM registers its own config class for them)."""
    import json
    from types import SimpleNamespace

    path = os.path.join(model_path, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            raw = json.load(f)
        for candidate in (raw.get("text_config"), raw.get("language_config"), raw):
            if isinstance(candidate, dict) and "num_hidden_layers" in candidate:
                return SimpleNamespace(**candidate)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not hasattr(text, "num_hidden_layers"):
        raise InvalidInput(f"{model_path}: cannot find num_hidden_layers in its config")
    return text


def default_layer_ids(num_layers: int) -> list[int]:
    """speculators 0.3.0's default [2, N//2, N-3, N-1], each layer once, in ascending order."""
    return sorted({i for i in (2, num_layers // 2, num_layers - 3, num_layers - 1) if 0 <= i < num_layers})


def validate_layer_ids(layer_ids: Sequence[Any], num_layers: int) -> list[int]:
    if isinstance(layer_ids, (str, bytes)) or not isinstance(layer_ids, Sequence) or len(layer_ids) == 0:
        raise InvalidInput(f"layer_ids must be a non-empty list of ints in [0, {num_layers - 1}], got {layer_ids!r}")
    out = []
    for i in layer_ids:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise InvalidInput(f"layer id {i!r} is not an int; allowed: ints in [0, {num_layers - 1}]")
        if not 0 <= int(i) < num_layers:
            raise InvalidInput(f"layer id {i} out of range; this model has layers 0..{num_layers - 1}")
        out.append(int(i))
    dups = sorted({i for i in out if out.count(i) > 1})
    if dups:
        raise InvalidInput(f"layer ids {dups} repeated in {list(layer_ids)}; give each layer once")
    return out


def validate_token_ids(token_ids: Any, *, vocab_size: int, max_len: int, truncate: bool) -> list[list[int]]:
    """Every check generate() makes before anything reaches the engine."""
    try:
        import torch
        if isinstance(token_ids, torch.Tensor):
            if token_ids.dim() != 2 or token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
                raise InvalidInput(f"a token-id tensor must be 2-D and integer, got shape {tuple(token_ids.shape)} "
                                   f"dtype {token_ids.dtype}")
            token_ids = token_ids.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise InvalidInput(f"token_ids must be a list of token-id lists, got {type(token_ids).__name__}")
    if len(token_ids) == 0:
        raise InvalidInput("token_ids is an empty batch; give at least one sequence")
    out: list[list[int]] = []
    for n, seq in enumerate(token_ids):
        if hasattr(seq, "tolist"):
            seq = seq.tolist()
        if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence):
            raise InvalidInput(f"sequence {n} is a {type(seq).__name__}, not a list of token ids")
        if len(seq) == 0:
            raise InvalidInput(f"sequence {n} is empty; every sequence needs at least one token")
        ids = []
        for pos, t in enumerate(seq):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise InvalidInput(f"sequence {n}, position {pos}: token id {t!r} is not an int")
            if not 0 <= int(t) < vocab_size:
                raise InvalidInput(f"sequence {n}, position {pos}: token id {int(t)} outside the vocabulary "
                                   f"[0, {vocab_size - 1}]")
            ids.append(int(t))
        if len(ids) > max_len:
            if not truncate:
                raise InvalidInput(
                    f"sequence {n} has {len(ids)} tokens; at most max_model_len - 1 = {max_len} fit (one slot is "
                    "the sampled token). Raise max_model_len, shorten it, or pass truncate=True.")
            ids = ids[:max_len]
        out.append(ids)
    return out


class VllmHiddenStatesGenerator:
    """Extract the residual stream leaving chosen decoder layers during prefill (speculators 0.3.0's contract).

    `layer_ids=[i]` is the stream leaving layer i (HF `hidden_states[i+1]` for i <= N-2; for the last layer N-1 it
    is the *input* of the final norm). Results come back in the order of `layer_ids`.
    """

    def __init__(self, model_path: str, layer_ids: list[int] | None = None, max_model_len: int = 2048,
                 gpu_memory_utilization: float = 0.8, tensor_parallel_size: int = 1, *, dtype: str = "auto",
                 trust_remote_code: bool = False, kv_cache_memory_bytes: int | None = None,
                 max_num_seqs: int = engine.MAX_NUM_SEQS, max_num_batched_tokens: int | None = None,
                 load_format: str = "auto"):
        engine.require_vllm()
        if not isinstance(max_model_len, int) or max_model_len < 2:
            raise InvalidInput(f"max_model_len={max_model_len!r}; must be an int >= 2")
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise InvalidInput(f"tensor_parallel_size={tensor_parallel_size!r}; must be an int >= 1")
        if not 0.0 < float(gpu_memory_utilization) <= 1.0:
            raise InvalidInput(f"gpu_memory_utilization={gpu_memory_utilization!r}; must be in (0, 1]")
        if not os.path.exists(model_path) and "/" not in model_path:
            raise InvalidInput(f"model_path {model_path!r} is neither a local directory nor a hub id")
        self.model_path = model_path
        self.tensor_parallel_size = tensor_parallel_size
        self.max_model_len = max_model_len
        self._request_counter = 0
        self.executor = None
        text_config = model_text_config(model_path, trust_remote_code)
        self.num_layers = int(text_config.num_hidden_layers)
        self.vocab_size = int(getattr(text_config, "vocab_size", 0) or 0)
        self.layer_ids = (default_layer_ids(self.num_layers) if layer_ids is None
                          else validate_layer_ids(layer_ids, self.num_layers))
        from transformers import AutoTokenizer
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        except Exception as exc:  # noqa: BLE001 - token ids can still be given directly
            log.warning("no tokenizer for %s (%s); eos_token_id unknown", model_path, exc)
            self.tokenizer = None
        from .installer import require_cpu_platform_ready
        require_cpu_platform_ready()  # before anything reaches the engine
        self._env_restore = engine.apply_env(engine.default_worker_env(dtype, tensor_parallel_size))
        try:
            self.vllm_config = engine.build_vllm_config(
                model_path, worker_extension_cls=WORKER_EXTENSION, max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
                dtype=dtype, trust_remote_code=trust_remote_code, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory_bytes=kv_cache_memory_bytes,
                load_format=load_format)
            from vllm.v1.executor.multiproc_executor import MultiprocExecutor

            self._worker_errors = WorkerErrorLog()  # workers' own tracebacks, for failures inside vLLM's code
            with self._worker_errors.spawning():
                self.executor = MultiprocExecutor(vllm_config=self.vllm_config)
            engine.remember_executor(self.executor)
            handshake.require_patched_workers(self._translated(self.executor.collective_rpc, "collective_rpc"),
                                              "generator")
            self.contract = self._rpc0("eagle_compat_setup", self.layer_ids)
            budget = self._translated(engine.kv_budget, "determine_available_memory")(
                self.executor, gpu_memory_utilization)
            kv_cache_config = engine.build_kv_cache_config(self.vllm_config, self.executor, budget)
            self.scheduler = engine.build_scheduler(self.vllm_config, kv_cache_config)
            self._translated(engine.initialize_workers, "initialize_from_config")(
                self.executor, kv_cache_config, self.vllm_config.parallel_config.world_size)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------------------------
    def _translated(self, fn: Any, method: str) -> Any:
        return translate(fn, method, log=getattr(self, "_worker_errors", None))

    def _rpc0(self, method: str, *args: Any) -> Any:
        return self._translated(engine.rpc_rank0, method)(self.executor, method, *args)

    @property
    def eos_token_id(self) -> int | None:
        return getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None

    def generate(self, token_ids: list[list[int]] | Any, *, truncate: bool = False) -> list[dict]:
        """Hidden states of every prompt token for each layer id. Returns, per sequence, a dict with
        `input_ids` (LongTensor [T]), `hidden_states` (list, per layer id, of [T, hidden] tensors on the CPU) and
        `loss_mask` (None)."""
        import torch

        if self.executor is None:
            raise InvalidInput("this generator is closed")
        batch = validate_token_ids(token_ids, vocab_size=self.vocab_size or 2**62,
                                   max_len=self.max_model_len - 1, truncate=truncate)
        request_ids = [f"eagle_{self._request_counter}_{i}" for i in range(len(batch))]
        self._request_counter += 1
        self._rpc0("eagle_compat_reset")
        pending = set(request_ids)
        try:
            for rid, ids in zip(request_ids, batch):
                self.scheduler.add_request(engine.make_request(rid, ids, self.eos_token_id))
            while (out := self.scheduler.schedule()).total_num_scheduled_tokens > 0:
                self._translated(engine.run_step, "execute_model")(self.executor, out)
                done = list(out.num_scheduled_tokens)
                engine.abort(self.scheduler, done)
                pending.difference_update(done)
            if pending:
                raise RuntimeError(f"{len(pending)} requests were never scheduled (KV cache too small for them?)")
            states = receive(self._rpc0("eagle_compat_collect"))
        except BaseException:
            if pending:
                engine.abort(self.scheduler, sorted(pending))
            try:
                self._rpc0("eagle_compat_reset")
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
            raise
        if not states:
            raise RuntimeError("no hidden states were captured")
        total = sum(len(ids) for ids in batch)
        if states[0].shape[0] != total:
            raise RuntimeError(f"captured {states[0].shape[0]} rows for {total} prompt tokens")
        results, offset = [], 0
        for ids in batch:
            n = len(ids)
            results.append({"input_ids": torch.as_tensor(ids, dtype=torch.long),
                            # owned tensors: a view would make torch.save write the whole batch's buffer
                            "hidden_states": [h[offset:offset + n].clone() for h in states],
                            "loss_mask": None})
            offset += n
        return results

    def describe(self) -> dict:
        """The resolved decoder contract (wrapper path, layer class, signature, output kind, capture strategy)."""
        return dict(self.contract)

    def close(self) -> None:
        executor, self.executor = self.executor, None
        if executor is not None:
            try:
                executor.shutdown()
            except Exception:  # noqa: BLE001
                log.warning("exception during executor shutdown", exc_info=True)
        if getattr(self, "_worker_errors", None) is not None:
            self._worker_errors.close()
            self._worker_errors = None
        for k, v in getattr(self, "_env_restore", {}).items():
            if v is None:
                os.environ.pop(k, None)
        self._env_restore = {}

    def __enter__(self) -> "VllmHiddenStatesGenerator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
