"""Tiny random-weight models, built locally from transformers config classes (no hub downloads), and the
independent reference: HF transformers `output_hidden_states` on the same weights.

Used by the tests, the demo and the compatibility matrix. Each family's tiny config is data (`TINY_CONFIGS`).
Sizes respect CPU vLLM's limits (head_dim 64; CPU MLA needs kv_lora_rank + qk_rope_head_dim = 576).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable

VOCAB_SIZE = 512
BUILD_REVISION = 4  # bump when the way checkpoints are written changes (part of the cache key)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}")

_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1,
               eos_token_id=2, pad_token_id=0)

# YaRN with factor 1.0 is mathematically plain RoPE; it keeps CPU vLLM off a C++ rotary path that mishandles
# DeepSeek attention's strided q/k views (cpu-vllm-setup.md). Real DeepSeek-V3 / Kimi-K2 configs use YaRN too.
_YARN_1 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0, "original_max_position_embeddings": 1024,
           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}

_DEEPSEEK_V3 = dict(
    _COMMON, num_hidden_layers=4, num_key_value_heads=4, kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=96,
    qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    moe_intermediate_size=128, first_k_dense_replace=1, topk_method="noaux_tc", scoring_func="sigmoid",
    n_group=1, topk_group=1,
    norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True,
    rope_parameters=_YARN_1, rope_scaling={**_YARN_1, "type": "yarn"})

# Without rope scaling: CPU vLLM's C++ rotary kernel mishandles DeepSeek attention's strided q/k (silently wrong
# states); the resolver's workaround (the rotary embedding's native implementation) must make it exact.
_DEEPSEEK_V3_PLAIN_ROPE = {k: v for k, v in _DEEPSEEK_V3.items() if k not in ("rope_parameters", "rope_scaling")}
_DEEPSEEK_V3_PLAIN_ROPE["rope_theta"] = 10000.0

_MOE = dict(num_local_experts=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)

# family -> (transformers config class, HF architecture, config kwargs)
TINY_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_COMMON, num_hidden_layers=6)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", _DEEPSEEK_V3),
    "deepseek_v3_plain_rope": ("DeepseekV3Config", "DeepseekV3ForCausalLM", _DEEPSEEK_V3_PLAIN_ROPE),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_COMMON, num_hidden_layers=4, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_COMMON, num_hidden_layers=4, use_sliding_window=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_COMMON, num_hidden_layers=4, head_dim=64,
                                                      use_sliding_window=False)),
    # every token takes all 4 experts (weights from the router's softmax): no top-k choice for bf16 rounding to flip,
    # so bf16 runs (GPU) can be judged against fp32 HF; top-k selection is covered by Mixtral, GLM-4-MoE, gpt-oss
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(_COMMON, num_hidden_layers=4, head_dim=64, num_experts=4, num_experts_per_tok=4,
                       moe_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(_COMMON, num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2, sliding_window=None)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_COMMON, num_hidden_layers=4, num_key_value_heads=4,
                                                   sliding_window=None, pad_token_id=0)),
    # vLLM's Gemma always ties the output embedding to the input one (it has no lm_head)
    # (both activation names: older vLLM reads `hidden_act`, which transformers 4's Gemma2Config lacks)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_COMMON, num_hidden_layers=4, head_dim=64,
                                                         sliding_window=512, query_pre_attn_scalar=64,
                                                         tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh",
                                                         hidden_activation="gelu_pytorch_tanh")),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(_COMMON, num_hidden_layers=4, head_dim=64,
                                                             sliding_window=512, query_pre_attn_scalar=64,
                                                             tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh",
                                                             hidden_activation="gelu_pytorch_tanh")),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(_COMMON, num_hidden_layers=4, embedding_multiplier=4.0, residual_multiplier=0.5,
                     attention_multiplier=0.125, logits_scaling=2.0)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(_COMMON, num_hidden_layers=4, head_dim=64, n_routed_experts=8, n_shared_experts=1,
                      num_experts_per_tok=2, moe_intermediate_size=128, first_k_dense_replace=1, n_group=1,
                      topk_group=1, norm_topk_prob=True, partial_rotary_factor=0.5, use_qk_norm=False)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(_COMMON, num_hidden_layers=4, head_dim=64, num_local_experts=8, num_experts_per_tok=2,
                     intermediate_size=256, sliding_window=128, layer_types=["sliding_attention",
                                                                             "full_attention"] * 2)),
}


def _config(family: str):
    import transformers

    cls_name, arch, kwargs = TINY_CONFIGS[family]
    cfg = getattr(transformers, cls_name)(**kwargs)
    cfg.architectures = [arch]
    return cfg


# The bias a noaux_tc router adds to the scores when it *selects* experts (the weights still come from the scores).
# A decisive bias makes every token pick the same top-k experts, so bf16 rounding cannot flip a near-tie choice:
# with a random router about one token in a hundred changes experts between a bf16 engine and the fp32 reference,
# a property of bf16, not of capture. The expert mixing itself is still exercised (weights vary per token).
ROUTER_SELECTION_BIAS = 4.0


def _fix_deepseek_checkpoint(model_dir: str, config: Any) -> None:
    """vLLM's noaux_tc router loads `e_score_correction_bias`, which transformers does not save: write it (and
    the HF model reads it back from the same file)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    for i in range(config.first_k_dense_replace, config.num_hidden_layers):
        bias = torch.zeros(config.n_routed_experts, dtype=torch.float32)
        bias[i % config.n_routed_experts] = bias[(i + 3) % config.n_routed_experts] = ROUTER_SELECTION_BIAS
        tensors[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] = bias
    save_file(tensors, path, metadata={"format": "pt"})


_POST_SAVE: dict[str, Callable[[str, Any], None]] = {"deepseek_v3": _fix_deepseek_checkpoint,
                                                     "deepseek_v3_plain_rope": _fix_deepseek_checkpoint}


# gpt-oss's reasoning parser, which vLLM 0.17+ builds with the engine, looks these up in the vocabulary
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"]


def save_tokenizer(model_dir: str, vocab_size: int = VOCAB_SIZE, extra_specials: list[str] | None = None) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", *(extra_specials or [])]
    vocab = {t: i for i, t in enumerate(specials)}
    for i in range(vocab_size - len(specials)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(model_dir)
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # transformers 4 cannot load "TokenizersBackend"
    cfg.setdefault("chat_template", CHAT_TEMPLATE)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=1)


def cache_dir() -> str:
    return os.environ.get("EAGLE_COMPAT_TINY_MODELS", os.path.expanduser("~/.cache/eagle-compat/tiny-models"))


def _dtype_kwarg(dtype) -> dict:
    import transformers
    return {"dtype": dtype} if int(transformers.__version__.split(".")[0]) >= 5 else {"torch_dtype": dtype}


def build_tiny_model(family: str, out_dir: str | None = None, seed: int = 0) -> str:
    """Build (once) a tiny random-weight float32 checkpoint of `family` with a local tokenizer; return its path."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if family not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny family {family!r}; known: {sorted(TINY_CONFIGS)}")
    key = hashlib.sha256(json.dumps([TINY_CONFIGS[family], seed, transformers.__version__, BUILD_REVISION],
                                    sort_keys=True, default=str).encode()).hexdigest()[:12]
    out_dir = out_dir or os.path.join(cache_dir(), f"{family}-{key}")
    if os.path.exists(os.path.join(out_dir, ".complete")):
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    config = _config(family)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, **_dtype_kwarg(torch.float32))
    model.save_pretrained(out_dir, safe_serialization=True)
    if family in _POST_SAVE:
        _POST_SAVE[family](out_dir, config)
    save_tokenizer(out_dir, config.vocab_size, HARMONY_TOKENS if family == "gpt_oss" else None)
    open(os.path.join(out_dir, ".complete"), "w").close()
    return out_dir


# Kimi-K2.5: the language model is the tiny DeepSeek-V3 (Kimi-K2 architecture) with the same weights, inside
# `KimiK25ForConditionalGeneration` (a MoonViT vision tower and a projector, here tiny and random). The HF reference
# is the DeepSeek-V3 checkpoint itself: the wrapper must not change the language model's states. Written by hand,
# in the original checkpoint's names, so that it needs no transformers Kimi classes (transformers 4 has none).
_KIMI_VISION = dict(
    patch_size=14, num_attention_heads=2, num_hidden_layers=1, hidden_size=128, intermediate_size=256,
    merge_kernel_size=[2, 2],
    pos_emb_height=8, pos_emb_width=8, pos_emb_time=4,            # transformers' Kimi_K25VisionConfig
    init_pos_emb_height=8, init_pos_emb_width=8, init_pos_emb_time=4,  # vLLM's own KimiK25VisionConfig (<= 0.2x)
    mm_hidden_size=128, text_hidden_size=256)
_KIMI_MEDIA_PROC = {"in_patch_limit": 256, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5],
                    "image_std": [0.5, 0.5, 0.5], "merge_kernel_size": 2, "fixed_output_tokens": None,
                    "patch_limit_on_one_side": 16, "in_patch_limit_each_frame": 64, "in_patch_limit_video": 256,
                    "temporal_merge_kernel_size": 4, "sample_fps": 2.0, "timestamp_mode": "hh:mm:ss.fff",
                    "config_type": "media_proc_cfg"}


_KIMI_REMOTE_CONFIG = '''"""Tiny stand-in for Kimi-K2.5's remote-code configuration."""
from transformers import DeepseekV3Config, PretrainedConfig


class TinyKimiK25Config(PretrainedConfig):
    model_type = "kimi_k25"

    def __init__(self, text_config=None, vision_config=None, **kwargs):
        if isinstance(text_config, dict):
            text_config = DeepseekV3Config(**text_config)
        self.text_config = text_config or DeepseekV3Config()
        self.vision_config = vision_config or {}
        super().__init__(**kwargs)
'''
_KIMI_REMOTE_PROCESSOR = '''"""Tiny stand-in for Kimi-K2.5's remote-code image processor (text-only extraction tests)."""
from transformers.image_processing_utils import BaseImageProcessor


class TinyKimiK25ImageProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(self, media_proc_cfg=None, **kwargs):
        super().__init__(**kwargs)
        self.media_proc_cfg = dict(media_proc_cfg or {})
        self.num_frames_per_chunk = self.media_proc_cfg.get("temporal_merge_kernel_size", 4)

    def media_tokens_calculator(self, media):
        patch = self.media_proc_cfg.get("patch_size", 14) * self.media_proc_cfg.get("merge_kernel_size", 2)
        image = media.get("content") if isinstance(media, dict) else media
        width, height = getattr(image, "size", (patch, patch))
        return max(1, height // patch) * max(1, width // patch)

    def preprocess(self, medias, **kwargs):
        raise NotImplementedError("this tiny test checkpoint takes text only")
'''


def _kimi_vision_shapes(v: dict, text_hidden: int) -> dict[str, tuple[int, ...]]:
    h, i, p = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    merged = h * v["merge_kernel_size"][0] * v["merge_kernel_size"][1]
    shapes = {"vision_tower.patch_embed.proj.weight": (h, 3, p, p), "vision_tower.patch_embed.proj.bias": (h,),
              "vision_tower.patch_embed.pos_emb.weight": (v["pos_emb_height"], v["pos_emb_width"], h),
              "vision_tower.encoder.final_layernorm.weight": (h,), "vision_tower.encoder.final_layernorm.bias": (h,),
              "mm_projector.pre_norm.weight": (h,), "mm_projector.pre_norm.bias": (h,),
              "mm_projector.proj.0.weight": (merged, merged), "mm_projector.proj.0.bias": (merged,),
              "mm_projector.proj.2.weight": (text_hidden, merged), "mm_projector.proj.2.bias": (text_hidden,)}
    for b in range(v["num_hidden_layers"]):
        pre = f"vision_tower.encoder.blocks.{b}."
        shapes.update({pre + "norm0.weight": (h,), pre + "norm0.bias": (h,), pre + "norm1.weight": (h,),
                       pre + "norm1.bias": (h,), pre + "wqkv.weight": (3 * h, h), pre + "wqkv.bias": (3 * h,),
                       pre + "wo.weight": (h, h), pre + "wo.bias": (h,), pre + "mlp.fc0.weight": (i, h),
                       pre + "mlp.fc0.bias": (i,), pre + "mlp.fc1.weight": (h, i), pre + "mlp.fc1.bias": (h,)})
    return shapes


def build_tiny_kimi_k25(out_dir: str | None = None, seed: int = 0) -> str:
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    text_dir = build_tiny_model("deepseek_v3", seed=seed)
    out_dir = out_dir or text_dir + "-kimi_k25"
    if os.path.exists(os.path.join(out_dir, ".complete")):
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(text_dir, "config.json")) as f:
        text_config = json.load(f)
    g = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(shape, generator=g) * 0.02
               for name, shape in _kimi_vision_shapes(_KIMI_VISION, text_config["hidden_size"]).items()}
    for key, value in load_file(os.path.join(text_dir, "model.safetensors")).items():
        tensors["language_model." + key] = value
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    special = {"image_token_id": VOCAB_SIZE - 4, "video_token_id": VOCAB_SIZE - 3,
               "vision_start_token_id": VOCAB_SIZE - 2, "vision_end_token_id": VOCAB_SIZE - 1,
               "media_placeholder_token_id": VOCAB_SIZE - 4}
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              # like the real repository: remote-code config for transformers versions without Kimi-K2.5
              "auto_map": {"AutoConfig": "tiny_kimi_config.TinyKimiK25Config"},
              "text_config": text_config, "vision_config": _KIMI_VISION, "projection_hidden_size": 128,
              "tie_word_embeddings": False, "dtype": "float32", "torch_dtype": "float32", **special}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    # Image preprocessing: vLLM 0.3x uses its own (fused) processor from `media_proc_cfg`; older vLLM loads the
    # repository's remote-code processor through `auto_map` (the real Kimi-K2.5 ships one; HF's port needs
    # torchvision, which breaks next to a +cpu torch). Ours knows token counts only: extraction is text-only.
    with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
        json.dump({"media_proc_cfg": _KIMI_MEDIA_PROC,
                   "auto_map": {"AutoImageProcessor": "tiny_kimi_processor.TinyKimiK25ImageProcessor"}}, f, indent=1)
    with open(os.path.join(out_dir, "tiny_kimi_processor.py"), "w") as f:
        f.write(_KIMI_REMOTE_PROCESSOR)
    with open(os.path.join(out_dir, "tiny_kimi_config.py"), "w") as f:
        f.write(_KIMI_REMOTE_CONFIG)
    for name in os.listdir(text_dir):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            shutil.copy(os.path.join(text_dir, name), out_dir)
    open(os.path.join(out_dir, ".complete"), "w").close()
    return out_dir


FAMILIES = (*(f for f in TINY_CONFIGS if f != "deepseek_v3_plain_rope"), "kimi_k25")


def build_family(family: str) -> tuple[str, str, int]:
    """(checkpoint to run in vLLM, checkpoint with the same language-model weights for the HF reference,
    number of decoder layers) for any family, including the Kimi-K2.5 wrapper."""
    if family == "kimi_k25":
        return build_tiny_kimi_k25(), build_tiny_model("deepseek_v3"), TINY_CONFIGS["deepseek_v3"][2]["num_hidden_layers"]
    path = build_tiny_model(family)
    return path, path, TINY_CONFIGS[family][2]["num_hidden_layers"]


def hf_reference(model_dir: str, sequences: list[list[int]], layer_ids: list[int],
                 device: str = "cpu") -> list[list[Any]]:
    """Per sequence, per layer id: the residual stream leaving that layer, from HF transformers in float32.

    Layer i <= N-2 is `output_hidden_states[i+1]`; the last layer N-1 is the input of the final norm (HF's
    `hidden_states[N]` is after the norm), taken with a forward pre-hook on the norm.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, **_dtype_kwarg(torch.float32)).to(device)
    model.eval()
    if device != "cpu":  # a true fp32 reference: no TF32 matmuls
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    base = getattr(model, "model", model)
    n = model.config.get_text_config().num_hidden_layers
    norm_input: list[torch.Tensor] = []
    handle = base.norm.register_forward_pre_hook(lambda mod, args: norm_input.append(args[0].detach().clone()))
    out = []
    try:
        with torch.no_grad():
            for ids in sequences:
                norm_input.clear()
                res = model(torch.tensor([ids], device=device), output_hidden_states=True)
                hs = res.hidden_states
                out.append([(norm_input[-1][0] if i == n - 1 else hs[i + 1][0]).float().cpu() for i in layer_ids])
    finally:
        handle.remove()
    return out
