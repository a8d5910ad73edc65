#!/usr/bin/env bash
# On the lent H200 (device tool), in the call that carries the bundle's last part (shared/notes/gpu-vllm-recipe.md):
# sets vLLM 0.20.0 up (once per machine), then runs the issue-12 measurements, each writing to $OUT as it ends:
#   llama8b-256x1024   benchmarks/throughput.py, 8B-shaped Llama (dummy weights), 256 x 1024, 8 prompts per batch
#                      (extract's default batch size): plain, delivered, written (local disk, fsynced),
#                      written_shm (the same writer into /dev/shm), native (+ native files compared with ours)
#   v2-parity          compat_matrix/cell.py batch_order under VLLM_USE_V2_MODEL_RUNNER=1 (llama, qwen3_moe):
#                      mixed-length batch == one at a time == pipelined, and == HF (fp32 on the same GPU)
#   llama8b-32x8192    the same benchmark, 32 x 8192 (2 prompts per batch)
#   moe-256x1024       Qwen3-30B-A3B-shaped MoE (dummy weights), 256 x 1024
# usage: [RUNS="llama8b-256x1024 v2-parity"] [SMOKE=1] bash scripts/gpu_throughput.sh
# SMOKE=1 runs every step with the tiny CPU models and tiny sizes (to test this script's logic on CPU).
# Needs, in the checkout the device tool copies: .gpu/ from `bash ../shared/tools/gpu_bundle.sh .gpu` plus
# .gpu/extra/ with the wheels the image lacks for eagle_compat itself (wrapt):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .gpu/extra "wrapt>=1.16"
# Calls (back to back; the machine goes back 30 s after a call): carry .gpu/part00, .gpu/part01, .gpu/part02 one
# per call (`mkdir -p /tmp/g && cp .gpu/partNN /tmp/g/`), then carry .gpu/part03 .gpu/setup.sh .gpu/bundle.md5
# .gpu/extra and run `cp .gpu/part03 /tmp/g/ && RUNS="llama8b-256x1024 v2-parity llama8b-32x8192" bash
# scripts/gpu_throughput.sh` (~10 min), then `RUNS=moe-256x1024 bash scripts/gpu_throughput.sh` (set-up kept).
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
started=$(date +%s)
say() { echo "[$(( $(date +%s) - started ))s] $*" | tee -a "$out/steps.log"; }
if [ -z "${SMOKE:-}" ]; then
  source scripts/gpu_setup.sh
  gpu_setup || exit 1
  python3 -c "import wrapt" 2>/dev/null || say "wrapt missing: see .gpu/extra above"
  say "setup done"
  export EAGLE_COMPAT_TINY_MODELS=/tmp/tiny
  PY=python3
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
    nproc; free -g; df -h /tmp /dev/shm; } > "$out/machine.txt" 2>&1
  big="--model llama-8b-dummy --gmu 0.85"; moe="--model qwen3-30b-a3b-dummy --gmu 0.85"
  n1=256; t1=1024; n2=32; t2=8192; dev=cuda
else
  PY=${PY:-python3}; export PYTHONPATH=$PWD/src
  big="--model tiny-llama --gmu 0.3"; moe="--model tiny-llama --gmu 0.3"
  n1=16; t1=128; n2=4; t2=512; dev=cpu
fi
mkdir -p /tmp/bench
phases=${PHASES:-plain,delivered,written,written_shm,native}
bench() {  # name timeout args...
  local name=$1 limit=$2; shift 2
  say "start $name"
  timeout "$limit" $PY benchmarks/throughput.py "$@" --write-dir /tmp/bench --out "$out/$name.json" \
    > "$out/$name.log" 2>&1
  say "end $name rc=$? $(grep -h 'over\|/ plain\|native files' "$out/$name.log" | tr '\n' ' ')"
  tail -c 100000 "$out/$name.log" > "$out/$name.log.tail" && mv "$out/$name.log.tail" "$out/$name.log"
}
for run in ${RUNS:-llama8b-256x1024 v2-parity llama8b-32x8192 moe-256x1024}; do
  case $run in
    llama8b-256x1024) bench "$run" 420 $big --prompts $n1 --tokens $t1 --batch 8 --phases $phases ;;
    llama8b-32x8192) bench "$run" 420 $big --prompts $n2 --tokens $t2 --batch 2 --batch-tokens $t2 --phases $phases ;;
    moe-256x1024) bench "$run" 480 $moe --prompts $n1 --tokens $t1 --batch 8 ;;
    v2-parity)
      for fam in llama qwen3_moe; do
        say "start v2-parity $fam"
        VLLM_USE_V2_MODEL_RUNNER=1 timeout 240 $PY compat_matrix/cell.py batch_order $fam --dtype auto \
          --device $dev > "/tmp/cell-$fam.log" 2>&1
        grep '^EAGLE_COMPAT_CELL ' "/tmp/cell-$fam.log" | sed 's/^EAGLE_COMPAT_CELL //' >> "$out/v2_parity.jsonl"
        grep -q '^EAGLE_COMPAT_CELL ' "/tmp/cell-$fam.log" || tail -c 20000 "/tmp/cell-$fam.log" > "$out/v2-$fam.err"
        say "end v2-parity $fam $(grep -o '"status": "[a-z]*"' "/tmp/cell-$fam.log" | tail -1) $(grep -o '"model_runner": "[^"]*"' "/tmp/cell-$fam.log" | tail -1)"
      done ;;
    *) say "unknown run $run" ;;
  esac
done
say "all done"
