"""Shared test helpers: deterministic prompts and the precision-aware comparison against the HF reference."""
from __future__ import annotations

import random

import torch

# A layer's error is judged in the precision the engine ran: bf16 within 5e-2 of the layer's largest |value|;
# fp32 within 1e-4 absolute.
BF16_REL_TOL = 5e-2
FP32_ABS_TOL = 1e-4


def prompts(n: int, lo: int, hi: int, vocab: int = 512, seed: int = 0, prefix: list[int] | None = None):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        body = [rng.randrange(7, vocab) for _ in range(length)]
        out.append((prefix or []) + body)
    return out


def write_dataset(path, n: int, lo: int, hi: int, seed: int, conversations_every: int = 4) -> str:
    """A JSONL input for extract: pre-tokenized samples with loss masks, and every `conversations_every`-th line a
    conversation (0: none)."""
    import json
    with open(path, "w") as f:
        for k, ids in enumerate(prompts(n, lo, hi, seed=seed)):
            if conversations_every and k % conversations_every == 0:
                f.write(json.dumps({"conversations": [
                    {"role": "user", "content": " ".join(f"w{t}" for t in ids[:10])},
                    {"role": "assistant", "content": " ".join(f"w{t}" for t in ids[10:30])}]}) + "\n")
            else:
                f.write(json.dumps({"input_ids": ids, "loss_mask": [int(i % 3 == 0) for i in range(len(ids))]}) + "\n")
    return str(path)


def max_errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[tuple[float, float]]:
    """Per layer: (max abs error, the reference layer's max |value|)."""
    out = []
    for g, w in zip(got, want):
        assert g.shape == w.shape, (g.shape, w.shape)
        out.append(((g.float() - w.float()).abs().max().item(), w.abs().max().item()))
    return out


def assert_close_to_reference(results, reference, *, precision: str, layer_ids=None):
    """Every sequence, every layer, within the tolerance of the precision the engine ran in."""
    worst = {}
    for seq_no, (res, ref) in enumerate(zip(results, reference, strict=True)):
        for j, (err, scale) in enumerate(max_errors(res["hidden_states"], ref)):
            tol = FP32_ABS_TOL if precision == "fp32" else BF16_REL_TOL * scale
            lid = layer_ids[j] if layer_ids else j
            worst[lid] = max(worst.get(lid, 0.0), err / (scale if precision != "fp32" else 1.0))
            assert err <= tol, (f"sequence {seq_no}, layer {lid}: max abs error {err:.3g} > {tol:.3g} "
                                f"({precision}; layer max |value| {scale:.3g})")
    return worst
