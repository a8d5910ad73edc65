"""CUDA vLLM 0.21+ samples with FlashInfer by default (`VLLM_USE_FLASHINFER_SAMPLER`, before: off unless set), and
every engine start warms the sampler up with top-k/top-p (`gpu_model_runner._dummy_sampler_run`), which FlashInfer
compiles with nvcc on first use, for a token extraction never reads (speculators asks one greedy token per prompt).
No wrong data, only the wait, paid by every fresh container. On an H200 (vLLM 0.21.0): the first engine with
vLLM's default gave no result within 400 s (results/gpu/attempts/h200-vllm-0.21.0-bundle-attempt2), with this unit
its cells start in under a minute (results/gpu/h200-vllm-0.21.0.jsonl); the build alone is not timed yet
(scripts/gpu_flashinfer_first_use.py).

Decision: on such a vLLM, install() sets `VLLM_USE_FLASHINFER_SAMPLER=0` (unless the user set it; vLLM then uses
its PyTorch sampler), which the spawned workers inherit; the stable generator does the same for its engines
(`engine.process_env.default_worker_env`). uninstall() restores the environment.
"""
from __future__ import annotations

from ._base import worker_environment_unit

UNIT = worker_environment_unit(
    variable="VLLM_USE_FLASHINFER_SAMPLER",
    name="gpu_sampler_no_jit",
    broke="every engine start on a fresh GPU machine compiles FlashInfer's top-k/top-p sampler with nvcc (minutes)",
    affects=">=0.21",
    condition="CUDA vLLM whose VLLM_USE_FLASHINFER_SAMPLER defaults on",
    silent=False,
    delete_when="never while vLLM warms a JIT-compiled sampler up at engine start",
)
