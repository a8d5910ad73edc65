"""A large job's driver, measured where it matters to a GPU bill: how long `eagle-compat extract` takes to start its
first batch, and how much memory its driver holds by then, for a new set and for a `--resume` of a set 90% done;
at two input sizes (100,000 and 1,000,000 pre-tokenized lines by default), so that what grows with the input shows.

The engine is the stand-in of `eagle_compat.testing`, the tests' own (no GPU, no vLLM start: the driver's own work
is what is measured); each measurement runs in a fresh process that stops at its first batch. The 90%-done set is made the way a killed run leaves one as far as
a resume can see: the first run's files of its first batches, then, for the other batches up to 90%, a file per
sample and its line in the directory's index (size, modification time, token digest, stamp) as the writer records
them; a resume trusts what the index vouches for without opening it, so the files' bytes are not read. The resume is
measured with the tokenized input kept in `--out` (`.eagle-compat-input.bin`) and without it (every resume before).

usage: python benchmarks/million.py [--sizes 100000,1000000] [--tokens 64] [--conversations] [--out FILE.json]
       [--smoke]
--smoke: every measurement at 64 lines of 16 ids (or 64 conversations), seconds (CI: tests/test_benchmark_smoke.py).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
BATCH = 8  # extract's default batch size

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
model, data, out, resume = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "resume"
import torch  # noqa: F401 - imported before the baseline RSS, as in an engine's driver
import eagle_compat.generator
from eagle_compat.extract import job
from eagle_compat.testing import StandInEngine  # the tests' stand-in: states of the model's shape

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

def peak_rss_mib():
    # this process's own peak (VmHWM): ru_maxrss would carry the benchmark's parent's peak across the exec
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024

class FirstBatch(KeyboardInterrupt):
    pass

seen = {}

class StandIn(StandInEngine):
    def generate(self, batch, **kwargs):
        if "first_batch_s" not in seen:
            seen["first_batch_s"] = time.monotonic() - started
            seen["peak_rss_mib"] = peak_rss_mib()
        seen["batches"] = seen.get("batches", 0) + 1
        if seen["batches"] > int(os.environ.get("BENCH_BATCHES", "1")):
            raise FirstBatch()
        return super().generate(batch, **kwargs)

eagle_compat.generator.VllmHiddenStatesGenerator = StandIn
base = rss_mib()
started = time.monotonic()
try:
    job.run(job.ExtractOptions(model=model, data=data, out=out, layers=[0, 5], batch_size=8, dtype="bfloat16",
                               progress=False, resume=resume, quiet=True))
except KeyboardInterrupt:
    pass
print("BENCH " + json.dumps({**seen, "rss_after_imports_mib": round(base, 1)}))
"""


def child(model: str, data: str, out: str, phase: str, batches: int = 1) -> dict:
    env = {**os.environ, "BENCH_BATCHES": str(batches)}
    proc = subprocess.run([sys.executable, "-c", CHILD, SRC, model, data, out, phase], capture_output=True, text=True,
                          env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("BENCH ")]
    if not lines:
        raise SystemExit(f"{phase} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("BENCH "):])


def ninety_percent_done(out: str) -> int:
    """Files and index lines for the samples of the batches up to 90% of the set (beyond the first run's own)."""
    sys.path.insert(0, SRC)
    from eagle_compat.extract import spool, writer, written_index
    with open(os.path.join(out, spool.SPOOL_FILE), "rb") as f:
        key = spool.header_of(f)[0]["key"]
    data = spool.load(out, key)
    stamp = writer.stamp_of(json.load(open(os.path.join(out, writer.MANIFEST))))
    done = len(data.samples) // BATCH * 9 // 10 * BATCH
    lines = []
    for s in itertools.islice(data.samples, done):  # one at a time: this process's memory stays small
        path = writer.sample_path(out, s.index, "pt")
        if not os.path.exists(path):
            with open(path, "wb") as f:
                f.write(b"x")
        st = os.stat(path)
        lines.append(json.dumps({"i": s.index, "f": os.path.relpath(path, out), "n": st.st_size, "m": st.st_mtime_ns,
                                 "ino": st.st_ino, "c": st.st_ctime_ns,
                                 "d": written_index.tokens_digest(s.input_ids, s.loss_mask), "s": stamp},
                                separators=(",", ":")))
    with open(os.path.join(out, written_index.INDEX_FILE), "a") as f:
        f.write("\n".join(lines) + "\n")
    return done


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="100000,1000000")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out")
    ap.add_argument("--conversations", action="store_true",
                    help="lines are conversations (chat-templated and tokenized by the run); the resume without the "
                         "tokenized input is left out (about 0.6 ms a conversation to tokenize again)")
    ap.add_argument("--smoke", action="store_true", help="64 lines of 16 ids (or conversations): seconds")
    a = ap.parse_args()
    if a.smoke:
        a.sizes, a.tokens = "64", 16
    sys.path.insert(0, SRC)
    from eagle_compat import tiny_models
    model = tiny_models.build_tiny_model("llama")
    rng = random.Random(0)
    results = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        for n in (int(x) for x in a.sizes.split(",")):
            data, out = os.path.join(tmp, f"data-{n}.jsonl"), os.path.join(tmp, f"out-{n}")
            if a.conversations:
                from input_spool import write_conversations  # 1-3 turns of 20-160 words each
                write_conversations(data, n, rng)
            else:
                with open(data, "w") as f:
                    for _ in range(n):
                        f.write(json.dumps({"input_ids": [rng.randrange(3, 500) for _ in range(a.tokens)]}) + "\n")
            row = {"lines": n, "input_mib": round(os.path.getsize(data) / 2**20, 1),
                   **({"conversations": True} if a.conversations else {"tokens_per_line": a.tokens})}
            row["new_set"] = child(model, data, out, "first", batches=2)  # past 20,000 lines: read as batches run
            # a streamed run stopped early keeps no tokenized input: a resume reads the input whole and keeps it
            # (stopped at its first batch; not measured)
            child(model, data, out, "resume")
            started = time.monotonic()
            row["made_90_percent_done_files"] = ninety_percent_done(out)
            row["making_them_s"] = round(time.monotonic() - started, 1)
            row["resume_with_spool"] = child(model, data, out, "resume")
            if not a.conversations:  # (conversations: about ten minutes of tokenizing a million)
                os.unlink(os.path.join(out, ".eagle-compat-input.bin"))
                row["resume_tokenizing_again"] = child(model, data, out, "resume")
            results.append(row)
            print(json.dumps(row), flush=True)
            shutil.rmtree(out)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"results": results, "python": sys.version.split()[0]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
