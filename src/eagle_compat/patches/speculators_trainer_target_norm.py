"""speculators 0.3.0's trainer learns the wrong next-token distribution, with no error.

Its drafter's training target is the verifier's `lm_head` over the verifier's last hidden state
(`Eagle3DraftModel.forward`, core.py L328 at v0.3.0), and the states its data generation saves (and eagle_compat's,
in the same convention) are taken *before* the final norm: the target skips the norm the verifier applies before its
`lm_head`. speculators fixed it after 0.3.0 (commit a54a7283, speculators#313: `verifier_lm_head(verifier_norm(h))`).
Measured on SmolLM2-135M-Instruct: the unnormed target's top token is the verifier's own next token on 10% of loss
tokens, and a drafter trained by 0.3.0's trainer on the H200 had 0.12 tokens accepted per draft
(benchmarks/results/h200-training-proof-vllm-0.20.0-run1.json, docs/training-proof.md).

Applied when `speculators.models.eagle3.core` is imported: after the drafter loads the verifier's `lm_head`, the
verifier's final norm (its RMSNorm weight from the same checkpoint, the config's epsilon) is applied to the input of
that `lm_head` by a forward pre-hook, as speculators#313 does; the weight is a non-persistent buffer, so checkpoints are
unchanged. A verifier whose norm is not `weight * x / rms(x)` is refused by name rather than trained wrong.
uninstall() restores speculators' method; a drafter built while installed keeps its hook (it is that training's).
Like speculators#313, the norm applies to the last state of every data format the trainer reads, v0's `target` included: v0
files must hold the state before the final norm, as speculators' own generator and `extract` write it (HF's
`output_hidden_states[-1]` is after it on Llama-style models: normed twice, a wrong target).
"""
from __future__ import annotations

from ._base import PatchUnit

TARGET = "speculators.models.eagle3.core"
NORM_KEY = "model.norm.weight"
# verifier families whose final norm is `weight * x * rsqrt(mean(x^2) + eps)` (Gemma's `1 + weight` is not)
RMS_NORM_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                                  "deepseek_v2", "deepseek_v3", "kimi_k2", "granite", "olmo2", "phi3",
                                  "gpt_oss"})
BUFFER = "eagle_compat_verifier_norm_weight"


def normed_lm_head_input(module, args):
    """Forward pre-hook on the verifier's lm_head: its input through the verifier's final RMSNorm (in fp32)."""
    (hidden,) = args
    import torch
    h = hidden.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.eagle_compat_verifier_norm_eps)
    return (getattr(module, BUFFER) * h.to(hidden.dtype),)  # in LlamaRMSNorm's order: normalize, cast, scale


def _attach_verifier_norm(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    from transformers import AutoConfig

    from ..errors import IncompatibleEnvironment

    config = args[0] if args else kwargs["config"]  # the VerifierConfig
    verifier = AutoConfig.from_pretrained(config.name_or_path)
    text = verifier.get_text_config() if hasattr(verifier, "get_text_config") else verifier
    if text.model_type not in RMS_NORM_MODEL_TYPES:
        raise IncompatibleEnvironment(
            f"speculators_trainer_target_norm: the verifier's model type {text.model_type!r} is not one whose final "
            f"norm eagle_compat applies to the training target ({sorted(RMS_NORM_MODEL_TYPES)}); speculators 0.3.0 "
            "would train against logits without it. Use a newer speculators trainer, or set "
            "EAGLE_COMPAT_DISABLE=speculators_trainer_target_norm to train 0.3.0's way knowingly.")
    core = __import__(TARGET, fromlist=["load_model_layers"])
    try:
        weights = core.load_model_layers([NORM_KEY], config.name_or_path)
    except ValueError:  # a sharded checkpoint whose index lacks the key
        weights = {}
    if NORM_KEY not in weights:
        raise IncompatibleEnvironment(f"speculators_trainer_target_norm: {NORM_KEY!r} is not in the verifier's "
                                      f"checkpoint {config.name_or_path}; cannot apply its final norm to the target")
    head = instance.verifier_lm_head
    head.register_buffer(BUFFER, weights[NORM_KEY].detach().clone(), persistent=False)
    head.eagle_compat_verifier_norm_eps = float(text.rms_norm_eps)
    head.register_forward_pre_hook(normed_lm_head_input)
    return result


def _apply(patcher, module) -> None:
    patcher.wrap(module.Eagle3DraftModel, "_setup_embeddings_and_lm_heads", _attach_verifier_norm)


UNIT = PatchUnit(
    name="speculators_trainer_target_norm",
    needs_vllm=False,
    broke="speculators 0.3.0's trainer computes its target logits without the verifier's final norm (fixed "
          "upstream in speculators#313): the drafter learns another distribution than the verifier's",
    affects="",
    condition="speculators whose Eagle3DraftModel target skips the verifier's final norm (0.3.0); any vLLM",
    delete_when="the speculators floor includes speculators#313 (the trainer applies verifier_norm itself)",
    target=TARGET,
    sides=("driver",),
    silent=True,
    feature="speculators_target_skips_final_norm",
    apply=_apply,
)
