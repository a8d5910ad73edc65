"""How a carried GPU bundle is set up on the offline GPU machine, run on CPU with fake bundles (a vllm.tgz and small
wheels): scripts/gpu_bundle_setup.sh (the body of every bundle's setup.sh) for a full bundle and a delta (gpu_bundle.sh
BASE=), and scripts/gpu_setup.sh's gpu_setup, which keeps each set-up when another bundle is set up in its place."""
import base64
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP_BODY = os.path.join(ROOT, "scripts", "gpu_bundle_setup.sh")


def wheel(folder, dist: str, version: str, package: str) -> None:
    """A pure-Python wheel of distribution `dist` holding package `package`, whose __init__ says its version."""
    info = f"{dist}-{version}.dist-info"
    files = {f"{package}/__init__.py": f"VERSION = {version!r}\n",
             f"{package}/only_in_{version.replace('.', '_')}.py": "\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(t.encode())}" for n, t in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = "\n".join(record) + "\n"
    with zipfile.ZipFile(os.path.join(folder, f"{dist}-{version}-py3-none-any.whl"), "w") as z:
        for n, t in files.items():
            z.writestr(n, t)


def bundle(tmp_path, name: str, vllm_version: str, wheels, base_md5: str | None = None, extra=()) -> str:
    """A bundle folder as gpu_bundle.sh writes it (setup.sh, bundle.md5; its parts already carried to GPU_PARTS)."""
    work = tmp_path / f"build-{name}"
    (work / "whl").mkdir(parents=True)
    for dist, version, package in wheels:
        wheel(str(work / "whl"), dist, version, package)
    tgz = io.BytesIO()
    with tarfile.open(fileobj=tgz, mode="w:gz") as t:
        for n, text in {"vllm/__init__.py": f"__version__ = {vllm_version!r}\n",
                        f"vllm/only_in_{vllm_version.replace('.', '_')}.py": "\n",
                        f"vllm-{vllm_version}.dist-info/METADATA": f"Name: vllm\nVersion: {vllm_version}\n"}.items():
            item = tarfile.TarInfo(n)
            item.size = len(text.encode())
            t.addfile(item, io.BytesIO(text.encode()))
    (work / "vllm.tgz").write_bytes(tgz.getvalue())
    joined = work / "bundle.tar"
    with tarfile.open(joined, "w") as t:
        t.add(work / "vllm.tgz", "./vllm.tgz")
        t.add(work / "whl", "./whl")
    data = joined.read_bytes()
    out = tmp_path / name
    (out / "extra").mkdir(parents=True)
    for dist, version, package in extra:
        wheel(str(out / "extra"), dist, version, package)
    parts = tmp_path / "g"
    parts.mkdir(exist_ok=True)
    prefix = f"delta-{vllm_version}-" if base_md5 else "part"  # as gpu_bundle.sh names them
    names = []
    for i in range(0, len(data), 4096):  # several parts, joined in order by setup.sh
        names.append(f"{prefix}{i // 4096:02d}")
        (parts / names[-1]).write_bytes(data[i:i + 4096])
    head = f'parts="{" ".join(names)}"\n' + (f'base="{base_md5}"\n' if base_md5 else "")
    (out / "setup.sh").write_text(head + open(SETUP_BODY).read())
    (out / "bundle.md5").write_text(hashlib.md5(data).hexdigest() + "\n")
    return str(out)


def md5_of(bundle_dir: str) -> str:
    return open(os.path.join(bundle_dir, "bundle.md5")).read().strip()


def env(tmp_path) -> dict:
    # its own bytecode cache: the set-up moves whole site folders to and from one path, and these tests' sources of
    # one size and mtime 0 would meet a shared cache's entries for that path
    return {**os.environ, "GPU_PARTS": str(tmp_path / "g"), "GPU_SITE": str(tmp_path / "site"),
            "GPU_SITES": str(tmp_path / "sites"), "LC_ALL": "C", "PYTHONPYCACHEPREFIX": str(tmp_path / "pycache"),
            "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}  # this env's python3 and pip


def set_up(tmp_path, bundle_dir: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", os.path.join(bundle_dir, "setup.sh")], env=env(tmp_path), capture_output=True,
                          text=True)


def gpu_setup(tmp_path, bundle_dir: str) -> subprocess.CompletedProcess:
    """scripts/gpu_setup.sh's gpu_setup as gpu_parity.sh calls it, then its log."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    script = (f'out={out}; source scripts/gpu_setup.sh; BUNDLE={bundle_dir} gpu_setup; rc=$?; cat {out}/setup.log; '
              f'exit $rc')
    return subprocess.run(["bash", "-c", script], cwd=ROOT, env=env(tmp_path), capture_output=True, text=True)


def read(path) -> str:
    with open(path) as f:
        return f.read()


def base_set_up(tmp_path, md5: str):
    """A base bundle's set-up as gpu_setup keeps it: torch, a vLLM, a wheel in an older version, a shared folder."""
    kept = tmp_path / "sites" / md5
    for rel, text in {"torch/__init__.py": "TORCH = '2.13'\n", "vllm/__init__.py": "__version__ = '0.27.1'\n",
                      "vllm/only_in_0271.py": "\n", "vllm-0.27.1.dist-info/METADATA": "Version: 0.27.1\n",
                      "humming/__init__.py": "VERSION = '0.1.10'\n", "humming/only_in_0_1_10.py": "\n",
                      "Humming_Kernels-0.1.10.dist-info/METADATA": "Version: 0.1.10\n",
                      "Humming_Kernels-0.1.10.dist-info/RECORD":
                          "humming/__init__.py,,\nhumming/only_in_0_1_10.py,,\n../outside.py,,\n",
                      "nvidia/cudnn/lib.so": "cudnn\n"}.items():
        (kept / rel).parent.mkdir(parents=True, exist_ok=True)
        (kept / rel).write_text(text)
    (kept / ".bundle-md5").write_text(md5 + "\n")
    return kept


def test_a_full_bundle_installs_vllm_and_its_wheels(tmp_path):
    done = set_up(tmp_path, bundle(tmp_path, "b27", "0.27.1", [("humming_kernels", "0.1.10", "humming")]))
    assert done.returncode == 0 and "SETUP_OK" in done.stdout, done.stdout + done.stderr
    site = tmp_path / "site"
    assert "0.27.1" in read(site / "vllm" / "__init__.py")
    assert "0.1.10" in read(site / "humming" / "__init__.py")
    assert not (tmp_path / "site.new").exists()


def test_a_delta_refuses_a_machine_without_its_base_and_installs_nothing(tmp_path):
    done = set_up(tmp_path, bundle(tmp_path, "d28", "0.28.0", [("humming_kernels", "0.1.12", "humming")],
                                   base_md5="0" * 32))
    assert done.returncode != 0
    assert "set its base (bundle md5 " + "0" * 32 + ") up on this machine first" in done.stdout
    assert not (tmp_path / "site").exists() and not (tmp_path / "site.new").exists()


def test_a_delta_links_its_base_in_replaces_vllm_and_its_wheels_and_leaves_the_base_as_it_was(tmp_path):
    kept = base_set_up(tmp_path, "b" * 32)
    (tmp_path / "outside.py").write_text("not the set-up's\n")
    done = set_up(tmp_path, bundle(tmp_path, "d28", "0.28.0", [("humming_kernels", "0.1.12", "humming")],
                                   base_md5="b" * 32))
    assert done.returncode == 0 and "SETUP_OK" in done.stdout, done.stdout + done.stderr
    site = tmp_path / "site"
    assert os.path.samefile(site / "torch" / "__init__.py", kept / "torch" / "__init__.py")  # linked, not copied
    assert "0.28.0" in read(site / "vllm" / "__init__.py")
    assert not (site / "vllm" / "only_in_0271.py").exists()  # the old vLLM is gone, not overlaid
    # the older wheel's files and its dist-info go, whatever its name's case and separators
    assert sorted(p.name for p in site.iterdir() if p.name.endswith(".dist-info")) == [
        "humming_kernels-0.1.12.dist-info", "vllm-0.28.0.dist-info"]
    assert "0.1.12" in read(site / "humming" / "__init__.py") and not (site / "humming" / "only_in_0_1_10.py").exists()
    assert read(site / "nvidia" / "cudnn" / "lib.so") == "cudnn\n"  # a folder shared with the wheel's is kept
    assert (tmp_path / "outside.py").exists()  # a RECORD path out of the set-up is not followed
    assert not (site / ".bundle-md5").exists()  # gpu_setup writes the delta's own
    # the kept base is untouched, and stays usable for another delta
    assert "0.27.1" in read(kept / "vllm" / "__init__.py") and (kept / "vllm" / "only_in_0271.py").exists()
    assert "0.1.10" in read(kept / "humming" / "__init__.py") and (kept / "humming" / "only_in_0_1_10.py").exists()
    assert (kept / "Humming_Kernels-0.1.10.dist-info").exists() and read(kept / ".bundle-md5").startswith("b" * 32)


def test_a_delta_whose_base_has_every_wheel_installs_vllm_only(tmp_path):
    base_set_up(tmp_path, "b" * 32)
    done = set_up(tmp_path, bundle(tmp_path, "d28", "0.28.1", [], base_md5="b" * 32))
    assert done.returncode == 0 and "SETUP_OK" in done.stdout, done.stdout + done.stderr
    assert "0.28.1" in read(tmp_path / "site" / "vllm" / "__init__.py")
    assert "0.1.10" in read(tmp_path / "site" / "humming" / "__init__.py")


def test_parts_are_taken_from_the_bundle_s_own_folder_before_the_shared_parts_folder(tmp_path):
    """On the device each carried part stays in its bundle's folder; the shared parts folder may hold another
    release's part of the same name (every full bundle names its parts part00...), and the last part's carry call
    copied nothing there (the first set-ups that expected it there stopped at "cat: part03: No such file or
    directory")."""
    out = bundle(tmp_path, "b27", "0.27.1", [("humming_kernels", "0.1.10", "humming")])
    os.rename(tmp_path / "g" / "part00", os.path.join(out, "part00"))  # carried, not copied to the parts folder
    last = sorted(p.name for p in (tmp_path / "g").iterdir())[-1]
    os.rename(tmp_path / "g" / last, os.path.join(out, last))
    (tmp_path / "g" / last).write_bytes(b"another release's part of the same name")
    done = set_up(tmp_path, out)
    assert done.returncode == 0 and "SETUP_OK" in done.stdout, done.stdout + done.stderr
    os.remove(os.path.join(out, "part00"))  # in neither folder: the set-up names it
    shutil.rmtree(tmp_path / "site")
    done = set_up(tmp_path, out)
    assert done.returncode != 0 and "part part00 is in neither" in done.stderr


def test_a_part_that_does_not_match_the_bundle_s_md5_stops_the_set_up(tmp_path):
    out = bundle(tmp_path, "b27", "0.27.1", [("humming_kernels", "0.1.10", "humming")])
    with open(tmp_path / "g" / "part00", "r+b") as f:
        f.write(b"X")
    done = set_up(tmp_path, out)
    assert done.returncode != 0 and "bundle.tar: FAILED" in done.stdout
    assert not (tmp_path / "g" / "b").exists() and not (tmp_path / "site").exists()  # nothing was unpacked


def test_gpu_setup_keeps_each_set_up_so_a_machine_can_go_from_base_to_deltas_and_back(tmp_path):
    extra = [("wrapt", "2.5.2", "wrapt")]
    base = bundle(tmp_path, "b27", "0.27.1", [("humming_kernels", "0.1.10", "humming")], extra=extra)
    d28 = bundle(tmp_path, "d28", "0.28.0", [("humming_kernels", "0.1.12", "humming")], md5_of(base), extra)
    d29 = bundle(tmp_path, "d29", "0.29.0", [("humming_kernels", "0.1.12", "humming")], md5_of(base), extra)
    site, sites = tmp_path / "site", tmp_path / "sites"
    for bundle_dir, version in ((base, "0.27.1"), (d28, "0.28.0"), (d29, "0.29.0"), (base, "0.27.1")):
        done = gpu_setup(tmp_path, bundle_dir)
        assert done.returncode == 0, done.stdout + done.stderr
        assert version in read(site / "vllm" / "__init__.py") and read(site / ".bundle-md5").strip() == md5_of(
            bundle_dir)
        assert "2.5.2" in read(site / "wrapt" / "__init__.py")  # the extra wheels, in a delta's set-up too
        assert "eagle_compat.plugin:register" in read(site / "eagle_compat-0.1.0.dist-info" / "entry_points.txt")
    assert "set-up kept from an earlier call" in done.stdout  # the base came back by a move, not a set-up
    assert sorted(os.listdir(sites)) == sorted([md5_of(d28), md5_of(d29)])


def test_gpu_setup_removes_a_set_up_that_never_finished(tmp_path):
    base = bundle(tmp_path, "b27", "0.27.1", [("humming_kernels", "0.1.10", "humming")])
    half = tmp_path / "site" / "vllm"  # a call cut off after vLLM was unpacked: no .bundle-md5
    half.mkdir(parents=True)
    (half / "__init__.py").write_text("__version__ = 'half'\n")
    done = gpu_setup(tmp_path, base)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0.27.1" in read(tmp_path / "site" / "vllm" / "__init__.py")
    assert not (tmp_path / "sites").exists()  # not kept as if it were a set-up
