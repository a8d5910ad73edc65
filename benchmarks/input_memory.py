"""The driver's memory for the tokenized input: `extract/inputs.read_dataset` over N pre-tokenized lines, in a fresh
process, peak RSS above the process's RSS after its imports, and the time the read took. `--src` picks the source
tree (a checkout of an earlier commit, to compare). Pre-tokenized lines isolate the storage of the samples from the
chat template's work.

usage: python benchmarks/input_memory.py [--src src] [--samples 25000,100000] [--tokens 256] [--out FILE.json] [--smoke]
--smoke: 200 and 400 lines of 16 ids (seconds; CI: tests/test_benchmark_smoke.py).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
from eagle_compat.extract import inputs

def rss_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

base = rss_kib()
started = time.monotonic()
data = inputs.read_dataset(sys.argv[2], None, 10**6, vocab_size=200_000)
seconds = time.monotonic() - started
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
tokens = sum(len(s.input_ids) for s in data.samples)
print(json.dumps({"samples": len(data.samples), "tokens": tokens, "read_s": round(seconds, 2),
                  "rss_after_imports_mib": round(base / 1024, 1), "peak_above_imports_mib": round((peak - base) / 1024, 1),
                  "bytes_per_token": round((peak - base) * 1024 / tokens, 1)}))
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default=os.path.join(os.path.dirname(HERE), "src"))
    ap.add_argument("--samples", default="25000,100000")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true", help="200 and 400 lines of 16 ids: seconds")
    a = ap.parse_args()
    if a.smoke:
        a.samples, a.tokens = "200,400", 16
    rng = random.Random(0)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in a.samples.split(",")):
            path = os.path.join(tmp, f"data-{n}.jsonl")
            with open(path, "w") as f:
                for _ in range(n):
                    f.write(json.dumps({"input_ids": [rng.randrange(3, 150_000) for _ in range(a.tokens)]}) + "\n")
            out = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(a.src), path], check=True,
                                 capture_output=True, text=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
            print(results[-1], flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"src": a.src, "tokens_per_sample": a.tokens, "runs": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
