"""The set-up a carried GPU bundle runs on the lent machine (scripts/gpu_bundle_setup.sh, the body of every bundle's
setup.sh): a full bundle, and a delta (gpu_bundle.sh BASE=) that links its base's set-up in and replaces vLLM and the
wheels it carries. Runs on CPU with a fake bundle: a vllm.tgz and one small wheel."""
import base64
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP_BODY = os.path.join(ROOT, "scripts", "gpu_bundle_setup.sh")


def wheel(path: str, name: str, version: str) -> str:
    """A pure-Python wheel holding package `name` whose __init__ says its version."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(t.encode())}" for n, t in files.items()] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    out = os.path.join(path, f"{name}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(out, "w") as z:
        for n, t in files.items():
            z.writestr(n, t)
    return out


def bundle(tmp_path, vllm_version: str, wheels: list[tuple[str, str]], base_md5: str | None) -> str:
    """A bundle folder as gpu_bundle.sh writes it (parts, setup.sh, bundle.md5, [base.md5]), parts already carried."""
    work = tmp_path / f"build-{vllm_version}"
    (work / "whl").mkdir(parents=True)
    for name, version in wheels:
        wheel(str(work / "whl"), name, version)
    tgz = io.BytesIO()
    with tarfile.open(fileobj=tgz, mode="w:gz") as t:
        for n, text in {"vllm/__init__.py": f"__version__ = {vllm_version!r}\n",
                        f"vllm-{vllm_version}.dist-info/METADATA": f"Name: vllm\nVersion: {vllm_version}\n"}.items():
            info = tarfile.TarInfo(n)
            info.size = len(text.encode())
            t.addfile(info, io.BytesIO(text.encode()))
    (work / "vllm.tgz").write_bytes(tgz.getvalue())
    joined = tmp_path / "bundle.tar"
    with tarfile.open(joined, "w") as t:
        t.add(work / "vllm.tgz", "./vllm.tgz")
        t.add(work / "whl", "./whl")
    data = joined.read_bytes()
    out = tmp_path / f"bundle-{vllm_version}"
    out.mkdir()
    parts = tmp_path / "g"
    parts.mkdir(exist_ok=True)
    prefix = "delta" if base_md5 else "part"
    names = []
    for i in range(0, len(data), 4096):  # several parts, joined in order by setup.sh
        names.append(f"{prefix}{i // 4096:02d}")
        (parts / names[-1]).write_bytes(data[i:i + 4096])
    (out / "setup.sh").write_text(f'parts="{" ".join(names)}"\n' + open(SETUP_BODY).read())
    (out / "bundle.md5").write_text(hashlib.md5(data).hexdigest() + "\n")
    if base_md5:
        (out / "base.md5").write_text(base_md5 + "\n")
    return str(out)


def set_up(tmp_path, bundle_dir: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPU_PARTS": str(tmp_path / "g"), "GPU_SITE": str(tmp_path / "site"),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}  # this env's python3 and pip
    return subprocess.run(["bash", os.path.join(bundle_dir, "setup.sh")], env=env, capture_output=True, text=True)


def read(path) -> str:
    with open(path) as f:
        return f.read()


def test_a_full_bundle_installs_vllm_and_its_wheels(tmp_path):
    done = set_up(tmp_path, bundle(tmp_path, "0.27.1", [("humming", "0.1.10")], None))
    assert done.returncode == 0 and "SETUP_OK" in done.stdout, done.stdout + done.stderr
    site = tmp_path / "site"
    assert "0.27.1" in read(site / "vllm" / "__init__.py")
    assert "0.1.10" in read(site / "humming" / "__init__.py")


def test_a_delta_refuses_a_machine_without_its_base_and_installs_nothing(tmp_path):
    done = set_up(tmp_path, bundle(tmp_path, "0.28.0", [("humming", "0.1.12")], base_md5="0" * 32))
    assert done.returncode != 0
    assert "set its base (bundle md5 " + "0" * 32 + ") up on this machine first" in done.stdout
    assert not (tmp_path / "site").exists()


def test_a_delta_links_its_base_in_replaces_vllm_and_its_wheels_and_leaves_the_base_as_it_was(tmp_path):
    previous = tmp_path / "site.previous"  # the base's set-up, as gpu_setup moves it aside
    for rel, text in {"torch/__init__.py": "TORCH = '2.13'\n", "vllm/__init__.py": "__version__ = '0.27.1'\n",
                      "vllm/only_in_0271.py": "\n", "vllm-0.27.1.dist-info/METADATA": "Version: 0.27.1\n",
                      "humming/__init__.py": "VERSION = '0.1.10'\n",
                      "humming-0.1.10.dist-info/METADATA": "Version: 0.1.10\n"}.items():
        (previous / rel).parent.mkdir(parents=True, exist_ok=True)
        (previous / rel).write_text(text)
    (previous / ".bundle-md5").write_text("b" * 32 + "\n")
    done = set_up(tmp_path, bundle(tmp_path, "0.28.0", [("humming", "0.1.12")], base_md5="b" * 32))
    assert done.returncode == 0 and "SETUP_OK" in done.stdout, done.stdout + done.stderr
    site = tmp_path / "site"
    assert os.path.samefile(site / "torch" / "__init__.py", previous / "torch" / "__init__.py")  # linked, not copied
    assert "0.28.0" in read(site / "vllm" / "__init__.py")
    assert not (site / "vllm" / "only_in_0271.py").exists()  # the old vLLM is gone, not overlaid
    assert sorted(p.name for p in site.iterdir() if p.name.endswith(".dist-info")) == [
        "humming-0.1.12.dist-info", "vllm-0.28.0.dist-info"]
    assert "0.1.12" in read(site / "humming" / "__init__.py")
    assert not (site / ".bundle-md5").exists()  # gpu_setup writes the delta's own
    # the base is untouched: a failed delta set-up puts it back
    assert "0.27.1" in read(previous / "vllm" / "__init__.py") and (previous / "vllm" / "only_in_0271.py").exists()
    assert "0.1.10" in read(previous / "humming" / "__init__.py")
    assert read(previous / ".bundle-md5").startswith("b" * 32)


def test_a_part_that_does_not_match_the_bundle_s_md5_stops_the_set_up(tmp_path):
    out = bundle(tmp_path, "0.27.1", [("humming", "0.1.10")], None)
    with open(tmp_path / "g" / "part00", "r+b") as f:
        f.write(b"X")
    done = set_up(tmp_path, out)
    assert done.returncode != 0 and "bundle.tar: FAILED" in done.stdout
    assert not (tmp_path / "g" / "b").exists() and not (tmp_path / "site").exists()  # nothing was unpacked
