"""speculators 0.3.0 plans its KV cache as one group: `unify_hybrid_kv_cache_specs` (every sliding-window layer
promoted to full attention) and then `_get_kv_cache_groups_uniform_spec`. vLLM's own engine plans a model that mixes
sliding-window and full layers (gpt-oss, Gemma 2, Gemma 3) with its hybrid KV-cache manager instead, wherever
VllmConfig turns it on (CUDA and CPU; not with chunked local attention or a KV connector that lacks it), and the one
group breaks three ways:
  * 0.25-0.26: the promotion keeps the local layers' own block size, "failed to convert the KV cache specs to one
    unified type" (CPU);
  * 0.24-0.27 on CUDA: the promotion drops `indexes_kv_by_block_stride`, which the runner set on every layer, and the
    merge fails: "AssertionError: All attention layers in the same KV cache group must have the same attention spec";
  * 0.25-0.27 on CUDA, silent: FlashAttention takes the attention window from the group's spec for every layer in
    the group, so the full-attention layers attend within the window (tiny gpt-oss / Gemma on an H100, 0.26.0:
    layer 1's states off by 0.12-0.18 of their norm at the median).
At speculators' call site the two calls become one plan made as vLLM's engine makes it
(kv_cache.plan_kv_cache_groups): vLLM's `get_kv_cache_groups` where the hybrid manager is on and the layers differ,
else speculators' unify-and-one-group with the fixes above.
"""
from __future__ import annotations

from ._adapters import BuiltExecutors
from ._base import GENERATOR_MODULE, PatchUnit


def _apply(patcher, module) -> None:
    from .. import engine

    # speculators passes the specs alone; the config is that of the executor it built just before (the unit keeps
    # its own record of them, as kv_cache_config_helpers does)
    executors = BuiltExecutors()
    patcher.hook_executor(module, "MultiprocExecutor", executors.hooks())

    def unify(wrapped, instance, args, kwargs):
        return None  # planned with the groups below, from the specs as the workers reported them

    def groups(wrapped, instance, args, kwargs):
        spec = args[0] if args else kwargs["kv_cache_specs"]
        executor = executors.last()
        config = getattr(executor, "vllm_config", None)
        if executor is not None and config is not None:
            # 0.29+: vLLM's planning reads the KV layout, which speculators has the helpers publish only after it
            engine.kv_cache.publish_kv_cache_layout(config, executor, [spec])
        return engine.kv_cache.plan_kv_cache_groups(config, spec)

    patcher.wrap(module, "unify_hybrid_kv_cache_specs", unify)
    patcher.wrap(module, "_get_kv_cache_groups_uniform_spec", groups)


UNIT = PatchUnit(
    name="kv_cache_groups_as_vllm",
    broke="speculators' one unified KV-cache group fails for models mixing sliding-window and full layers (0.25-0.26 "
          "ValueError; CUDA 0.24-0.27 AssertionError) or, on CUDA 0.25-0.27, applies the window to every layer",
    affects=">=0.24,<0.28",
    condition="the model mixes sliding-window and full-attention layers, and VllmConfig turns vLLM's hybrid KV-cache "
              "manager on (as for vllm serve)",
    silent=True,
    delete_when="speculators plans its KV cache with vLLM's get_kv_cache_groups",
    target=GENERATOR_MODULE,
    sides=("driver",),
    feature="kv_cache_groups_differ_from_one_group",
    apply=_apply,
)
