"""speculators feeds token ids only, yet vLLM builds and profiles a multimodal wrapper's towers (Kimi-K2.5's
MoonViT, Gemma-3's SigLIP …): GPU memory and start-up time spent on weights that never run, a profiling pass on
a dummy multi-frame video, and on CPU the repository's image processor must work for that pass. At speculators'
ModelConfig call site we ask for the language model alone (`language_model_only`, or zero media per prompt on
releases without it). Text-only models are unaffected.
"""
from __future__ import annotations

from ..engine import keywords
from ._base import keyword_rewrite_unit

UNIT = keyword_rewrite_unit(
    constructor="ModelConfig", feature="model_config_takes_text_only_options", rewrite=keywords.text_only,
    name="text_only_model",
    broke="multimodal wrappers (Kimi-K2.5) build and profile vision towers speculators never uses",
    affects=">=0.11",
    delete_when="speculators builds its ModelConfig text-only",
)
