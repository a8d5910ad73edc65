"""The contract every patch unit follows, and the recorder that makes install() reversible.

A unit says what broke (one sentence), which vLLM releases are affected (a PEP 440 specifier, documentation
only), how the need is detected (feature detection, `needed()`), where it applies (the speculators module whose
names it rewraps, or None for process-level state), how it applies (through a `Patcher`, which records every
change), and when it can be deleted. Reverting is generic: the Patcher restores what it recorded.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

import wrapt

GENERATOR_MODULE = "speculators.data_generation.vllm_hidden_states_generator"
WORKER_MODULE = "speculators.data_generation.custom_worker"


@dataclass
class Change:
    owner: Any
    attribute: str
    original: Any
    replacement: Any
    existed: bool


class MappingAttributes:
    """A mapping (sys.modules, os.environ) seen through attributes, so a Patcher records and reverts its entries
    like any attribute."""

    def __init__(self, mapping: Any, name: str):
        object.__setattr__(self, "_mapping", mapping)
        object.__setattr__(self, "__name__", name)

    def __getattr__(self, key: str) -> Any:
        try:
            return self._mapping[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key: str, value: Any) -> None:
        self._mapping[key] = value

    def __delattr__(self, key: str) -> None:
        self._mapping.pop(key, None)


SYS_MODULES = MappingAttributes(sys.modules, "sys.modules")


class Patcher:
    """Records (owner, attribute, original, replacement) for every change so it can be undone exactly."""

    def __init__(self, unit_name: str):
        self.unit_name = unit_name
        self.changes: list[Change] = []

    def set(self, owner: Any, attribute: str, replacement: Any) -> None:
        if isinstance(owner, (type, ModuleType)):  # look in the namespace itself, not through inheritance
            existed, original = attribute in vars(owner), vars(owner).get(attribute)
        else:
            existed, original = hasattr(owner, attribute), getattr(owner, attribute, None)
        setattr(owner, attribute, replacement)
        self.changes.append(Change(owner, attribute, original, replacement, existed))

    def provide_module(self, name: str, module: ModuleType) -> None:
        """Make `import name` find `module` (for a module a newer dependency removed); revert removes it."""
        self.set(SYS_MODULES, name, module)

    def wrap(self, owner: Any, attribute: str, wrapper: Callable) -> None:
        """wrapt-style wrapper `(wrapped, instance, args, kwargs)` around `owner.attribute` (looked up where the
        caller looks it up: the speculators module namespace)."""
        current = vars(owner)[attribute] if isinstance(owner, (type, ModuleType)) else getattr(owner, attribute)
        replacement = wrapt.FunctionWrapper(current, wrapper)
        # `_self_` attributes stay on the wrapt wrapper (others would be set on the wrapped vLLM object)
        replacement._self_eagle_compat_unit = self.unit_name  # type: ignore[attr-defined]
        self.set(owner, attribute, replacement)

    def rewrite_kwargs(self, owner: Any, attribute: str, rewrite: Callable[[dict], dict]) -> None:
        """Call `owner.attribute` with its keyword arguments passed through `rewrite` (speculators calls these
        constructors with keywords only; rewriting by name, never by position)."""
        self.wrap(owner, attribute, lambda wrapped, instance, args, kwargs: wrapped(*args, **rewrite(kwargs)))

    def wrap_instances(self, owner: Any, factory: str,
                       method_wrappers: dict[str, Callable[[Any, Callable, tuple, dict], Any]],
                       construct_within: Callable[[], Any] | None = None) -> None:
        """Wrap methods on each instance built through `owner.factory` (e.g. the MultiprocExecutor name in
        speculators' module): vLLM's class itself is untouched, so vLLM's own engine is unaffected.
        A wrapper gets (instance, the method as it was, args, kwargs). `construct_within` is a context-manager
        factory entered around the construction itself."""
        import contextlib

        from .. import engine

        def factory_wrapper(wrapped, instance, args, kwargs):
            with (construct_within or contextlib.nullcontext)():
                obj = wrapped(*args, **kwargs)
            engine.remember_executor(obj)
            for method, method_wrapper in method_wrappers.items():
                setattr(obj, method, _instance_method(obj, getattr(obj, method), method_wrapper))
            return obj
        self.wrap(owner, factory, factory_wrapper)

    def revert(self) -> list[str]:
        problems = []
        for change in reversed(self.changes):
            namespace = isinstance(change.owner, (type, ModuleType))
            current = vars(change.owner).get(change.attribute) if namespace else getattr(
                change.owner, change.attribute, None)
            if current is not change.replacement and (namespace or current != change.replacement):
                problems.append(f"{self.unit_name}: {_name(change.owner)}.{change.attribute} was replaced by "
                                "someone else after install(); restoring the original anyway")
            if change.existed:
                setattr(change.owner, change.attribute, change.original)
            else:
                try:
                    delattr(change.owner, change.attribute)
                except AttributeError:
                    pass
        self.changes.clear()
        return problems


def _instance_method(obj: Any, current: Callable, method_wrapper: Callable) -> Callable:
    def instance_method(*args, **kwargs):
        return method_wrapper(obj, current, args, kwargs)
    instance_method.__wrapped__ = current  # type: ignore[attr-defined]
    return instance_method


def _name(owner: Any) -> str:
    return getattr(owner, "__name__", type(owner).__name__)


@dataclass
class PatchUnit:
    name: str
    broke: str
    affects: str  # PEP 440 specifier over vLLM releases ("" = all); documentation, never a dispatch key
    delete_when: str
    target: str | None  # module whose namespace is patched (applied when it is imported), or None
    sides: tuple[str, ...] = ("driver", "worker")
    # what else decides the need, in words ("" = the vLLM release alone: then a test checks `needed()` against
    # `affects` on the installed release)
    condition: str = ""
    silent: bool = False  # True where the break gives wrong results with no error
    # True where the break shows while a process imports speculators, i.e. possibly before install() can run in
    # it: a spawned child re-imports its parent's __main__ script first. The start-up hook applies these units
    # (only these) in every process of a run (see eagle_compat.startup).
    at_startup: bool = False
    needed: Callable[[], bool] = field(default=lambda: True)
    apply: Callable[[Patcher, ModuleType | None], None] = field(default=lambda p, m: None)

    def module(self) -> ModuleType | None:
        return sys.modules.get(self.target) if self.target else None
