"""Shared test helpers: deterministic prompts and the precision-aware comparison against the HF reference."""
from __future__ import annotations

import random

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


def assert_matches_hf(results, reference_model: str, batch, layer_ids, *, precision: str) -> dict:
    """Every layer within eagle_compat.check's criterion (fp32: absolute; bf16: against HF's own bf16 error on the
    same tokens, median and p95 of the per-token error). Returns the worst relative error per layer id."""
    from eagle_compat import check
    layers = check.judge(results, reference_model, batch, list(layer_ids), precision)
    bad = [check.describe_failure(e, precision) for e in layers if not e.ok]
    assert not bad, "\n".join(bad)
    return {e.layer_id: (e.max_abs if precision == "fp32" else e.max_rel_to_layer_max) for e in layers}
