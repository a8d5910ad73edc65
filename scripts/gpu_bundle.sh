#!/usr/bin/env bash
# Builds a bundle that puts a CUDA vLLM release and the Python packages it needs onto an offline H200 machine (no
# network there), in parts small enough to carry (64 MiB a call). Parameterized by release; the package pins are
# the ones measured for vLLM 0.20.0 on that image (torch 2.11.0+cu130, transformers 5.17: docs/adr/0037-gpu-bundles.md,
# docs/gpu-parity.md). A release whose wheel asks for other requirements than 0.20.0's is refused, naming each
# difference (measured from the wheel's own metadata): its pins must be measured before it can be carried.
# usage: [BASE=DIR] bash scripts/gpu_bundle.sh RELEASE OUTDIR      (OUTDIR ignored by git, e.g. .gpu)
# BASE=DIR builds a delta over bundle DIR (a release on the same torch): only what DIR lacks, set up on a machine where
# DIR's bundle was set up before (scripts/gpu_setup.sh keeps each set-up; the delta's parts are named delta*).
# Then, one call each, within 30 s of the previous call's end (the machine goes back when idle):
#   run carry [OUTDIR/part00]: true   ... the same for each part (64 MiB a call: one part each; the device keeps
#   each carried part in OUTDIR between calls, where setup.sh joins them from, else from /tmp/g) ...
#   last part with OUTDIR/setup.sh, OUTDIR/bundle.md5, OUTDIR/release.txt, OUTDIR/extra:
#   BUNDLE=OUTDIR CELLS=... bash scripts/gpu_parity.sh
#   (gpu_parity.sh runs setup.sh once per machine; OUTDIR/extra holds wrapt and speculators 0.3.0's wheels)
# SMOKE=1 records the build in OUTDIR/bundle-builds.md instead of the project's table (CI runs the script with a
# stand-in for pip on PATH, offline: tests/test_benchmark_smoke.py).
set -euo pipefail
release=${1:?usage: gpu_bundle.sh RELEASE OUTDIR}
out=${2:?usage: gpu_bundle.sh RELEASE OUTDIR}
mkdir -p "$out"; out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# every manylinux tag the image's glibc takes (NCCL's wheels are manylinux_2_18 only, llguidance's 2_31)
plat="--only-binary=:all: --python-version 3.12 --implementation cp $(for m in $(seq 35 -1 17); do
  echo --platform manylinux_2_${m}_x86_64; done) --platform manylinux2014_x86_64"
# the requirements of the release the pins below were measured with, and the release asked for
for want in ref:0.20.0 want:$release; do
  pip install -q --dry-run --ignore-installed --no-deps --target "$work/x" $plat --report "$work/${want%%:*}.json" \
    "vllm==${want#*:}"
done
# Per-release pins over 0.20.0's, from what the release's wheel adds (compat_matrix/results/gpu/carry-probe.md):
# a release listed here is built with them; its other added requirements are imported lazily by vLLM (the API
# server, Blackwell-only MLA kernels), as 0.20.0's own unpinned ones were (nvidia-cutlass-dsl,
# model-hosting-container-standards), and the run on the H200 shows whether that holds.
# each case from 0.26.0 on adds these (see 0.26.0); a later release needs its own case, as every one has
mistral_tokenizer_needs="attrs==26.1.0 pydantic_extra_types==2.11.1 pycountry==26.2.16"
# and from 0.25.1 the engine's LLM() imports openai's NamespaceTool (tool_parsers/utils.py, through
# log_non_default_args), which openai has from 2.25.0 although vLLM asks only >=2.0.0; with 0.20.0's 2.8.0 plain
# LLM() fails at import (measured on the H200 with 0.27.1 and 0.25.1: benchmarks/results/
# h200-llama8b-256x1024-vllm-0.27.1*, -0.25.1.json; which wheels import it: results/gpu/openai-namespace-tool.md)
openai_namespace_tool="openai==2.25.0"
case "$release" in
  # xgrammar >= 0.2.0 needs tvm-ffi >= 0.1.11; its sampler imports flashinfer at worker start (measured on the H200:
  # compat_matrix/results/gpu/attempts/h200-vllm-0.21.0-bundle-attempt.*), 0.20.0's did not
  0.21.0) overrides="xgrammar==0.2.9 apache_tvm_ffi==0.1.15.post2 flashinfer_python==0.6.8.post1 cuda_tile \
                     nvidia_cudnn_frontend" ;;
  # flashinfer 0.6.11 (its cubin package is left behind: Hopper's bf16 paths JIT or use none of its cubins);
  # llguidance 1.7 is left out, 0.20.0's 1.3 stays (structured outputs, imported lazily: every cell ran); humming
  # (humming-kernels) is imported on CUDA when any quantized checkpoint loads (quantization/humming.py, read from the
  # wheel), tokenspeed-mla only by its own MLA backends
  0.22.1) overrides="xgrammar==0.2.9 apache_tvm_ffi==0.1.15.post2 flashinfer_python==0.6.11.post2 cuda_tile \
                     nvidia_cudnn_frontend humming_kernels==0.1.2 pyelftools tabulate" ;;
  # 0.23-0.25: 0.22.1's set with each wheel's own flashinfer, humming-kernels and compressed-tensors pins
  # (results/gpu/carry-probe.md); what each adds besides (the API server's fastapi/starlette, video decoders,
  # fastsafetensors, llguidance) is imported lazily if at all: 0.25.1 ran every cell without them.
  0.23.0|0.24.0|0.25.1)
    case "$release" in 0.23.0) fi=0.6.12 hk=0.1.4 ;; 0.24.0) fi=0.6.12 hk=0.1.6 ;; 0.25.1) fi=0.6.13 hk=0.1.10 ;; esac
    overrides="xgrammar==0.2.9 apache_tvm_ffi==0.1.15.post2 flashinfer_python==$fi cuda_tile nvidia_cudnn_frontend \
               humming_kernels==$hk pyelftools tabulate compressed_tensors==0.17.0 nvtx==0.2.15"
    [ "$release" != 0.25.1 ] || overrides="$overrides $openai_namespace_tool" ;;
  # 0.26.0 pins apache-tvm-ffi 0.1.10, below the 0.1.11 that xgrammar 0.2.9 needs: xgrammar 0.2.7 is the newest
  # that takes 0.1.10 (>=0.1.10; read from each xgrammar wheel's metadata) and meets 0.26's xgrammar>=0.2.1;
  # flashinfer 0.6.14 without a cubin package (0.26 no longer requires one). From 0.26 vLLM imports transformers'
  # MistralCommonBackend at worker start (structured_output/backend_guidance.py), which imports mistral-common's
  # tokenizers: they need attrs, pydantic-extra-types and pycountry, which the image lacks (every cell of the first
  # run failed on it: results/gpu/attempts/h200-vllm-0.26.0-bundle-attempt.*)
  0.26.0) overrides="xgrammar==0.2.7 apache_tvm_ffi==0.1.10 flashinfer_python==0.6.14 cuda_tile nvidia_cudnn_frontend \
                     humming_kernels==0.1.10 pyelftools tabulate compressed_tensors==0.17.0 nvtx==0.2.15 \
                     $mistral_tokenizer_needs $openai_namespace_tool" ;;
  # 0.27.x pins torch 2.13.0 (the image has 2.11.0): torch, torchvision, triton, cuDNN and NCCL are carried and shadow
  # the image's (/tmp/site is first on the path). cuDNN 9.20: torch refuses a runtime cuDNN minor older than its
  # build's (torch/backends/cudnn; the image's is 9.19). NCCL 2.29.7: torch 2.13's libtorch_cuda.so needs 8 symbols
  # the image's 2.28.9 lacks (ncclCommSuspend, ncclSignal, ...; nm -D of both), and loads it at import.
  # cuSPARSELt 0.8.0 and cuBLAS 13.1.0 (the image's, via cuda-toolkit 13.0.2) define every symbol torch 2.13 takes
  # from them (nm -D): they stay the image's. quack-kernels: 0.27 pins it exactly. Ran: results/gpu/h200-vllm-0.27.1*.
  # 0.28.0-0.32.0 pin the same torch 2.13.0 (each wheel's metadata): one set, and each release's own pins beside it;
  # build them as deltas over 0.27.1's bundle (BASE=) to carry only what differs.
  0.27.1|0.28.0|0.29.0|0.30.0|0.31.0|0.32.0)
    overrides="torch==2.13.0 torchvision==0.28.0 triton==3.7.1 nvidia_cudnn_cu13==9.20.0.48 nvidia_nccl_cu13==2.29.7 \
               apache_tvm_ffi==0.1.11 cuda_tile nvidia_cudnn_frontend pyelftools tabulate compressed_tensors==0.17.0 \
               nvtx==0.2.15 $mistral_tokenizer_needs $openai_namespace_tool"
    # 0.28.0 asks huggingface_hub>=1.27.0 (0.30+: >=1.31.0): 1.33.0, the newest below the <2.0 of the image's
    # transformers 5.17. Not carried, as under 0.27.1: nvidia-cutlass-dsl (Blackwell MLA kernels; quack needs it only
    # when its kernels run), nccl4py (flashinfer's comm module), tokenspeed-mla (its own MLA backends), mcp (the API
    # server). 0.29+ asks instanttensor (a load format) and 0.31+ oss-harmony (gpt-oss), carried, being small; 0.32
    # asks tokenizers>=0.23.2: 0.23.3, which the image's transformers 5.17 takes (<0.24). 0.28.0 ran:
    # results/gpu/h200-vllm-0.28.0* to h200-vllm-0.32.0*.
    hub="huggingface_hub==1.33.0"
    case "$release" in
      0.27.1) overrides="$overrides xgrammar==0.2.9 flashinfer_python==0.6.16.post3 humming_kernels==0.1.10 \
                         quack_kernels==0.6.1" ;;
      0.28.0) overrides="$overrides xgrammar==0.2.9 flashinfer_python==0.6.16.post3 humming_kernels==0.1.12 \
                         quack_kernels==0.6.4 $hub" ;;
      0.29.0) overrides="$overrides xgrammar==0.2.9 flashinfer_python==0.6.18 humming_kernels==0.1.12 \
                         quack_kernels==0.6.4 $hub instanttensor==0.2.2" ;;
      0.30.0) overrides="$overrides xgrammar==0.2.9 flashinfer_python==0.6.18.post1 humming_kernels==0.1.12 \
                         quack_kernels==0.6.5 $hub instanttensor==0.2.2" ;;
      0.31.0) overrides="$overrides xgrammar==0.2.7 flashinfer_python==0.7.0.post1 humming_kernels==0.1.16 \
                         quack_kernels==0.6.5 $hub instanttensor==0.2.2 oss_harmony==0.0.11" ;;
      0.32.0) overrides="$overrides xgrammar==0.2.8 flashinfer_python==0.7.0.post1 humming_kernels==0.1.17 \
                         quack_kernels==0.6.5 $hub instanttensor==0.2.2 oss_harmony==0.0.11 tokenizers==0.23.3" ;;
    esac ;;
  # 0.33.0 pins torch 2.14.0 (its wheel's metadata; carry-probe.md): a new torch set, with the pins torch 2.14 asks
  # (cuDNN 9.24, NCCL 2.30.7, Triton 3.8, cuSPARSELt 0.8.1, carried rather than checked against the image's 0.8.0)
  # and 0.33.0's own (flashinfer 0.7.2.post1, humming 0.1.19, xgrammar 0.2.8; its protobuf==7.36.1 is for s390x
  # only, so the image's protobuf stays). torch 2.14 asks cuBLAS 13.1.1.3 (cuda-toolkit 13.0.3): the image's 13.1.0.3
  # defines every cublas* symbol libtorch_cuda.so (71) and libtorch_cuda_linalg.so (135) take (nm -D of both), so
  # it stays the image's. Built (35 parts, 2,073 MB: bundle-builds.md); every family of the matrix ran on it. Gemma 4
  # and Qwen3.5 did not: their attention imports vLLM's CuTe DSL interface, which needs nvidia-cutlass-dsl, not carried
  # here (results/gpu/attempts/h100-vllm-0.33.0-no-cutlass-dsl.*); 0.34.0's pins below carry it.
  0.33.0)
    overrides="torch==2.14.0 torchvision==0.29.0 triton==3.8.0 nvidia_cudnn_cu13==9.24.0.43 nvidia_nccl_cu13==2.30.7 \
               nvidia_cusparselt_cu13==0.8.1 apache_tvm_ffi==0.1.11 cuda_tile nvidia_cudnn_frontend pyelftools \
               tabulate compressed_tensors==0.17.0 nvtx==0.2.15 $mistral_tokenizer_needs $openai_namespace_tool \
               xgrammar==0.2.8 flashinfer_python==0.7.2.post1 humming_kernels==0.1.19 quack_kernels==0.6.5 \
               huggingface_hub==1.33.0 instanttensor==0.2.2 oss_harmony==0.0.11 tokenizers==0.23.3" ;;
  # 0.34.0: 0.33.0's torch 2.14 set (build it as a delta over 0.33.0's bundle, BASE=), with what its wheel changes
  # (carry-probe.md): flashinfer-python==0.7.3 is not served, so 0.7.4, the next patch of that minor (vLLM checks
  # only that its flashinfer packages agree with each other: utils/flashinfer.py; none other is carried); it asks
  # huggingface_hub>=2.0.0, which the image's transformers 5.17 refuses (<2.0), so transformers 5.22.2 (the newest
  # below 0.34's <5.23; it takes hub <3.0) and hub 2.4.0; filelock>=4.2.4. opentelemetry (tracing) is imported
  # lazily (no module-level import in the wheel). On an H100 (results/gpu/attempts/h100-vllm-0.34.0-bundle-attempt.*):
  # hub 2.4.0 imports httpx2 (with httpcore2 and truststore), and every engine's warm-up imports `cutlass`
  # (nvidia-cutlass-dsl, which 0.34 pins at 4.8.0 with its cu13 libraries), whatever the model: both are carried.
  # The second run (h100-vllm-0.34.0-cutlass-attempt.*): 4.8.0 keeps the `cutlass` package itself in
  # nvidia-cutlass-dsl-libs-core (libs-base requires it), found through a .pth file that a site on PYTHONPATH does not
  # read: libs-core is carried, and scripts/gpu_setup.sh puts the .pth files' paths on PYTHONPATH.
  0.34.0)
    overrides="torch==2.14.0 torchvision==0.29.0 triton==3.8.0 nvidia_cudnn_cu13==9.24.0.43 nvidia_nccl_cu13==2.30.7 \
               nvidia_cusparselt_cu13==0.8.1 apache_tvm_ffi==0.1.11 cuda_tile nvidia_cudnn_frontend pyelftools \
               tabulate compressed_tensors==0.17.0 nvtx==0.2.15 $mistral_tokenizer_needs $openai_namespace_tool \
               xgrammar==0.2.8 flashinfer_python==0.7.4 humming_kernels==0.1.19 quack_kernels==0.6.5 \
               huggingface_hub==2.4.0 transformers==5.22.2 filelock==4.3.2 instanttensor==0.2.2 oss_harmony==0.0.11 \
               tokenizers==0.23.3 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5 nvidia_cutlass_dsl==4.8.0 \
               nvidia_cutlass_dsl_libs_base==4.8.0 nvidia_cutlass_dsl_libs_cu13==4.8.0 nvidia_cutlass_dsl_libs_core==4.8.0" ;;
  *) overrides="" ;;
esac
python3 - "$work/ref.json" "$work/want.json" "$release" "$overrides" <<'PY'
import json, sys
def requires(path):
    meta = json.load(open(path))["install"][0]["metadata"]
    return sorted(r for r in meta.get("requires_dist", []) if "extra ==" not in r)
ref, want = requires(sys.argv[1]), requires(sys.argv[2])
new, gone = sorted(set(want) - set(ref)), sorted(set(ref) - set(want))
if (new or gone) and sys.argv[4]:
    print(f"vLLM {sys.argv[3]}: building with its pins over 0.20.0's ({sys.argv[4]}) for:", *new, sep="\n  + ")
elif new or gone:
    print(f"vLLM {sys.argv[3]} needs other packages than the measured 0.20.0 bundle carries; not built:")
    for r in new:
        print(f"  + {r}")
    for r in gone:
        print(f"  - {r}")
    sys.exit(3)
PY
pip download -q --no-deps $plat -d "$work/vllm" "vllm==$release"
mkdir -p "$work/whl"
pinned=""
for p in annotated_types==0.8.0 apache_tvm_ffi==0.1.9 astor==0.8.1 blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0 \
  cloudpickle==3.1.3 compressed_tensors==0.15.0.1 depyf==0.20.0 dill==0.4.1 diskcache==5.6.3 distro==1.9.0 \
  fastapi==0.118.0 gguf==0.19.0 ijson==3.6.0 interegular==0.3.3 jiter==0.19.0 jsonschema==4.26.0 \
  jsonschema_specifications==2025.9.1 lark==1.2.2 llguidance==1.3.0 lm_format_enforcer==0.11.3 mistral_common==1.13.1 \
  msgspec==0.23.0 openai==2.8.0 openai_harmony==0.0.8 outlines_core==0.2.14 partial_json_parser==0.2.1.1.post7 \
  prometheus_client==0.26.0 prometheus_fastapi_instrumentator==8.1.0 py_cpuinfo==9.0.0 pybase64==1.5.1 \
  pydantic==2.14.4 pydantic_core==2.50.5 python_json_logger==4.2.0 pyzmq==27.3.0 referencing==0.37.0 \
  rpds_py==2026.9.1 setproctitle==1.3.8 sniffio==1.3.1 starlette==0.48.0 typing_inspection==0.4.5 \
  watchfiles==1.3.0 xgrammar==0.1.32; do
  for o in $overrides; do [ "${o%%==*}" = "${p%%==*}" ] && p=$o; done  # a release's own pin replaces 0.20.0's
  pip download -q --no-deps $plat -d "$work/whl" "$p"
  pinned="$pinned ${p%%==*}"
done
for o in $overrides; do  # and the packages a release needs that 0.20.0 did not
  case " $pinned " in *" ${o%%==*} "*) ;; *) pip download -q --no-deps $plat --platform any -d "$work/whl" "$o" ;; esac
done
# the wheel unpacked, without what Hopper does not use (FlashAttention-2 kernels, DeepGEMM JIT headers, web assets)
mkdir -p "$work/site" && (cd "$work/site" && unzip -q "$work"/vllm/vllm-*.whl)
rm -f "$work/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"
rm -rf "$work/site/vllm/third_party/deep_gemm/include" "$work/site/vllm/entrypoints/serve/instrumentator/static"
mkdir -p "$work/bundle" && tar -czf "$work/bundle/vllm.tgz" -C "$work/site" . && cp -r "$work/whl" "$work/bundle/whl"
# BASE=DIR: a delta over bundle DIR, for a machine that has DIR set up already (a release on the same torch stack: the
# torch 2.13 set is 1.2 GB, 20 of 0.27.1's 26 parts); only the vLLM wheel and the wheels DIR lacks are carried
if [ -n "${BASE:-}" ]; then
  [ "$(cd "$BASE" && pwd)" != "$out" ] || { echo "BASE and OUTDIR are the same folder: $out"; exit 2; }
  base_parts=$(sed -n 's/^parts="\(.*\)"$/\1/p' "$BASE/setup.sh")
  base_wheels=$(cd "$BASE" && cat $base_parts | tar -tf - | sed -n 's|^\./whl/||p')
  for w in "$work"/bundle/whl/*.whl; do
    if printf '%s\n' "$base_wheels" | grep -qxF "$(basename "$w")"; then rm "$w"; fi
  done
  echo "delta over $BASE ($(cat "$BASE/release.txt")): carries $(ls "$work"/bundle/whl | tr '\n' ' ')"
fi
tar -cf "$work/bundle.tar" -C "$work/bundle" .
# a delta's parts are named by release: the machine's /tmp/g keeps its base's parts, and another delta's
prefix=part; [ -z "${BASE:-}" ] || prefix=delta-$release-
rm -f "$out"/part* "$out"/delta*
split -b 60000000 -d "$work/bundle.tar" "$out/$prefix"
md5sum "$work/bundle.tar" | cut -c1-32 > "$out/bundle.md5"
echo "$release" > "$out/release.txt"
# setup.sh joins its own parts only: /tmp/g may still hold a larger bundle's from an earlier release on that machine
echo "parts=\"$(cd "$out" && echo $prefix*)\"" > "$out/setup.sh"
# a delta names its base in setup.sh itself: a delta set up as a full bundle would run vLLM on the image's torch
[ -z "${BASE:-}" ] || echo "base=\"$(cat "$BASE/bundle.md5")\"" >> "$out/setup.sh"
cat "$(dirname "$0")/gpu_bundle_setup.sh" >> "$out/setup.sh"
# the build, recorded (compat_matrix/results/gpu/bundle-builds.md): which releases the builder makes, and the bundle
# a GPU result ran from
builds="$(dirname "$0")/../compat_matrix/results/gpu/bundle-builds.md"
[ -z "${SMOKE:-}" ] || builds="$out/bundle-builds.md"
printf '| %s | %d | %d | %s | %s |\n' "$release${BASE:+ (delta over $(cat "$BASE/bundle.md5"))}" \
  "$(ls "$out"/$prefix* | wc -l)" "$(( $(cat "$out"/$prefix* | wc -c) / 1000000 ))" "$(cat "$out/bundle.md5")" \
  "$(date -u +%F)" >> "$builds"
ls -la "$out"
