#!/usr/bin/env bash
# On the offline H200 machine, in the call that carries the bundle's last part or after it
# (docs/adr/0037-gpu-bundles.md): sets the bundle's vLLM up (once per machine, scripts/gpu_setup.sh), then runs the
# throughput measurements (docs/adr/0038-throughput-reporting.md), each writing to $OUT as it ends:
#   llama8b-256x1024   benchmarks/throughput.py, 8B-shaped Llama (dummy weights), 256 x 1024, 8 prompts per batch
#                      (extract's default batch size): plain, disk (the same writer with no engine: what this
#                      machine's disk takes; no GPU, seconds, so second: a cut-off run keeps it), delivered,
#                      written (local disk, fsynced), written_shm (the same writer into /dev/shm), native (+ native
#                      files compared with ours)
#   v2-parity          compat_matrix/cell.py batch_order under VLLM_USE_V2_MODEL_RUNNER=1 (llama, qwen3_moe):
#                      mixed-length batch == one at a time == pipelined, and == HF (fp32 on the same GPU)
#   llama8b-32x8192    the same benchmark, 32 x 8192 (2 prompts per batch)
#   moe-256x1024       Qwen3-30B-A3B-shaped MoE (dummy weights), 256 x 1024
# usage: [BUNDLE=.gpu25] [RUNS="llama8b-256x1024 v2-parity"] [PHASES=plain,delivered,written,native]
#        [MOE_ENV="VLLM_USE_FLASHINFER_MOE_FP16=0"] [SMOKE=1] bash scripts/gpu_throughput.sh
# SMOKE=1 runs every step with the tiny CPU models and tiny sizes (to test this script's logic on CPU).
# Needs a bundle (bash scripts/gpu_bundle.sh RELEASE DIR) with DIR/extra holding the wheels the image lacks (wrapt;
# speculators 0.3.0 and what it imports), carried as scripts/gpu_bundle.sh says: its parts one per call (set-up
# joins them from DIR, where the device keeps them), then the last part with DIR/setup.sh, DIR/bundle.md5, DIR/extra.
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
  free_gpu() { :; }
  big="--model tiny-llama --gmu 0.3"; moe="--model tiny-llama --gmu 0.3"
  n1=16; t1=128; n2=4; t2=512; dev=cpu
fi
mkdir -p /tmp/bench
phases=${PHASES:-plain,disk,delivered,written,written_shm,native}
bench() {  # name timeout args...
  local name=$1 limit=$2; shift 2
  free_gpu  # an earlier step's engine must not hold the memory this one needs
  say "start $name"
  timeout "$limit" $PY benchmarks/throughput.py "$@" --write-dir /tmp/bench --out "$out/$name.json" \
    > "$out/$name.log" 2>&1
  say "end $name rc=$? $(grep -h 'over\|/ plain\|native files' "$out/$name.log" | tr '\n' ' ')"
  for f in "$out/$name.log" "$out/$name".json.*.log; do  # the run's log and each phase's (benchmarks/throughput.py)
    [ -f "$f" ] && tail -c 100000 "$f" > "$f.tail" && mv "$f.tail" "$f"
  done
}
for run in ${RUNS:-llama8b-256x1024 v2-parity llama8b-32x8192 moe-256x1024}; do
  case $run in
    llama8b-256x1024) bench "$run" 420 $big --prompts $n1 --tokens $t1 --batch 8 --phases $phases ;;
    llama8b-32x8192) bench "$run" 420 $big --prompts $n2 --tokens $t2 --batch 2 --batch-tokens $t2 --phases $phases ;;
    moe-256x1024) ( [ -z "${MOE_ENV:-}" ] || export ${MOE_ENV:-}; bench "$run" 480 $moe --prompts $n1 --tokens $t1 \
                    --batch 8 ) ;;
    v2-parity)
      for fam in llama qwen3_moe; do
        free_gpu
        say "start v2-parity $fam"
        VLLM_USE_V2_MODEL_RUNNER=1 timeout 240 $PY compat_matrix/cell.py batch_order $fam --dtype auto \
          --device $dev --moe-env "${MOE_ENV:-}" > "/tmp/cell-$fam.log" 2>&1
        grep '^EAGLE_COMPAT_CELL ' "/tmp/cell-$fam.log" | sed 's/^EAGLE_COMPAT_CELL //' >> "$out/v2_parity.jsonl"
        grep -q '^EAGLE_COMPAT_CELL ' "/tmp/cell-$fam.log" || tail -c 20000 "/tmp/cell-$fam.log" > "$out/v2-$fam.err"
        say "end v2-parity $fam $(grep -o '"status": "[a-z]*"' "/tmp/cell-$fam.log" | tail -1) $(grep -o '"model_runner": "[^"]*"' "/tmp/cell-$fam.log" | tail -1)"
      done ;;
    *) say "unknown run $run" ;;
  esac
done
say "all done"
