"""The bf16 criterion (check.py) must be able to fail on each family the matrix judges in bf16 (its `shim` cells):
HF's own bf16 forward stands in for a correct engine, and a capture whose last token of each sequence comes from
the neighbouring layer stands in for the subtlest wrong one. A MoE model with a random router loosens the limits
(HF's own bf16 forward picks other experts than fp32 for some tokens), so tiny MoE checkpoints fix their routers'
choice (tiny_models: DeepSeek's noaux_tc bias, gpt-oss's router bias; Qwen3-MoE's routes every token to all its
experts); without that, this capture passed on gpt-oss. No engine: HF references only."""
from __future__ import annotations

import pytest

from eagle_compat import check, tiny_models
from eagle_compat.capture.families import TINY

from helpers import prompts

# the families with bf16 (shim) cells in the matrix, MoE and dense
FAMILIES = [f for f in ("llama", "gpt_oss", "deepseek_v3", "qwen3_moe") if f in TINY]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_capture_wrong_on_the_last_token_fails_the_bf16_criterion_at_every_layer(family):
    path = tiny_models.build_tiny_model(family)
    layers = list(range(tiny_models.num_layers(family)))
    batch = prompts(4, 40, 90)
    ref = tiny_models.hf_reference(path, batch, layers)
    low = tiny_models.hf_reference(path, batch, layers, dtype="bfloat16")
    correct = [{"hidden_states": [t.float() for t in seq]} for seq in low]
    assert all(e.ok for e in check.compare(correct, ref, layers, "bf16", low)), family

    def last_token_from_the_neighbour(seq):
        out = []
        for j, t in enumerate(seq):
            t = t.float().clone()
            t[-1] = seq[j - 1 if j else j + 1][-1].float()
            out.append(t)
        return {"hidden_states": out}

    wrong = [last_token_from_the_neighbour(seq) for seq in low]
    judged = check.compare(wrong, ref, layers, "bf16", low)
    assert not any(e.ok for e in judged), [(e.layer_id, e.worst_token, e.limits()) for e in judged if e.ok]


@pytest.mark.parametrize("family", [f for f in ("gemma2", "gemma3", "gpt_oss") if f in TINY])
def test_the_tiny_models_sliding_windows_change_the_states_of_the_family_prompts(family, tmp_path):
    """tests/test_families.py's prompts (up to 90 tokens) run past the tiny checkpoints' sliding window (32): HF's
    own forward with the window removed fails the fp32 criterion at every layer, so an engine that ignored the
    window would fail the family parity there too."""
    import json
    import os
    import shutil
    path = tiny_models.build_tiny_model(family)
    for name in os.listdir(path):
        shutil.copy(os.path.join(path, name), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["sliding_window"] < 90
    (tmp_path / "config.json").write_text(json.dumps({**config, "sliding_window": 4096}))
    layers = list(range(tiny_models.num_layers(family)))
    batch = prompts(4, 10, 90, seed=11)  # test_families' batch
    without_window = [{"hidden_states": seq} for seq in tiny_models.hf_reference(str(tmp_path), batch, layers)]
    judged = check.compare(without_window, tiny_models.hf_reference(path, batch, layers), layers, "fp32")
    assert not any(e.ok for e in judged), [(e.layer_id, e.max_abs) for e in judged if e.ok]


@pytest.mark.parametrize("family", [f for f in ("gemma2", "gemma3", "gpt_oss") if f in TINY])
def test_the_tiny_models_global_layers_are_judged_too(family, tmp_path):
    """Each tiny checkpoint of a sliding-window family mixes windowed and global layers (an earlier tiny Gemma 3 had
    four windowed ones only, so no release's global Gemma 3 layer was compared with it): HF's own forward with
    every layer windowed passes the fp32 criterion before the first global layer (the control: the copy changed
    nothing else) and fails it from there on. (In Gemma 3 a layer's kind also picks its RoPE base, as in vLLM's
    gemma3.py, so an engine mistaking a global layer for a windowed one gets both wrong.)"""
    import json
    import os
    import shutil
    path = tiny_models.build_tiny_model(family)
    config = json.loads(open(os.path.join(path, "config.json")).read())
    kinds = config["layer_types"]
    assert {"sliding_attention", "full_attention"} <= set(kinds), kinds
    first_global = kinds.index("full_attention")
    for name in os.listdir(path):
        shutil.copy(os.path.join(path, name), tmp_path)
    all_windowed = {**config, "layer_types": ["sliding_attention"] * len(kinds)}
    if "sliding_window_pattern" in config:
        all_windowed["sliding_window_pattern"] = len(kinds) + 1
    (tmp_path / "config.json").write_text(json.dumps(all_windowed))
    assert first_global > 0  # a windowed layer before it is the control
    layers = list(range(tiny_models.num_layers(family)))
    batch = prompts(4, 10, 90, seed=11)  # test_families' batch
    windowed = [{"hidden_states": seq} for seq in tiny_models.hf_reference(str(tmp_path), batch, layers)]
    judged = check.compare(windowed, tiny_models.hf_reference(path, batch, layers), layers, "fp32")
    assert [e.ok for e in judged] == [i < first_global for i in layers], [(e.layer_id, e.max_abs) for e in judged]
