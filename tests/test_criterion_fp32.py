"""The fp32 criterion's verdict and its failure message, on synthetic tensors (no engine, no HF): each token is
held to its own bound (FP32_ABS_TOL x its max |value| above 1), and a failure names the token over its bound, which
need not be the token with the largest absolute error (a large-valued token can carry more error within its own,
wider bound)."""
from __future__ import annotations

import torch

from eagle_compat import check


def _reference():
    ref = torch.ones(6, 8)
    ref[0] *= 1000.0  # an outlier token: bound 0.1
    return ref


def test_a_failure_names_the_token_over_its_own_bound_not_the_largest_absolute_error():
    ref = _reference()
    got = ref.clone()
    got[0, 0] += 0.05  # the largest absolute error, half its own bound
    got[4, 3] += 0.01  # a tenth of that, 100x its own bound (1e-4)
    (layer,) = check.compare([{"hidden_states": [got]}], [[ref]], [0], "fp32")
    assert not layer.ok
    assert (layer.sequence, layer.token) == (0, 4) and abs(layer.over_bound - 100) < 1
    assert layer.max_abs > 0.04  # the largest absolute error is still reported as such
    message = check.describe_failure(layer, "fp32")
    assert "sequence 0, token 4 is 100x its own bound" in message, message


def test_errors_within_each_tokens_bound_pass_and_report_the_nearest_token():
    ref = _reference()
    got = ref.clone()
    got[0, 0] += 0.05
    got[2, 1] += 8e-5
    (layer,) = check.compare([{"hidden_states": [ref]}, {"hidden_states": [got]}], [[ref], [ref]], [0], "fp32")
    assert layer.ok and (layer.sequence, layer.token) == (1, 2) and 0.7 < layer.over_bound < 0.9


def test_a_non_finite_reference_fails_rather_than_passes():
    ref = _reference()
    ref[3, 2] = float("nan")
    (layer,) = check.compare([{"hidden_states": [ref.clone()]}], [[ref]], [0], "fp32")
    assert not layer.ok
