#!/usr/bin/env bash
# On the offline H200 machine, in the call that carries a bundle's last part or after it (scripts/gpu_bundle.sh,
# docs/adr/0037-gpu-bundles.md): sets the bundle's vLLM up once per machine (another bundle replaces it), then
# runs the project's end-to-end parity cells (compat_matrix/cell.py) on the GPU, engine in bf16 (dtype auto), against
# HF transformers fp32 on the same GPU.
#   CELLS="generator:llama shim:llama ..."   which cells (CHECK:MODEL; MODEL a tiny, real or quantized model); default
#                                            generator and shim for llama, qwen3_moe, deepseek_v3, kimi_k25
#   PREFLIGHT="qwen3-8b kimi-k25 ..."        then time --preflight on these (scripts/gpu_preflight.py)
#   CELL_TIMEOUT_S=400                       per cell; its log is $OUT/cell-CHECK-MODEL.log while it runs
#   PARALLEL=4                               cells at once on the one GPU (default 1). Safe because a cell's engine
#                                            takes its KV cache as a fraction of the memory free after its own load
#                                            (engine.kv_cache.kv_budget) and never runs vLLM's memory profiling, which
#                                            would count another cell's memory as its own
#   KEEP_CELL_LOGS=1                         keep a passing cell's log too (the device returns few files: 8 logs at
#                                            most came back, and then not gpu_parity.jsonl)
#   MOE_ENV="VLLM_USE_FLASHINFER_MOE_FP16=0" settings for the MoE models' cells only (cell.py --moe-env; a cell
#                                            records those in its RECORDED_ENV)
# Results: $OUT/gpu_parity.jsonl, $OUT/preflight.jsonl (+ errors.log, gpu.txt, setup.log).
# Needs a bundle (bash scripts/gpu_bundle.sh RELEASE DIR; BUNDLE=DIR, default .gpu) and DIR/extra/ with the wheels
# the image lacks: wrapt for eagle_compat, speculators 0.3.0 and what it imports (loguru, accelerate,
# pydantic-settings, python-dotenv, typer-slim, typer) for the shim cells.
# SMOKE=1 [PY=python3] runs this script's flow on CPU, without a GPU or a bundle (CI: tests/test_benchmark_smoke.py):
# each cell on the CPU with the stand-in engine of eagle_compat.testing (its verdict is not parity's: the stand-in's
# states are not the model's), default cells generator:llama; PREFLIGHT's checkpoints built and their commands
# printed (scripts/gpu_preflight.py --dry-run).
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
if [ -z "${SMOKE:-}" ]; then
  source scripts/gpu_setup.sh
  gpu_setup || exit 1
  export EAGLE_COMPAT_TINY_MODELS=/tmp/tiny
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt"
  python3 -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" >> "$out/gpu.txt" 2>&1
  py=python3; cell_py=python3; device=cuda; preflight_args=()
else
  py=${PY:-python3}; cell_py="$py -m eagle_compat.testing"; device=cpu
  preflight_args=(--dry-run --work "$out/config-only")
  export PYTHONPATH=$PWD/src
  free_gpu() { :; }
fi
# each cell's log is written under $OUT as it runs: a call cut off by the device budget still brings back how far
# the running cell got (vLLM 0.21.0's first cell came back with nothing from /tmp:
# results/gpu/attempts/h200-vllm-0.21.0-bundle-attempt2.machine.txt)
# default: the cells every release is checked with (each family, ours and speculators' under install()). vLLM 0.26+
# on Hopper refuses the CPU-sized tiny MLA models' head dims at engine start (results/gpu/attempts/
# h200-vllm-0.26.0-mla-dims.*): there the MLA families run their v_head_dim 128 variants (families.Tiny.gpu_variant)
release=$(cat "${BUNDLE:-.gpu}/release.txt" 2>/dev/null)
if [ -n "${SMOKE:-}" ]; then
  default_cells=generator:llama
elif [ -n "$release" ] && [ "$(printf '%s\n' 0.26 "$release" | sort -V | head -1)" = 0.26 ]; then
  # every model of the compatibility matrix, shim and generator, GPU-sized where it must be (families.gpu_matrix_checks)
  default_cells=$($py -c "from eagle_compat.capture.families import gpu_matrix_checks
print(' '.join(f'{c}:{m}' for c, m in gpu_matrix_checks()))")
else
  default_cells=$(for check in generator shim; do
    for m in llama qwen3_moe deepseek_v3 kimi_k25; do echo "$check:$m"; done; done)
fi
parallel=${PARALLEL:-1}
[ "$parallel" -le 1 ] || export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / parallel ))}
run_cell() {
  local cell=$1 start verdict log
  start=$(date +%s)
  log="$out/cell-${cell/:/-}.log"
  timeout "${CELL_TIMEOUT_S:-400}" $cell_py compat_matrix/cell.py ${cell%%:*} ${cell##*:} --dtype auto \
    --device $device --moe-env "${MOE_ENV:-}" > "$log" 2>&1
  if grep -q '^EAGLE_COMPAT_CELL ' "$log"; then
    # one writer at a time: a result line is longer than an atomic append
    { flock 9; grep '^EAGLE_COMPAT_CELL ' "$log" | sed 's/^EAGLE_COMPAT_CELL //' >> "$out/gpu_parity.jsonl"; } \
      9> "$out/.results.lock"
    verdict=$(grep '^EAGLE_COMPAT_CELL ' "$log" | grep -o '"status": "[a-z]*"' | tail -1)
    [ -n "${KEEP_CELL_LOGS:-}" ] || rm -f "$log"
  else
    verdict="no result (timeout ${CELL_TIMEOUT_S:-400} s)"  # this cell's own verdict, never an earlier cell's
    { flock 9; { echo "== $cell (no result after $(( $(date +%s) - start )) s)"; tail -60 "$log"; } >> "$out/errors.log"; } \
      9> "$out/.results.lock"
  fi
  echo "$cell $(( $(date +%s) - start ))s $verdict"
}
for cell in ${CELLS-$default_cells}; do
  if [ "$parallel" -le 1 ]; then
    free_gpu  # an earlier step's engine must not hold the memory this one needs
    run_cell "$cell"
  else
    while [ "$(jobs -rp | wc -l)" -ge "$parallel" ]; do wait -n; done
    run_cell "$cell" &
  fi
done
wait
rm -f "$out/.results.lock"
if [ -n "${PREFLIGHT:-}" ]; then
  timeout 500 $py scripts/gpu_preflight.py --device $device --only "$(echo $PREFLIGHT | tr ' ' ,)" --out "$out" \
    "${preflight_args[@]}" > "$out/preflight.log" 2>&1
  grep -E '^[a-z0-9_-]+: ok=' "$out/preflight.log"
fi
