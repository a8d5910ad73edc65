"""A 90%-done `extract --resume`: how long until its first batch starts, with the directory's index (the default),
without it (every kept file opened and compared, as before the index), and with --verify-kept ("verify kept": every kept file
opened, on 8 threads); and the driver's peak RSS. The stand-in engine (`eagle_compat.testing`, the tests' one)
writes bf16 states of the tiny Llama's shape (so the files are real sample files, checked as real ones are); no vLLM
engine starts. Each measurement runs in a fresh process; the ratios are of one run on one machine.

usage: python benchmarks/resume_index.py [--samples 20000] [--out benchmarks/results/resume-index.json] [--smoke]
--smoke: every measurement on 64 samples, the result in a temporary folder (CI: tests/test_benchmark_smoke.py).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from eagle_compat.testing import StandInEngine  # noqa: E402 - after the path above

LAYERS = [0, 5]


class FirstBatchTimed(StandInEngine):
    """The stand-in engine (the tests' one), noting when the run's first batch reaches it."""
    first_batch_at: float | None = None

    def generate(self, token_ids, **kwargs):
        if FirstBatchTimed.first_batch_at is None:
            FirstBatchTimed.first_batch_at = time.monotonic()
        return super().generate(token_ids, **kwargs)


def child(model: str, data: str, out: str, mode: str) -> None:
    """One run in this process: prints its timings and peak RSS as JSON."""
    import eagle_compat.generator
    from eagle_compat.extract import job, kept_files, writer, written_index
    eagle_compat.generator.VllmHiddenStatesGenerator = FirstBatchTimed
    # the kept-file check on its own, the index's vouching included (the rest of the start is the same in every mode:
    # imports, tokenizer, model hashes)
    check = {"seconds": 0.0, "files_opened": 0}
    first_mismatch, read_facts = writer.first_mismatch, writer.read_facts

    def timed_first_mismatch(*args, **kwargs):
        t0 = time.monotonic()
        try:
            return first_mismatch(*args, **kwargs)
        finally:
            check["seconds"] += time.monotonic() - t0

    def counted_read_facts(path):
        check["files_opened"] += 1
        return read_facts(path)
    trusted_by_index = written_index.trusted_by_index

    def timed_trusted_by_index(*args, **kwargs):  # the index's own cost: a stat and a digest per kept file
        t0 = time.monotonic()
        try:
            return trusted_by_index(*args, **kwargs)
        finally:
            check["seconds"] += time.monotonic() - t0
    read_index = kept_files.read_index

    def timed_read_index(*args, **kwargs):  # the index read whole, each kept file's line checked (a stat, a digest)
        t0 = time.monotonic()
        try:
            return read_index(*args, **kwargs)
        finally:
            check["seconds"] += time.monotonic() - t0
    writer.first_mismatch, writer.read_facts = timed_first_mismatch, counted_read_facts
    written_index.trusted_by_index, kept_files.read_index = timed_trusted_by_index, timed_read_index
    if mode == "without index":
        os.unlink(os.path.join(out, written_index.INDEX_FILE))
    started = time.monotonic()
    summary = job.run(job.ExtractOptions(model=model, data=data, out=out, layers=LAYERS, batch_size=16,
                                         dtype="bfloat16", progress=False, quiet=True, resume=mode != "first run",
                                         verify_kept=mode == "verify kept"))
    first = FirstBatchTimed.first_batch_at
    print(json.dumps({"mode": mode, "to_first_batch_s": round(first - started, 2) if first else None,
                      "total_s": round(time.monotonic() - started, 2), "written": summary["written_this_run"],
                      "kept_check_s": round(check["seconds"], 3), "files_opened": check["files_opened"],
                      "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "resume-index.json"))
    ap.add_argument("--smoke", action="store_true", help="64 samples, the result in a temporary folder (seconds)")
    ap.add_argument("--child", nargs=4, metavar=("MODEL", "DATA", "OUT", "MODE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(*a.child)
    from eagle_compat import tiny_models
    from eagle_compat.extract import writer
    model = tiny_models.build_tiny_model("llama")
    work = tempfile.mkdtemp(prefix="eagle-compat-bench-")
    if a.smoke:
        a.samples, a.out = 64, os.path.join(work, "resume-index.json")
    try:
        rng = random.Random(0)
        data = os.path.join(work, "data.jsonl")
        with open(data, "w") as f:
            for _ in range(a.samples):
                f.write(json.dumps({"input_ids": [rng.randrange(3, 512) for _ in range(rng.randrange(16, 49))]})
                        + "\n")
        master = os.path.join(work, "done")

        def run(out: str, mode: str) -> dict:
            proc = subprocess.run([sys.executable, __file__, "--child", model, data, out, mode], capture_output=True,
                                  text=True, check=True)
            return json.loads(proc.stdout.strip().splitlines()[-1])

        rows = [run(master, "first run")]
        shutil.rmtree(master)
        for mode in ("with index", "without index", "verify kept"):
            # each mode's set written by a run of its own: a copy has other inodes and change times, which the index
            # records (a file replaced in place must not be vouched for), so it would vouch for none of a copy's files
            out = os.path.join(work, mode.replace(" ", "-").strip("-"))
            run(out, "first run")
            files = writer.sample_files(out)
            removed = files[int(len(files) * 0.9):]  # the last tenth of the set: a run killed at 90%
            for name in removed:
                os.unlink(os.path.join(out, name))
            rows.append({**run(out, mode), "kept_files": len(files) - len(removed)})
            shutil.rmtree(out)
        base = next(r for r in rows if r["mode"] == "without index")
        for r in rows[1:]:
            r["to_first_batch_vs_without_index"] = round(r["to_first_batch_s"] / base["to_first_batch_s"], 3)
            r["kept_check_vs_without_index"] = round(r["kept_check_s"] / max(base["kept_check_s"], 1e-9), 4)
        from eagle_compat import cpu
        result = {"samples": a.samples, "layers": LAYERS, "rows": rows, "cpu": cpu.this_cpu().model,
                  "cores": len(os.sched_getaffinity(0)), "date": time.strftime("%Y-%m-%d")}
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps(result, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
