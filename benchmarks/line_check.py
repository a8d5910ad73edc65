"""What the check of every input line before the engine starts costs (`inputs.check_lines`: UTF-8, JSON, each key
once, the keys and types a line needs, token ids inside the vocabulary; no tokenizer, no chat template), on a
generated input of short two-message conversations and one of pre-tokenized lines of 10-60 ids with their loss mask.
Each is checked twice; the faster run is reported.

usage: python benchmarks/line_check.py [--lines 1000000] [--dir DIR] [--out FILE.json] [--smoke]
--smoke: 500 lines of each (seconds; CI: tests/test_benchmark_smoke.py).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

WORDS = ["the", "a", "model", "token", "reply", "question", "answer", "data", "run", "line", "hello", "world"]


def write_conversations(path: str, n: int, rng: random.Random) -> None:
    def text(words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(words))
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"conversations": [{"role": "user", "content": text(rng.randint(5, 15))},
                                                  {"role": "assistant", "content": text(rng.randint(5, 25))}]}) + "\n")


def write_token_lines(path: str, n: int, rng: random.Random) -> None:
    with open(path, "w") as f:
        for _ in range(n):
            count = rng.randint(10, 60)
            f.write(json.dumps({"input_ids": [rng.randrange(7, 32000) for _ in range(count)],
                                "loss_mask": [int(i % 3 == 0) for i in range(count)]}) + "\n")


def measure(path: str) -> dict:
    from eagle_compat.extract import inputs
    runs = []
    for _ in range(2):
        started = time.perf_counter()
        lines = inputs.check_lines(path, 2048, vocab_size=32000)
        runs.append(round(time.perf_counter() - started, 2))
    return {"lines": lines, "bytes": os.path.getsize(path), "seconds": min(runs), "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--dir", default=None, help="where the inputs are written (default: a temporary folder)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true", help="500 lines of each: seconds")
    args = parser.parse_args()
    if args.smoke:
        args.lines = 500
    rng = random.Random(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        results = {}
        for kind, write in (("conversations", write_conversations), ("token_lines", write_token_lines)):
            path = os.path.join(folder, f"{kind}.jsonl")
            write(path, args.lines, rng)
            results[kind] = measure(path)
            print(kind, results[kind], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpu_count": os.cpu_count(), "python": sys.version.split()[0], **results}, f, indent=1)


if __name__ == "__main__":
    main()
