"""CPU vLLM has no usable MLA attention backend before 0.29: DeepSeek-V2/V3, Kimi-K2 and Kimi-K2.5 refuse to start
("MLA is not supported on CPU" before 0.28; on 0.28 the MLA prefill selector picks FlashAttention, whose module a CPU
build cannot import: "cannot import name 'compile_flash_attn_varlen_func_from_specs'").

Decision: on a CPU-only machine whose vLLM has no CPU MLA backend, install() sets `VLLM_MLA_DISABLE=1` (unless
the user set it), which the spawned workers inherit. vLLM then runs MLA models with plain attention over the
expanded keys and values: the same function, checked against HF by the parity tests. Models without MLA are
unaffected. uninstall() restores the environment.
"""
from __future__ import annotations

from ._base import worker_environment_unit

UNIT = worker_environment_unit(
    variable="VLLM_MLA_DISABLE",
    name="cpu_mla_disable",
    broke="CPU vLLM has no MLA backend: DeepSeek/Kimi models refuse to start on CPU",
    affects="<0.29",
    condition="a machine without CUDA",
    delete_when="the vLLM floor is 0.29 (usable CPU MLA backend)",
)
