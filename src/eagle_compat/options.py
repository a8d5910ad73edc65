"""The checks the stable generator and the extract job share, made before anything is loaded: layer ids, engine
and generator options. A leaf (errors and settings only): the job's refusals need neither torch nor vLLM."""
from __future__ import annotations

import numbers
from typing import Any, Sequence

from . import settings
from .errors import InvalidInput


class CheckedLayerIds(list):
    """Layer ids already checked against a model of `num_layers` layers (`validate_layer_ids`, `default_layer_ids`):
    the stable generator takes them as they are, so one list is checked once in a process (the extract job checks
    --layers, then hands them to the generator)."""

    def __init__(self, ids: Sequence[int], num_layers: int) -> None:
        super().__init__(ids)
        self.num_layers = num_layers


def checked_for(layer_ids: Any, num_layers: int) -> bool:
    return isinstance(layer_ids, CheckedLayerIds) and layer_ids.num_layers == num_layers


def default_layer_ids(num_layers: int) -> list[int]:
    """speculators 0.3.0's default [2, N//2, N-3, N-1], each layer once, in ascending order."""
    return CheckedLayerIds(sorted({i for i in (2, num_layers // 2, num_layers - 3, num_layers - 1)
                                   if 0 <= i < num_layers}), num_layers)


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
    return CheckedLayerIds(out, num_layers)


def to_entering(leaving: list[int]) -> list[int]:
    """speculators 0.3.0's layer ids (leaving layer k) in vLLM's native convention (entering layer k+1)."""
    return [int(k) + 1 for k in leaving]


def check_training_layers(layer_ids: list[int], num_layers: int, what: str) -> None:
    """The layers of training files, in every format (speculators' trainers read slots by position):
    * ascending: the trainers concatenate the auxiliary slots in file order, and vLLM hands a drafter its auxiliary
      states in model order at inference (`SupportsEagle3._set_aux_hidden_state_layers` sorts them), so another order
      trains the drafter on permuted features, with no error anywhere;
    * the last slot the final pre-norm state (leaving N-1): speculators 0.3.0's `standardize_data_v1` and 0.8-0.9's
      Arrow reader train on the last slot as the verifier's last hidden state."""
    want = sorted({*layer_ids, num_layers - 1})
    entering = f"(entering, vLLM's native 'entering' convention: {to_entering(layer_ids)})"
    if list(layer_ids) != sorted(layer_ids):
        raise InvalidInput(
            f"{what}: layers {list(layer_ids)} {entering} are not in ascending order: speculators' trainers read the "
            "auxiliary slots in file order and vLLM feeds a drafter its auxiliary states in model order at "
            f"inference, so the drafter would learn permuted features. Give them ascending, e.g. --layers "
            f"{','.join(map(str, want))}")
    if layer_ids[-1] != num_layers - 1:
        raise InvalidInput(
            f"{what}: the last layer must be the final pre-norm state, layer {num_layers - 1} in --layers' "
            f"convention (leaving layer k; = id {num_layers} in vLLM's native 'entering' convention): speculators' "
            f"trainers (0.3.0's data_{{i}} files, 0.8-0.9's Arrow layout) train on the last slot as the verifier's "
            f"last hidden state. Got layers {list(layer_ids)} {entering}; e.g. --layers {','.join(map(str, want))}")


ENGINE_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # vLLM's ModelConfig.dtype strings


def check_engine_options(*, tensor_parallel_size: Any, gpu_memory_utilization: Any, kv_cache_memory_bytes: Any,
                         dtype: Any, name: Any = lambda option: option) -> None:
    """What the engine would refuse only once started: checked first, so nothing is written or loaded for a typo.
    `name(option)` spells an option as its caller's user wrote it (extract: --tensor-parallel-size)."""
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise InvalidInput(f"{name('tensor_parallel_size')}={tensor_parallel_size!r}; must be an int >= 1")
    if gpu_memory_utilization is not None and (  # None: the device's default (default_gpu_memory_utilization)
            isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, numbers.Real) or
            not 0.0 < float(gpu_memory_utilization) <= 1.0):
        raise InvalidInput(f"{name('gpu_memory_utilization')}={gpu_memory_utilization!r}; must be in (0, 1]")
    if kv_cache_memory_bytes is not None and (isinstance(kv_cache_memory_bytes, bool) or not isinstance(
            kv_cache_memory_bytes, int) or kv_cache_memory_bytes <= 0):
        raise InvalidInput(f"{name('kv_cache_memory_bytes')}={kv_cache_memory_bytes!r}; must be a positive int "
                           "(bytes)")
    if isinstance(dtype, str) and dtype not in ENGINE_DTYPES:
        raise InvalidInput(f"{name('dtype')}={dtype!r}; allowed: {', '.join(ENGINE_DTYPES)}")


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # numpy ints too


def check_load_format(load_format: Any) -> None:
    if not isinstance(load_format, str) or not load_format:
        raise InvalidInput(f"load_format={load_format!r}; must be one of vLLM's load formats, e.g. 'auto' or 'dummy'")


def check_generator_options(*, max_num_seqs: Any, max_num_batched_tokens: Any, load_format: Any,
                            shm_limit_bytes: Any, max_model_len: int) -> None:
    """The stable generator's own keywords, before anything is loaded (a typo used to surface in the worker, on
    the first batch, or as a silently used default)."""
    from .capture.handover import LIMIT_ENV  # a leaf too
    if not is_int(max_num_seqs) or max_num_seqs < 1:
        raise InvalidInput(f"max_num_seqs={max_num_seqs!r}; must be an int >= 1")
    if max_num_batched_tokens is not None and (not is_int(max_num_batched_tokens) or
                                               max_num_batched_tokens < max_model_len):
        # chunked prefill is always off here, so one step must hold a whole max_model_len prompt
        raise InvalidInput(f"max_num_batched_tokens={max_num_batched_tokens!r}; must be None (the default) or an "
                           f"int >= max_model_len ({max_model_len})")
    check_load_format(load_format)
    if shm_limit_bytes is not None and (not is_int(shm_limit_bytes) or shm_limit_bytes < 0):
        raise InvalidInput(f"shm_limit_bytes={shm_limit_bytes!r}; must be None (free space in /dev/shm) or an int "
                           ">= 0 (bytes; 0: every batch through the RPC queue)")
    if shm_limit_bytes is None:
        settings.value(LIMIT_ENV)  # refused here, naming the variable, before anything is loaded


def check_batch_options(*, truncate: Any, prefetch: Any = 0) -> None:
    if not isinstance(truncate, bool):
        raise InvalidInput(f"truncate={truncate!r}; must be True or False")
    if not is_int(prefetch) or prefetch < 0:
        raise InvalidInput(f"prefetch={prefetch!r}; must be an int >= 0")
