"""One wrapper per wrapped name: the adapters units contribute to.

Several units need the same speculators name (three rewrite `SchedulerConfig`'s keywords; seven need something of
the `MultiprocExecutor` speculators builds). Stacked one wrapper per unit, the result depended on registry order.
Instead the first unit that needs a name installs its one adapter, every unit adds a contribution, and the original
comes back when the last contribution is withdrawn (`Patcher.revert`). The composition is defined by the adapter,
never by the order in which units contributed:

* `ConstructorAdapter` (a constructor speculators calls with keywords): every keyword rewrite sees the caller's
  keywords, never another unit's result; the changes are merged, and two contributions changing one keyword
  differently are refused at the call. Then each `built(instance)` contribution, in unit-name order, on the object
  built (a unit that needs that instance's method: `instance_method_hook`; two units hooking one method nest with
  the last unit name outermost, unlike the executor's `methods`). Contributions commute by construction.
* `ExecutorAdapter` (the executor speculators builds; vLLM's class is untouched): in phases, each phase's
  contributions in unit-name order:
    0. `start(attempt)`: wraps one whole start (phase 1 and the construction), which it may run again (a start that
       lost a race); starts nest in unit-name order, the first name outermost;
    1. `spawning(args, kwargs)`: context managers entered around the construction (each restores only what it set);
    2. `built(executor, what spawning yielded)`: per-executor set-up, before any call goes through a hook;
    3. `methods`: {name: hook(executor, call, args, kwargs)} put on the instance; hooks on one method nest in
       unit-name order, the first name outermost, vLLM's own method innermost;
    4. `ready(executor)`: checks that may call the executor (through every hook); one that raises shuts it down.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Mapping

import wrapt

from ..errors import IncompatibleEnvironment

_MISSING = object()


class Adapter:
    """The one eagle_compat wrapper of one name. Contributions are keyed by unit name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.contributions: dict[str, Any] = {}
        self.installed: Any = None  # the Patcher Change that put this adapter in place

    def ordered(self) -> list[tuple[str, Any]]:
        return sorted(self.contributions.items())

    def describe(self) -> dict[str, Any]:
        """What the adapter does, in the order it does it (for doctor and the order-independence test)."""
        return {"target": self.name, "units": [unit for unit, _ in self.ordered()]}

    def __call__(self, wrapped, instance, args, kwargs):  # wrapt wrapper
        raise NotImplementedError


@dataclass(frozen=True)
class ConstructorHooks:
    rewrite: Callable[[dict], dict] | None = None  # the caller's keywords -> the keywords to call with
    built: Callable[[Any], None] | None = None  # on each object built, before the caller gets it


class ConstructorAdapter(Adapter):
    def describe(self) -> dict[str, Any]:
        hooks = self.ordered()
        return {"target": self.name, "units": [u for u, _ in hooks],
                "rewrite": [u for u, h in hooks if h.rewrite], "built": [u for u, h in hooks if h.built]}

    def __call__(self, wrapped, instance, args, kwargs):
        built = wrapped(*args, **self.transform(kwargs))
        for _, h in self.ordered():
            if h.built:
                h.built(built)
        return built

    def transform(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        out, changed_by = dict(kwargs), {}
        for unit, rewrite in ((u, h.rewrite) for u, h in self.ordered() if h.rewrite):
            new = rewrite(dict(kwargs))
            for key in set(kwargs) | set(new):
                value = new.get(key, _MISSING)
                if value is kwargs.get(key, _MISSING):
                    continue
                if key in changed_by and not _same(out.get(key, _MISSING), value):
                    raise IncompatibleEnvironment(
                        f"patch units {changed_by[key]!r} and {unit!r} set {self.name}({key}=) differently")
                changed_by[key] = unit
                if value is _MISSING:
                    out.pop(key, None)
                else:
                    out[key] = value
        return out


@dataclass(frozen=True)
class ExecutorHooks:
    spawning: Callable[[tuple, dict], ContextManager[Any]] | None = None
    built: Callable[[Any, Any], None] | None = None
    methods: Mapping[str, Callable[[Any, Callable, tuple, dict], Any]] = field(default_factory=dict)
    ready: Callable[[Any], None] | None = None
    start: Callable[[Callable[[], Any]], Any] | None = None  # start(attempt) -> what attempt() returned


class BuiltExecutors:
    """The executors built through the hooked name, as one unit saw them built. speculators' later calls pass only
    the config (the KV helpers) or nothing (`torch.cuda.mem_get_info`), so the unit that needs the executor keeps
    this record itself, for as long as it is applied; weak, so a closed executor is not kept alive."""

    def __init__(self) -> None:
        self._by_config: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
        self._last: Any = None

    def hooks(self) -> "ExecutorHooks":
        return ExecutorHooks(built=lambda executor, _: self._add(executor))

    def _add(self, executor: Any) -> None:
        config = getattr(executor, "vllm_config", None)
        if config is not None:
            self._by_config[id(config)] = executor
        self._last = weakref.ref(executor)

    def for_config(self, vllm_config: Any) -> Any | None:
        return self._by_config.get(id(vllm_config))

    def last(self) -> Any | None:
        return self._last() if self._last is not None else None


class ExecutorAdapter(Adapter):
    def describe(self) -> dict[str, Any]:
        hooks = self.ordered()
        methods = sorted({m for _, h in hooks for m in h.methods})
        return {"target": self.name, "start": [u for u, h in hooks if h.start],
                "spawning": [u for u, h in hooks if h.spawning], "built": [u for u, h in hooks if h.built],
                "methods": {m: [u for u, h in hooks if m in h.methods] for m in methods},
                "ready": [u for u, h in hooks if h.ready]}

    def __call__(self, wrapped, instance, args, kwargs):
        hooks = self.ordered()

        def attempt() -> tuple[Any, dict[str, Any]]:
            with contextlib.ExitStack() as stack:
                spawned = {u: stack.enter_context(h.spawning(args, kwargs)) for u, h in hooks if h.spawning}
                return wrapped(*args, **kwargs), spawned

        for _, h in reversed(hooks):  # innermost first: the first unit name ends up outermost
            if h.start:
                attempt = functools.partial(h.start, attempt)
        executor, spawned = attempt()
        for unit, h in hooks:
            if h.built:
                h.built(executor, spawned.get(unit))
        for method in sorted({m for _, h in hooks for m in h.methods}):
            call = getattr(executor, method)
            for _, h in reversed(hooks):  # innermost first: the first unit name ends up outermost
                if method in h.methods:
                    call = _instance_method(executor, call, h.methods[method])
            setattr(executor, method, call)
        try:
            for _, h in hooks:
                if h.ready:
                    h.ready(executor)
        except BaseException:
            executor.shutdown()
            raise
        return executor


def instance_method_hook(obj: Any, method: str, hook: Callable[[Any, Callable, tuple, dict], Any]) -> None:
    """Put `hook(obj, call, args, kwargs)` on one object's `method` (that object only; its class is untouched)."""
    setattr(obj, method, _instance_method(obj, getattr(obj, method), hook))


def _instance_method(obj: Any, current: Callable, hook: Callable) -> Callable:
    def instance_method(*args, **kwargs):
        return hook(obj, current, args, kwargs)
    instance_method.__wrapped__ = current  # type: ignore[attr-defined]
    return instance_method


def adapter_of(obj: Any) -> Adapter | None:
    return getattr(obj, "_self_eagle_compat_adapter", None) if isinstance(obj, wrapt.FunctionWrapper) else None


def wrapped_by_us(obj: Any) -> bool:
    return isinstance(obj, wrapt.FunctionWrapper) and (
        getattr(obj, "_self_eagle_compat_adapter", None) is not None
        or getattr(obj, "_self_eagle_compat_unit", None) is not None)


def _same(a: Any, b: Any) -> bool:
    """Two units' values for one keyword agree (equal values from separate objects included)."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values disagree
        return False
