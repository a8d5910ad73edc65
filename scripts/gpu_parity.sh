#!/usr/bin/env bash
# On the lent H200 (device tool), after the vLLM 0.20.0 bundle's setup (shared/notes/gpu-vllm-recipe.md):
# the project's end-to-end parity cells (compat_matrix/cell.py) on the GPU, engine in bf16 (dtype auto), against
# HF transformers fp32 on the same GPU. Results: $OUT/gpu_parity.jsonl (+ errors.log, gpu.txt).
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/extra/*.whl
# eagle_compat as an installed distribution, so vLLM's workers load its vllm.general_plugins entry point
d=/tmp/site/eagle_compat-0.1.0.dist-info; mkdir -p $d
printf 'Metadata-Version: 2.1\nName: eagle-compat\nVersion: 0.1.0\n' > $d/METADATA
printf '[vllm.general_plugins]\neagle_compat = eagle_compat.plugin:register\n' > $d/entry_points.txt
export PYTHONPATH=/tmp/site:$PWD/src EAGLE_COMPAT_TINY_MODELS=/tmp/tiny
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt"
python3 -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" >> "$out/gpu.txt" 2>&1
for cell in ${CELLS:-generator:llama generator:qwen3_moe generator:deepseek_v3 shim:llama shim:qwen3_moe shim:deepseek_v3}; do
  start=$(date +%s)
  timeout 300 python3 compat_matrix/cell.py ${cell%%:*} ${cell##*:} --dtype auto --device cuda > /tmp/cell.log 2>&1
  if grep -q '^EAGLE_COMPAT_CELL ' /tmp/cell.log; then
    grep '^EAGLE_COMPAT_CELL ' /tmp/cell.log | sed 's/^EAGLE_COMPAT_CELL //' >> "$out/gpu_parity.jsonl"
  else
    { echo "== $cell (no result)"; tail -60 /tmp/cell.log; } >> "$out/errors.log"
  fi
  echo "$cell $(( $(date +%s) - start ))s $(grep -o '"status": "[a-z]*"' /tmp/cell.log | tail -1)"
done
