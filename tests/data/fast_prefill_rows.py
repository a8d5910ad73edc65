"""Rows each decoder layer of a model runs in vLLM's own engine with kv_sharing_fast_prefill on, for the given
prompts (tests/test_gemma4.py). The engine runs in this process (no serialization of the hooks), its hooks count.

    python fast_prefill_rows.py MODEL '[[ids...], [ids...]]'   -> prints ROWS [[n, ...] per layer]
"""
import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    model, batch = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model=model, enforce_eager=True, max_model_len=256, gpu_memory_utilization=0.3, dtype="float32",
              skip_tokenizer_init=True, enable_prefix_caching=False, kv_sharing_fast_prefill=True)
    rows: list[list[int]] = []

    def install(model):
        for i, layer in enumerate(model.model.layers):
            rows.append([])
            layer.register_forward_hook(lambda mod, args, out, i=i: rows[i].append(out[0].shape[0]))

    llm.apply_model(install)
    llm.generate([{"prompt_token_ids": p} for p in batch], SamplingParams(max_tokens=1), use_tqdm=False)
    print("ROWS " + json.dumps(rows), flush=True)
