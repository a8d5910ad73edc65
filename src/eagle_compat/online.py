"""Hidden states straight into a training loop: no files.

    from eagle_compat.online import HiddenStates
    states = HiddenStates("Qwen/Qwen3-8B", "data.jsonl", layers=[2, 18, 33, 35], batch_size=8, seed=0)
    for epoch in range(epochs):
        states.set_epoch(epoch)
        for sample in states:  # {"input_ids", "hidden_states", "loss_mask"}: what extract's data_{i}.pt holds
            ...
    states.close()  # or `with HiddenStates(...) as states:`; the engine's processes end at exit anyway

It reads the input `extract` takes, the same way (conversations through the model's chat template with their loss
masks, or token ids; --max-len, --min-loss-tokens and --skip-uncovered alike; every line checked before the engine
starts), and yields for each sample exactly what extract writes in its file: the same tensors, bit for bit, for the
same batches (tests/test_online.py). speculators 0.3.0's layer ids, in the order given (the trainer's order).

* Order: DistributedSampler's. Each epoch a permutation from `seed + epoch` (torch.randperm), padded to a multiple
  of `world_size` by repeating its first samples (or cut, `drop_last`), rank r taking every world_size-th from r.
  `shuffle=False` keeps the input's order. Every rank yields the same number of samples (no collective waits).
* The engine runs batches of `batch_size` of this rank's samples in that order, at most `read_ahead` finished batches
  ahead of the training loop (the generator's pipelining: memory stays flat however long the run). A sample's states
  are the engine's shared-memory buffer (no copy); a loop that keeps samples keeps their buffers leased.
* `state_dict()` / `load_state_dict()`: the epoch and how many samples this rank has yielded in it. A trainer
  restarted from its checkpoint goes on from its next sample; the batch that sample was in is run whole again, so
  every sample's states are those of the same batch as before.
* The engine starts at the first iteration, here, with its own worker processes (vLLM's), and ends at `close()`,
  at this process's exit, on Ctrl-C and on SIGTERM of the training process (leftovers.EngineProcesses). An engine
  error reaches the loop as the exception `generate` raises, its cause attached.
* A DataLoader with worker processes would start one engine per worker: refused; use num_workers=0 (the engine
  already runs ahead on its own thread).
"""
from __future__ import annotations

import math
import os
import tempfile
from typing import Any, Iterator

from . import options
from .errors import InvalidInput

STATE_VERSION = 1
# what decides the order of every epoch: a state saved under other values of these is refused when loaded
_ORDER_KEYS = ("seed", "shuffle", "world_size", "rank", "drop_last", "batch_size", "samples", "data_sha256",
               "layer_ids", "max_len")

try:
    from torch.utils.data import IterableDataset as _Base
except ImportError:  # torch comes with vLLM; without it nothing here runs anyway
    _Base = object  # type: ignore[misc,assignment]


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidInput(f"{name}={value!r}; must be True or False")
    return value


def _count(name: str, value: Any, least: int) -> int:
    if not options.is_int(value) or value < least:
        raise InvalidInput(f"{name}={value!r}; must be an int >= {least}")
    return int(value)


def distributed_place(rank: Any = None, world_size: Any = None) -> tuple[int, int]:
    """(rank, world_size): as given, else torch.distributed's where it is initialized, else RANK and WORLD_SIZE from
    the environment (torchrun's), else (0, 1)."""
    if rank is None and world_size is None:
        try:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                return dist.get_rank(), dist.get_world_size()
        except ImportError:
            pass
        rank, world_size = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
        try:
            rank, world_size = int(rank), int(world_size)
        except ValueError:
            raise InvalidInput(f"RANK={rank!r}, WORLD_SIZE={world_size!r} in the environment; must be ints") from None
    elif rank is None or world_size is None:
        raise InvalidInput(f"rank={rank!r}, world_size={world_size!r}: give both, or neither (then torch.distributed's "
                           "or the environment's RANK and WORLD_SIZE)")
    world_size = _count("world_size", world_size, 1)
    rank = _count("rank", rank, 0)
    if rank >= world_size:
        raise InvalidInput(f"rank={rank} with world_size={world_size}; must be 0 <= rank < world_size")
    return rank, world_size


def epoch_order(n: int, epoch: int, *, seed: int, shuffle: bool, rank: int, world_size: int,
                drop_last: bool) -> list[int]:
    """This rank's sample positions for `epoch`, as torch's DistributedSampler orders range(n)."""
    if shuffle:
        import torch
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        indices = torch.randperm(n, generator=g).tolist()
    else:
        indices = list(range(n))
    if drop_last and n % world_size:
        total = (n // world_size) * world_size
        indices = indices[:total]
    else:
        total = math.ceil(n / world_size) * world_size
        padding = total - n
        indices += (indices * math.ceil(padding / n))[:padding] if padding else []
    return indices[rank:total:world_size]


class HiddenStates(_Base):
    """An iterable of samples and their hidden states for a training loop (module docstring). Everything is checked
    and the input read here, before any engine starts; the engine starts at the first iteration."""

    def __init__(self, model: str, data: str, *, layers: list[int] | None = None, max_len: int | None = None,
                 batch_size: int = 8, shuffle: bool = True, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, drop_last: bool = False, read_ahead: int = 2,
                 min_loss_tokens: int = 1, loss_mask: str = "generated", skip_uncovered: bool = False,
                 validate: bool = False,
                 dtype: str = "auto", gpu_memory_utilization: float | None = None, tensor_parallel_size: int = 1,
                 kv_cache_memory_bytes: int | None = None, trust_remote_code: bool = False,
                 load_format: str = "auto", show_load_progress: bool = True):
        from . import model_facts
        from .model_source import local_model_path

        self.batch_size = _count("batch_size", batch_size, 1)
        self.read_ahead = _count("read_ahead", read_ahead, 1)
        self.seed = _count("seed", seed, 0)
        self.shuffle, self.drop_last = _flag("shuffle", shuffle), _flag("drop_last", drop_last)
        self.rank, self.world_size = distributed_place(rank, world_size)
        min_loss_tokens = _count("min_loss_tokens", min_loss_tokens, 0)
        from .extract import conversation
        conversation.check_loss_mask(loss_mask)
        trust_remote_code = _flag("trust_remote_code", trust_remote_code)
        if not isinstance(data, (str, os.PathLike)) or not os.path.isfile(data):
            raise InvalidInput(f"data={data!r}: " + ("a directory; give the JSONL file" if isinstance(data, str)
                                                     and os.path.isdir(data) else "no such file"))
        self.data = os.fspath(data)
        self.model = local_model_path(os.fspath(model), option="model")
        options.check_load_format(load_format)
        options.check_engine_options(tensor_parallel_size=tensor_parallel_size,
                                     gpu_memory_utilization=gpu_memory_utilization,
                                     kv_cache_memory_bytes=kv_cache_memory_bytes, dtype=dtype)
        if gpu_memory_utilization is None:
            gpu_memory_utilization = model_facts.default_gpu_memory_utilization()
        text_config = model_facts.model_text_config(self.model, trust_remote_code)
        num_layers = int(text_config.num_hidden_layers)
        self.layer_ids = (options.default_layer_ids(num_layers) if layers is None
                          else options.validate_layer_ids(layers, num_layers))
        options.check_training_layers(self.layer_ids, num_layers, "layers")
        from .extract import job_options
        self.max_len, _ = job_options.resolve_max_len(self.model, text_config, max_len)
        self._engine_keywords = dict(
            model_path=self.model, layer_ids=self.layer_ids, max_model_len=self.max_len + 1,
            gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
            trust_remote_code=trust_remote_code, kv_cache_memory_bytes=kv_cache_memory_bytes,
            load_format=load_format, show_load_progress=show_load_progress)
        self._input = _read_input(self.data, self.model, self.max_len, int(getattr(text_config, "vocab_size", 0) or 0),
                                  skip_uncovered=_flag("skip_uncovered", skip_uncovered),
                                  validate=_flag("validate", validate), min_loss_tokens=min_loss_tokens,
                                  loss_mask=loss_mask,
                                  trust_remote_code=trust_remote_code)
        self.samples = self._input.samples
        self._spool = self._input.spool
        self.data_sha256 = self._input.data_sha256
        self.epoch = self.position = 0
        self._engine: Any = None
        self._iterating = False

    # ---- order and state -----------------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Samples this rank yields per epoch (every rank the same)."""
        n, w = len(self.samples), self.world_size
        return n // w if self.drop_last and n % w else math.ceil(n / w)

    def order(self, epoch: int | None = None) -> list[int]:
        """This rank's sample positions (into `samples`, input order) for `epoch` (default: the current one)."""
        return epoch_order(len(self.samples), self.epoch if epoch is None else epoch, seed=self.seed,
                           shuffle=self.shuffle, rank=self.rank, world_size=self.world_size, drop_last=self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration runs. Another epoch than the current one starts at its first sample; the
        current one is left where it is (a trainer that loaded its state and then sets the epoch goes on)."""
        epoch = _count("epoch", epoch, 0)
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def _order_facts(self) -> dict:
        return {"seed": self.seed, "shuffle": self.shuffle, "world_size": self.world_size, "rank": self.rank,
                "drop_last": self.drop_last, "batch_size": self.batch_size, "samples": len(self.samples),
                "data_sha256": self.data_sha256, "layer_ids": list(self.layer_ids), "max_len": self.max_len}

    def state_dict(self) -> dict:
        """Where this rank is: the epoch and how many of its samples it has yielded in it, with what decides the
        order (checked by load_state_dict)."""
        return {"version": STATE_VERSION, "epoch": self.epoch, "position": self.position, **self._order_facts()}

    def load_state_dict(self, state: dict) -> None:
        """Goes on from `state` (this rank's, from `state_dict`): the next sample is the one after the last yielded
        then. Refused, naming what differs, where the order it was saved under is not this one's."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise InvalidInput(f"state {str(state)[:200]!r}: not a HiddenStates.state_dict() of version "
                               f"{STATE_VERSION}")
        mine = self._order_facts()
        differ = [f"{k}: saved {state.get(k)!r}, here {mine[k]!r}" for k in _ORDER_KEYS if state.get(k) != mine[k]]
        if differ:
            raise InvalidInput("this state was saved under another order, so its position names other samples here: "
                               + "; ".join(differ))
        epoch = _count("state's epoch", state.get("epoch"), 0)
        position = _count("state's position", state.get("position"), 0)
        if position > len(self):
            raise InvalidInput(f"state's position {position}: this rank has {len(self)} samples an epoch")
        if self._iterating:
            raise InvalidInput("load_state_dict while this iterable is being iterated; load it before the loop")
        # an epoch's end stays where it is: its iteration yields nothing and moves on, as a loop resuming that
        # epoch expects; a loop starting the next one sets it (set_epoch)
        self.epoch, self.position = epoch, position

    # ---- the engine and the loop ---------------------------------------------------------------------------------
    def _started(self) -> Any:
        if self._engine is None:
            from . import generator
            _check_memory_split(self._engine_keywords["gpu_memory_utilization"])
            self._engine = generator.VllmHiddenStatesGenerator(**self._engine_keywords)
        return self._engine

    def __iter__(self) -> Iterator[dict]:
        _refuse_in_a_loader_worker()
        if self._iterating:
            raise InvalidInput("this HiddenStates is already being iterated (one loop at a time: its engine runs one "
                               "order of batches)")
        self._iterating = True
        try:
            yield from self._epoch()
        finally:
            self._iterating = False

    def _epoch(self) -> Iterator[dict]:
        epoch, start, size = self.epoch, self.position, self.batch_size
        mine = self.order(epoch)
        # batches fixed by position in this rank's order: a restart runs the batch of its next sample whole again
        batches = [mine[b:b + size] for b in range(start - start % size, len(mine), size)]
        skip = start % size
        engine = self._started()
        token_ids = ([list(self.samples[k].input_ids) for k in batch] for batch in batches)
        results = engine.generate_batches(token_ids, prefetch=self.read_ahead)
        try:
            for batch, outputs in zip(batches, results):
                for k, result in zip(batch, outputs, strict=True):
                    if skip:
                        skip -= 1
                        continue
                    sample = self._sample(self.samples[k], result)
                    self.position += 1
                    yield sample
        finally:
            results.close()  # a loop that stops early stops the engine's thread at once
        self.epoch, self.position = epoch + 1, 0

    def _sample(self, s: Any, result: dict) -> dict:
        """What extract's file of this sample holds, checked as extract checks it before writing."""
        from .extract import formats, writer
        sample = formats.training_sample(result, s.loss_mask)
        try:
            writer.require_finite(s.index, sample["hidden_states"], self.layer_ids)
            writer.require_varying(s.index, sample["input_ids"], sample["hidden_states"], self.layer_ids)
        except (writer.NonFiniteStates, writer.DegenerateStates) as exc:
            raise type(exc)(f"{self.data}:{s.line}: {exc}") from None
        return sample

    def close(self) -> None:
        """Ends the engine and its processes; the input's spool goes. Idempotent."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()
        spool_file, self._spool = getattr(self, "_spool", None), None
        if spool_file is not None:
            spool_file.close()

    def __getstate__(self) -> dict:
        # a DataLoader whose workers are spawned pickles the dataset for each: said here, not as a pickling error
        raise InvalidInput("a HiddenStates cannot be sent to another process (a DataLoader worker would start an "
                           "engine of its own): use DataLoader(..., num_workers=0); the engine already runs ahead of "
                           "the loop on a thread of its own (read_ahead)")

    def __enter__(self) -> "HiddenStates":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _read_input(data: str, model: str, max_len: int, vocab_size: int, *, skip_uncovered: bool, validate: bool,
                min_loss_tokens: int, trust_remote_code: bool, loss_mask: str = "generated") -> Any:
    """The input read as extract reads it: every line checked first (inputs.check_lines), then tokenized into a spool
    (an unnamed temporary file: the driver holds 16 bytes a sample, not its tokens)."""
    from transformers import AutoTokenizer

    from .extract import input_reading, inputs, spool
    inputs.check_lines(data, max_len, vocab_size)
    tokenizer_error = ""
    try:
        tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - pre-tokenized input does not need one; conversations say why
        tokenizer, tokenizer_error = None, input_reading.tokenizer_problem(model, exc)
    made = spool.Builder(tempfile.gettempdir())
    try:
        made.start(inputs.read_dataset, data, tokenizer, max_len, vocab_size=vocab_size,
                   skip_uncovered=skip_uncovered, check_decoded=validate, min_loss_tokens=min_loss_tokens,
                   loss_mask=loss_mask, chat_format=inputs.chat_format_of(model),
                   tokenizer_error=tokenizer_error)
        read = made.join()
        read.samples = made.done({"online": True}, read)
        read.spool = made
        return read
    except BaseException:
        made.close()
        raise


def _refuse_in_a_loader_worker() -> None:
    try:
        from torch.utils.data import get_worker_info
    except ImportError:
        return
    info = get_worker_info()
    if info is not None:
        raise InvalidInput(f"HiddenStates iterated in DataLoader worker {info.id} of {info.num_workers}: each worker "
                           "would start an engine of its own. Use DataLoader(..., num_workers=0): the engine already "
                           "runs ahead of the loop on a thread of its own (read_ahead)")


def _check_memory_split(gpu_memory_utilization: float) -> None:
    """Where this process already uses the GPU (a trainer on it), the engine's share must be free now: said before
    the weights load, with the numbers, instead of vLLM's failure after."""
    try:
        import torch
    except ImportError:
        return
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    free, total = torch.cuda.mem_get_info()
    wanted = gpu_memory_utilization * total
    if wanted > free:
        raise InvalidInput(f"gpu_memory_utilization={gpu_memory_utilization}: the engine would take "
                           f"{wanted / 2**30:.1f} GiB of this GPU's {total / 2**30:.1f} GiB, but {free / 2**30:.1f} GiB "
                           "are free (the training loop holds the rest). Give the engine at most "
                           f"{max(0.0, free / total - 0.02):.2f}, or run it on another GPU (CUDA_VISIBLE_DEVICES)")
