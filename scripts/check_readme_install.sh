#!/usr/bin/env bash
# The README's documented install, exactly as a user types it, in a fresh virtual environment; then `doctor` must
# find nothing wrong. Run by .ci/run (pip's cache from the test environments makes it quick).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PYTHONPYCACHEPREFIX="$work/pycache"  # this throw-away environment's bytecode goes with it
python3 -m venv "$work/venv"
source "$work/venv/bin/activate"
# --- the README's commands, verbatim ---
pip install -q -e ".[cpu]"
eagle-compat doctor --fix
# ---
eagle-compat doctor > "$work/doctor.txt" || { cat "$work/doctor.txt"; echo "README install: doctor found problems"; exit 1; }
tail -1 "$work/doctor.txt"
echo "README install: ok"
