# Sourced by the scripts that run on the offline H200 machine: sets the carried vLLM bundle up once per machine
# (docs/adr/0037-gpu-bundles.md; built by scripts/gpu_bundle.sh RELEASE .gpu), installs .gpu/extra/*.whl (the
# wheels the image lacks: wrapt for eagle_compat; speculators 0.3.0 and what it imports), and makes eagle_compat an
# installed distribution, so vLLM's workers load its vllm.general_plugins entry point.
# Needs: $out (a folder for setup.log). Exports PYTHONPATH=$GPU_SITE:$PWD/src (GPU_SITE: /tmp/site; tests move it).
gpu_setup() {
  # one machine may run several bundles in turn, each known by its md5 (bundle.md5 is carried with setup.sh). The
  # set-up one is $site; switching keeps it whole under $sites/MD5 (a delta's set-up links its base from there, and
  # coming back to a kept one is a move, not a set-up). A set-up that never finished has no .bundle-md5: removed.
  local bundle_md5 site=${GPU_SITE:-/tmp/site} sites=${GPU_SITES:-/tmp/sites} current
  bundle_md5=$(cat "${BUNDLE:-.gpu}/bundle.md5" 2>/dev/null)
  if [ -z "$bundle_md5" ]; then
    echo "no ${BUNDLE:-.gpu}/bundle.md5: carry it with setup.sh (scripts/gpu_bundle.sh)"; return 1
  fi
  current=$(cat "$site/.bundle-md5" 2>/dev/null)
  if [ -d "$site" ] && [ "$current" != "$bundle_md5" ]; then
    if [ -n "$current" ]; then
      mkdir -p "$sites" && rm -rf "${sites:?}/$current" && mv "$site" "$sites/$current"
    else
      rm -rf "$site"
    fi
  fi
  if [ ! -d "$site" ] && [ -f "$sites/$bundle_md5/.bundle-md5" ]; then
    mv "$sites/$bundle_md5" "$site"
    echo "set-up kept from an earlier call on this machine" >> "$out/setup.log"
  fi
  if [ ! -f "$site/.bundle-md5" ]; then
    local setup_start=$(date +%s)
    if ! GPU_SITE=$site GPU_SITES=$sites bash "${BUNDLE:-.gpu}/setup.sh" > "$out/setup.log" 2>&1; then
      tail -20 "$out/setup.log"
      rm -rf "$site"
      return 1
    fi
    if ls "${BUNDLE:-.gpu}"/extra/*.whl > /dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --upgrade --target "$site" "${BUNDLE:-.gpu}"/extra/*.whl \
        >> "$out/setup.log" 2>&1
    fi
    # bytecode, as pip writes it when it installs vLLM: the bundle is unpacked without it, and the first import
    # after set-up compiled every module (most of the 78 s the first preflight took on a fresh machine)
    local compile_start=$(date +%s)
    python3 -m compileall -q -j 0 "$site" > /dev/null 2>&1 || true
    echo "compileall $(( $(date +%s) - compile_start )) s" >> "$out/setup.log"
    echo "$bundle_md5" > "$site/.bundle-md5"
    echo "set-up $(( $(date +%s) - setup_start )) s (join, check, unpack, install, compile)" >> "$out/setup.log"
  fi
  local d=$site/eagle_compat-0.1.0.dist-info
  rm -rf "$d" && mkdir -p "$d"  # new files: a delta's set-up shares its base's by hard link
  printf 'Metadata-Version: 2.1\nName: eagle-compat\nVersion: 0.1.0\n' > "$d/METADATA"
  printf '[vllm.general_plugins]\neagle_compat = eagle_compat.plugin:register\n' > "$d/entry_points.txt"
  # a site on PYTHONPATH has its .pth files ignored; the paths they add (nvidia-cutlass-dsl puts its `cutlass` in
  # nvidia_cutlass_dsl/dsl_packages by one, vLLM 0.34 imports it at every warm-up) are put beside it
  local pth_paths
  pth_paths=$(python3 -c "import site, sys; before = set(sys.path); site.addsitedir('$site')
print(':'.join(p for p in sys.path if p not in before and p != '$site'))" 2>/dev/null)
  export PYTHONPATH=$site${pth_paths:+:$pth_paths}:$PWD/src
  # and linked into the site itself: vLLM 0.34's workers did not see those paths (its kernel warm-up failed at
  # `import cutlass` in every engine where the driver imported it: results/gpu/attempts/h100-vllm-0.34.0-cutlass-path.*)
  local p entry
  for p in ${pth_paths//:/ }; do
    for entry in "$p"/*; do
      [ -e "$site/$(basename "$entry")" ] || ln -s "$entry" "$site/$(basename "$entry")"
    done
  done
}

# Kills what still holds the GPU before the next engine starts: a step cut off by `timeout` kills its python, but
# vLLM's engine-core process can outlive it and keep its memory (0.27.1: the throughput run's native
# engine, killed at the call's 280 s, left 120 GiB held, and the three cells after it failed at start-up for "Free
# memory ... less than desired GPU memory utilization": results/gpu/attempts/h200-vllm-0.27.1-leftover-engine.*).
free_gpu() {
  command -v nvidia-smi > /dev/null || return 0
  local pids
  pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ')
  [ -z "$pids" ] && return 0
  echo "free_gpu: killing leftover GPU processes $pids" | tee -a "$out/setup.log"
  kill -9 $pids 2>/dev/null
  sleep 3
}
