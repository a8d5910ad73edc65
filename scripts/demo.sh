#!/usr/bin/env bash
# The main job on the embedded default: builds a tiny DeepSeek-V3 (MLA + MoE, the Kimi-K2 architecture) locally,
# runs unmodified speculators 0.3.0 under eagle_compat.install() on CPU vLLM 0.32.0, and prints each layer's
# error against HF transformers. Extra arguments go to `eagle-compat demo` (e.g. --family llama).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
ensure_env "${EAGLE_COMPAT_DEMO_RELEASE:-0.32.0}"
"$ENV_PY" -m eagle_compat.cli demo "$@"
