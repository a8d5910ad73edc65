"""speculators 0.3.0 fails at import on vLLM 0.33: the KV-cache planning helpers it imports moved.

`speculators/data_generation/vllm_hidden_states_generator.py` does `from vllm.v1.core.kv_cache_utils import
_get_kv_cache_groups_uniform_spec, get_kv_cache_config_from_groups, unify_hybrid_kv_cache_specs`; vLLM 0.33 moved
them, unchanged in signature, with the rest of KV-cache planning to `vllm.v1.core.kv_cache_planning`, so the import
raises ImportError (on the H200, install()'s import check refused, naming the three:
results/gpu/attempts/h200-vllm-0.33.0-first.jsonl; the ImportError itself: tests/test_kv_planning_move.py). Applied when
kv_cache_utils is imported, in every process of a run (a spawned worker re-imports a script that imports
speculators): the module answers those three names (PEP 562 `__getattr__`) to speculators' own modules only, from
where vLLM now defines them; any other caller sees the module as vLLM made it.
"""
from __future__ import annotations

import sys
from types import ModuleType

from .. import detect
from ..detect import KV_UTILS_MODULE
from ._base import PatchUnit

MOVED_NAMES = ("_get_kv_cache_groups_uniform_spec", "get_kv_cache_config_from_groups", "unify_hybrid_kv_cache_specs")


def serves(module_name: str, name: str) -> bool:
    """True where this unit makes `from module_name import name` work for speculators (installer's import check)."""
    return (module_name == KV_UTILS_MODULE and name in MOVED_NAMES and detect.feature("kv_helpers_moved_to_planning")
            and hasattr(detect.kv_planning_module(), name))


def _asked_by_speculators(frame_globals: dict) -> bool:
    caller = frame_globals.get("__name__") or ""
    return caller == "speculators" or caller.startswith("speculators.")


def _apply(patcher, module: ModuleType) -> None:
    previous = vars(module).get("__getattr__")

    def __getattr__(name: str):
        # `from m import n` and getattr(m, n) call this from C, so the frame below is the one that asked
        if name in MOVED_NAMES and _asked_by_speculators(sys._getframe(1).f_globals):
            return getattr(detect.kv_planning_module(), name)
        if previous is not None:
            return previous(name)
        raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")

    patcher.set(module, "__getattr__", __getattr__)


UNIT = PatchUnit(
    name="kv_planning_helpers_moved",
    broke="speculators 0.3.0 fails at import: vLLM 0.33 moved three KV-cache planning helpers it imports from "
          "kv_cache_utils to kv_cache_planning",
    affects=">=0.33",
    delete_when="the speculators floor imports the KV-cache planning helpers from where vLLM defines them",
    target=KV_UTILS_MODULE,
    at_startup=True,
    feature="kv_helpers_moved_to_planning",
    apply=_apply,
)
