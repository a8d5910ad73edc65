"""Model-family facts, as data. One resolver (`resolver.py`) reads this table; nothing else branches on families.

Sources: shared/notes/vllm-model-drift.md §1-§6 (file:line for every release 0.11-0.32).
`output` is what a decoder layer returns, which decides the residual-stream value captured after it:
  "pair":   (hidden_states, residual)   → hidden_states + residual
  "tensor": one tensor (the stream)     → a copy of it
`layer_classes` are vLLM's decoder-layer class names; `architectures` the HF architectures that load them.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    name: str
    layer_classes: tuple[str, ...]
    architectures: tuple[str, ...]
    output: str = "pair"
    # CPU vLLM's C++ rotary kernel mishandles this family's strided q/k views unless rope scaling is set
    # (cpu-vllm-setup.md): run the rotary embedding's native implementation instead.
    cpu_native_rotary: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("LlamaDecoderLayer",), ("LlamaForCausalLM",)),
    Family("llama4", ("Llama4DecoderLayer",), ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")),
    Family("mistral", ("MistralDecoderLayer",), ("MistralForCausalLM",),
           notes=("<=0.14 MistralForCausalLM loads LlamaDecoderLayer",)),
    Family("phi3", ("Phi3DecoderLayer",), ("Phi3ForCausalLM",), notes=("vLLM runs Phi-3 as Llama layers",)),
    Family("qwen2", ("Qwen2DecoderLayer",), ("Qwen2ForCausalLM",)),
    Family("qwen3", ("Qwen3DecoderLayer",), ("Qwen3ForCausalLM",)),
    Family("qwen3_moe", ("Qwen3MoeDecoderLayer",), ("Qwen3MoeForCausalLM",)),
    Family("qwen3_next", ("Qwen3NextDecoderLayer", "Qwen3_5DecoderLayer"),
           ("Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration"),
           notes=("layer signature (hidden_states, residual, positions, **kwargs)",)),
    Family("deepseek_v2", ("DeepseekV2DecoderLayer", "DeepseekV3DecoderLayer"),
           ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration",
            "KimiVLForConditionalGeneration"),
           cpu_native_rotary=True,
           notes=("layer signature (positions, hidden_states, residual, llama_4_scaling=None) from 0.12",
                  "fp16 only: states scaled by 1/routed_scaling_factor inside the layer (bf16/fp32 exact)")),
    Family("gpt_oss", ("TransformerBlock",), ("GptOssForCausalLM",),
           notes=("layer signature (hidden_states, positions, residual): hidden states first",)),
    Family("gemma2", ("Gemma2DecoderLayer",), ("Gemma2ForCausalLM",)),
    Family("gemma3", ("Gemma3DecoderLayer",), ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")),
    Family("mixtral", ("MixtralDecoderLayer",), ("MixtralForCausalLM",)),
    Family("glm4_moe", ("Glm4MoeDecoderLayer",), ("Glm4MoeForCausalLM",)),
    Family("minimax_m2", ("MiniMaxM2DecoderLayer",), ("MiniMaxM2ForCausalLM",)),
    Family("granite", ("GraniteDecoderLayer",), ("GraniteForCausalLM",), output="tensor",
           notes=("layer returns one tensor (its annotation says tuple)",)),
    Family("olmo2", ("Olmo2DecoderLayer",), ("Olmo2ForCausalLM",), output="tensor"),
)

# Where the decoder stack may sit, in the order tried (R1): the top model, a multimodal wrapper's language model
# (Kimi-K2.5 on 0.15: `language_model` is the base; from 0.16 `language_model.model`).
BASE_MODEL_PATHS: tuple[str, ...] = ("model", "language_model.model", "language_model", "")

_BY_LAYER_CLASS = {cls: fam for fam in FAMILIES for cls in fam.layer_classes}


def family_for_layer_class(name: str) -> Family | None:
    return _BY_LAYER_CLASS.get(name)


def known_layer_classes() -> list[str]:
    return sorted(_BY_LAYER_CLASS)
