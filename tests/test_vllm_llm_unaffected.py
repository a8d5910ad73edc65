"""install() is scoped to speculators' call sites: vLLM's own LLM(...).generate(...) still works, unchanged."""
from __future__ import annotations

import pytest

import eagle_compat
from eagle_compat import tiny_models

pytestmark = pytest.mark.engine


def test_llm_generate_after_install_matches_hf_greedy(tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM

    eagle_compat.install()
    try:
        import speculators.data_generation.vllm_hidden_states_generator  # noqa: F401  (patches now applied)
        from vllm import LLM, SamplingParams

        prompt = [5, 99, 23, 310, 47, 8, 200, 150]
        llm = LLM(model=tiny_llama, enforce_eager=True, max_model_len=256, gpu_memory_utilization=0.3,
                  dtype="float32")
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=6, temperature=0.0))
        got = list(out[0].outputs[0].token_ids)
        del llm
    finally:
        eagle_compat.uninstall()
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, **tiny_models._dtype_kwarg(torch.float32))
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    assert got == want
