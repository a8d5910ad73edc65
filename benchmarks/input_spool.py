"""What a `--resume` pays to know its samples: the input read and tokenized again (`inputs.read_dataset`, what every
resume did before) against the tokenized input read back from --out's spool (`spool.load`), in one process, one after
the other on the same input; and what the first run pays to write the spool (`spool.save`). Conversations go through
the tiny Llama's tokenizer and chat template (the case a real input is); pre-tokenized lines isolate the JSON parse.

usage: python benchmarks/input_spool.py [--conversations 20000] [--token-lines 100000] [--out FILE.json] [--smoke]
--smoke: 32 conversations and 200 lines (seconds; CI: tests/test_benchmark_smoke.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

WORDS = [f"w{k}" for k in range(400)]


def write_conversations(path: str, n: int, rng: random.Random) -> None:
    with open(path, "w") as f:
        for _ in range(n):
            turns = []
            for _ in range(rng.randrange(1, 4)):
                turns.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randrange(20, 80)))})
                turns.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randrange(40, 160)))})
            f.write(json.dumps({"conversations": turns}) + "\n")


def write_token_lines(path: str, n: int, rng: random.Random) -> None:
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"input_ids": [rng.randrange(3, 500) for _ in range(256)]}) + "\n")


def measure(kind: str, path: str, tokenizer, model: str, out_dir: str) -> dict:
    from eagle_compat.extract import file_hashes, inputs, spool
    started = time.monotonic()
    data = inputs.read_dataset(path, tokenizer, 4096, vocab_size=512)
    tokenized_s = time.monotonic() - started
    key = spool.key(file_hashes.file_sha256(path), model, tokenizer, {"max_len": 4096})
    started = time.monotonic()
    spool.save(out_dir, key, data)
    save_s = time.monotonic() - started
    started = time.monotonic()
    back = spool.load(out_dir, key)
    load_s = time.monotonic() - started
    # the spool's samples are read from --out as they are asked for (spool.Samples), a list's equal item by item
    same = (list(back.samples) == list(data.samples)
            and dataclasses.replace(back, samples=[]) == dataclasses.replace(data, samples=[]))
    assert same, "the spool did not give back what was read"
    return {"input": kind, "samples": len(data.samples), "tokens": sum(len(s.input_ids) for s in data.samples),
            "input_mib": round(os.path.getsize(path) / 2**20, 1),
            "spool_mib": round(os.path.getsize(os.path.join(out_dir, spool.SPOOL_FILE)) / 2**20, 1),
            "read_and_tokenize_s": round(tokenized_s, 2), "spool_save_s": round(save_s, 2),
            "spool_load_s": round(load_s, 2), "load_over_tokenize": round(load_s / tokenized_s, 3)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=20000)
    ap.add_argument("--token-lines", type=int, default=100000)
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true", help="32 conversations and 200 lines: seconds")
    a = ap.parse_args()
    if a.smoke:
        a.conversations, a.token_lines = 32, 200
    from transformers import AutoTokenizer

    from eagle_compat import tiny_models
    model = tiny_models.build_tiny_model("llama")
    tokenizer = AutoTokenizer.from_pretrained(model)
    rng = random.Random(0)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, n, write in (("conversations", a.conversations, write_conversations),
                               ("pre-tokenized lines of 256 ids", a.token_lines, write_token_lines)):
            path = os.path.join(tmp, f"{kind[:4]}.jsonl")
            write(path, n, rng)
            out_dir = os.path.join(tmp, f"out-{kind[:4]}")
            os.makedirs(out_dir)
            results.append(measure(kind, path, tokenizer, model, out_dir))
            print(results[-1], flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"results": results, "python": sys.version.split()[0]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
