"""The contract every patch unit follows, and the recorder that makes install() reversible.

A unit says what broke (one sentence), which vLLM releases are affected (a PEP 440 specifier, documentation
only), how the need is detected (feature detection, `needed()`), where it applies (the speculators module whose
names it rewraps; for a break speculators hits while importing, the module it imports from: transformers, or vLLM's
kv_cache_utils, which then answers speculators' modules only; or None for process-level state), how it applies
(through a `Patcher`, which records every change), and when it can be deleted. Reverting is generic: the Patcher
restores what it recorded.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

import wrapt

from . import _adapters
from ..errors import IncompatibleEnvironment

GENERATOR_MODULE = "speculators.data_generation.vllm_hidden_states_generator"
WORKER_MODULE = "speculators.data_generation.custom_worker"


@dataclass
class Change:
    owner: Any
    attribute: str
    original: Any
    replacement: Any
    existed: bool

    def revert(self, unit_name: str) -> list[str]:
        problems = []
        namespace = isinstance(self.owner, (type, ModuleType))
        current = vars(self.owner).get(self.attribute) if namespace else getattr(self.owner, self.attribute, None)
        if current is not self.replacement and (namespace or current != self.replacement):
            problems.append(f"{unit_name}: {_name(self.owner)}.{self.attribute} was replaced by someone else after "
                            "install(); restoring the original anyway")
        if self.existed:
            setattr(self.owner, self.attribute, self.original)
        else:
            try:
                delattr(self.owner, self.attribute)
            except AttributeError:
                pass
        return problems


@dataclass
class EnvironmentHold:
    """Variables set through `process_env.apply_env` (counted holds shared with the stable generator's engines, and
    listed for the start-up hook, which keeps them from processes that are not the run's); revert releases them."""
    keys: list[str]

    def revert(self, unit_name: str) -> list[str]:
        from .. import engine
        engine.process_env.release_env(self.keys)
        return []


@dataclass
class Contribution:
    """A unit's part in the one adapter of `owner.attribute`; the Change that installed the adapter is reverted
    with the last contribution, whichever unit withdraws it."""
    owner: Any
    attribute: str
    replacement: Any  # the adapter's wrapper

    def revert(self, unit_name: str) -> list[str]:
        adapter = _adapters.adapter_of(self.replacement)
        adapter.contributions.pop(unit_name, None)
        return [] if adapter.contributions else adapter.installed.revert(unit_name)


class MappingAttributes:
    """A mapping (sys.modules) seen through attributes, so a Patcher records and reverts its entries
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

    def hold_env(self, env: dict[str, str]) -> None:
        """Set the variables the user has not set, for as long as this unit is applied."""
        from .. import engine
        self.changes.append(EnvironmentHold(engine.process_env.apply_env(env)))

    def provide_module(self, name: str, module: ModuleType) -> None:
        """Make `import name` find `module` (for a module a newer dependency removed); revert removes it."""
        self.set(SYS_MODULES, name, module)

    def wrap(self, owner: Any, attribute: str, wrapper: Callable) -> None:
        """wrapt-style wrapper `(wrapped, instance, args, kwargs)` around `owner.attribute` (looked up where the
        caller looks it up: the speculators module namespace), for a name only this unit wraps; a name several
        units need takes contributions to its one adapter (`rewrite_kwargs`, `hook_built`, `hook_executor`)."""
        current = _current(owner, attribute)
        if _adapters.wrapped_by_us(current):
            raise IncompatibleEnvironment(f"{_name(owner)}.{attribute} is already wrapped by eagle_compat; a second "
                                          f"unit ({self.unit_name}) must contribute to its adapter instead")
        replacement = wrapt.FunctionWrapper(current, wrapper)
        # `_self_` attributes stay on the wrapt wrapper (others would be set on the wrapped vLLM object)
        replacement._self_eagle_compat_unit = self.unit_name  # type: ignore[attr-defined]
        self.set(owner, attribute, replacement)

    def rewrite_kwargs(self, owner: Any, attribute: str, rewrite: Callable[[dict], dict]) -> None:
        """Contribute a keyword rewrite to the call of `owner.attribute` (speculators calls these constructors with
        keywords only; rewriting by name, never by position). `rewrite` gets the caller's keywords and returns
        them changed; see `_adapters.ConstructorAdapter` for how several units' rewrites combine."""
        self._contribute(owner, attribute, _adapters.ConstructorAdapter, _adapters.ConstructorHooks(rewrite=rewrite))

    def hook_built(self, owner: Any, attribute: str, built: Callable[[Any], None]) -> None:
        """Contribute `built(obj)`, called on each object the call of `owner.attribute` builds (a constructor
        speculators calls), before speculators gets it: the way to change that one object's methods."""
        self._contribute(owner, attribute, _adapters.ConstructorAdapter, _adapters.ConstructorHooks(built=built))

    def hook_executor(self, owner: Any, factory: str, hooks: "_adapters.ExecutorHooks") -> None:
        """Contribute to each executor built through `owner.factory` (the MultiprocExecutor name in speculators'
        module): vLLM's class itself is untouched. Phases and order: `_adapters.ExecutorAdapter`."""
        self._contribute(owner, factory, _adapters.ExecutorAdapter, hooks)

    def _contribute(self, owner: Any, attribute: str, kind: type, contribution: Any) -> None:
        current = _current(owner, attribute)
        adapter = _adapters.adapter_of(current)
        if adapter is None:
            if _adapters.wrapped_by_us(current):
                raise IncompatibleEnvironment(f"{_name(owner)}.{attribute} is wrapped by eagle_compat unit "
                                              f"{current._self_eagle_compat_unit!r}, not by an adapter")
            adapter = kind(f"{_name(owner)}.{attribute}")
            wrapper = wrapt.FunctionWrapper(current, adapter)
            wrapper._self_eagle_compat_adapter = adapter  # type: ignore[attr-defined]
            self.set(owner, attribute, wrapper)
            adapter.installed = self.changes.pop()
        else:
            if not isinstance(adapter, kind) or self.unit_name in adapter.contributions:
                raise IncompatibleEnvironment(f"{self.unit_name}: cannot contribute to {adapter.name} twice or as "
                                              f"another kind ({type(adapter).__name__})")
            wrapper = current
        adapter.contributions[self.unit_name] = contribution
        self.changes.append(Contribution(owner, attribute, wrapper))

    def revert(self) -> list[str]:
        problems = []
        for change in reversed(self.changes):
            problems += change.revert(self.unit_name)
        self.changes.clear()
        return problems


def _current(owner: Any, attribute: str) -> Any:
    return vars(owner)[attribute] if isinstance(owner, (type, ModuleType)) else getattr(owner, attribute)


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
    # False for the units that patch transformers or speculators' trainer only: they apply where vLLM is not
    # installed too (a training environment), where every other unit has nothing to patch and cannot probe
    needs_vllm: bool = True
    # the named probe (detect.FEATURE_PROBES) that alone decides the need, where one does; otherwise `needed`
    feature: str = ""
    needed: Callable[[], bool] | None = None
    apply: Callable[[Patcher, ModuleType | None], None] = field(default=lambda p, m: None)

    def __post_init__(self) -> None:
        if self.feature and self.needed is not None:
            raise ValueError(f"patch unit {self.name}: give `feature` or `needed`, not both")
        feature, needs_vllm = self.feature, self.needs_vllm
        if feature:
            self.needed = lambda: _feature_says_needed(feature, needs_vllm)
        elif self.needed is None:
            self.needed = lambda: True


def _feature_says_needed(feature: str, needs_vllm: bool) -> bool:
    from .. import detect
    # the units that patch transformers or speculators alone have nothing to patch where speculators is absent
    return (needs_vllm or detect.installed_versions().speculators is not None) and bool(detect.feature(feature))


def executor_method_unit(*, method: str, hook: Callable, feature: str, **contract: Any) -> PatchUnit:
    """A unit whose whole fix is one stateless hook, `hook(executor, call, args, kwargs)`, on one method of the
    executor speculators' generator builds (vLLM's class is untouched: `Patcher.hook_executor`), needed where the
    named feature probe says so."""
    def apply(patcher: Patcher, module: ModuleType | None) -> None:
        patcher.hook_executor(module, "MultiprocExecutor", _adapters.ExecutorHooks(methods={method: hook}))

    return PatchUnit(target=GENERATOR_MODULE, sides=("driver",), feature=feature, apply=apply, **contract)


def keyword_rewrite_unit(*, constructor: str, feature: str, rewrite: Callable[..., Any], **contract: Any) -> PatchUnit:
    """A unit whose whole fix is the keywords of one constructor speculators' generator calls (`constructor`, e.g.
    "SchedulerConfig", "Request"): needed where the named feature probe says so, applied as a contribution to that
    name's one adapter (`Patcher.rewrite_kwargs`) by the engine function `rewrite` that the stable generator's own
    calls go through too."""
    def apply(patcher: Patcher, module: ModuleType | None) -> None:
        patcher.rewrite_kwargs(module, constructor, rewrite)

    return PatchUnit(target=GENERATOR_MODULE, sides=("driver",), feature=feature, apply=apply, **contract)


def worker_environment_unit(*, variable: str, **contract: Any) -> PatchUnit:
    """A unit whose whole fix is one variable that vLLM's workers inherit when speculators' engine spawns them: needed
    where `engine.process_env.default_worker_env` (what the stable generator's engines get) has it, held through
    `process_env.apply_env` (only where the user has not set it; counted with the stable generator's holds, and kept
    from processes that are not the run's), released by uninstall()."""
    def needed() -> bool:
        from .. import engine
        return variable in engine.process_env.default_worker_env()  # speculators always runs dtype="auto"

    def apply(patcher: Patcher, module: ModuleType | None) -> None:
        from .. import engine
        patcher.hold_env({variable: engine.process_env.default_worker_env()[variable]})

    return PatchUnit(target=None, needed=needed, apply=apply, **contract)
