"""What the completion check costs: the run that completes a set reads every other shard's sample file (headers,
token ids and loss mask; no states) one at a time. This writes a set of sample files per format with extract's own
writer, then times `check_whole_set` over all of them, with the files dropped from the page cache (as on a set
copied in from other machines) and again warm, as a ratio to the time their writing took in the same run (the
median of --repeats such pairs). Cold means the files' data only: directory and inode caches stay warm, and the
files lie where they were just written, one after another.

usage: python benchmarks/completion_check.py --dir /tmp/cc --out result.json [--samples 64 --tokens 1024
       --layers 4 --hidden 4096] [--formats pt,safetensors,arrow] [--pool 8]
No vLLM: the files hold random bf16 states of the given shape. --pool N also times the same per-file check N files
at a time from threads (a trial: extract reads one at a time; on the 2-core CPU machine threads gained nothing:
benchmarks/results/cpu-completion-check-8b-shape-thread-pool-tried.json; docs/performance.md, "The completion
check").
--smoke: 4 samples of 16 tokens, 2 layers of 64, every format, one repeat, --pool 2, in a temporary folder (seconds;
CI: tests/test_benchmark_smoke.py)."""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import shutil
import statistics
import tempfile
import time

import torch

from eagle_compat.extract import formats, writer


def _drop_from_page_cache(paths: list[str]) -> bool:
    """Ask the kernel to forget the files' pages (no root needed); False where it cannot be asked."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def measure(fmt_name: str, root: str, samples: int, tokens: int, layers: int, hidden: int,
            repeats: int, pool: int = 0) -> dict:
    fmt = formats.get(fmt_name)
    out = os.path.join(root, fmt_name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    stamp = writer.states_stamp({"model_checksums": {"bench": 1}, "layer_ids": list(range(layers)), "dtype": "bf16"})
    gen = torch.Generator().manual_seed(0)
    placed, paths = [], []
    states = [torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16) for _ in range(layers)]
    write_s = 0.0
    for index in range(samples):
        ids = torch.randint(0, 32000, (tokens,), generator=gen)
        mask = torch.ones(tokens, dtype=torch.long)
        start = time.perf_counter()
        paths.append(fmt.save(out, index, index, ids, mask, states, list(range(layers)), stamp))
        write_s += time.perf_counter() - start
        placed.append((index, index, ids.tolist(), mask.tolist(), f"sample {index}"))
    expected = writer.StatesExpected(stamp, layers, hidden, "torch.bfloat16")
    cold_runs, warm_runs, cold = _time_pairs(paths, repeats, lambda: fmt.check_whole_set(out, placed, expected))
    cold_s, warm_s = statistics.median(cold_runs), statistics.median(warm_runs)
    file_mib = sum(map(os.path.getsize, paths)) / samples / 2**20
    row = {"format": fmt_name, "samples": samples, "file_mib": round(file_mib, 2),
           "write_s": round(write_s, 3), "repeats": repeats,
           "check_cold_s_runs": [round(x, 3) for x in cold_runs] if cold else None,
           "check_warm_s_runs": [round(x, 3) for x in warm_runs],
           "check_cold_ms_per_file": round(cold_s / samples * 1e3, 2) if cold else None,
           "check_warm_ms_per_file": round(warm_s / samples * 1e3, 2),
           "check_cold_over_write": round(cold_s / write_s, 4) if cold else None,
           "check_warm_over_write": round(warm_s / write_s, 4)}
    if pool:  # the same per-file check, `pool` files at a time from threads (not what extract does: a trial)
        items = [fmt.expected(out, *p) for p in placed]

        def pooled():
            with concurrent.futures.ThreadPoolExecutor(pool) as ex:
                found = [m for m in ex.map(lambda item: writer.first_mismatch([item], expected), items) if m]
            assert not found, found[0]
        p_cold, p_warm, _ = _time_pairs(paths, repeats, pooled)
        row[f"pool_{pool}"] = {"check_cold_ms_per_file": round(statistics.median(p_cold) / samples * 1e3, 2),
                               "check_warm_ms_per_file": round(statistics.median(p_warm) / samples * 1e3, 2),
                               "cold_over_one_at_a_time": round(statistics.median(p_cold) / cold_s, 3)}
    shutil.rmtree(out)
    return row


def _time_pairs(paths: list[str], repeats: int, check) -> tuple[list[float], list[float], bool]:
    """`repeats` pairs of a cold check (the files' data dropped first) and a warm one (a shared machine: medians)."""
    cold_runs, warm_runs, cold = [], [], False
    for _ in range(repeats):
        cold = _drop_from_page_cache(paths)
        start = time.perf_counter()
        check()
        cold_runs.append(time.perf_counter() - start)
        start = time.perf_counter()
        check()
        warm_runs.append(time.perf_counter() - start)
    return cold_runs, warm_runs, cold


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", help="required unless --smoke")
    parser.add_argument("--out", help="required unless --smoke")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--formats", default="pt,safetensors,arrow")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pool", type=int, default=0, help="also time the reads N at a time from threads (a trial)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes in a temporary folder: seconds")
    args = parser.parse_args()
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="completion-check-") as tmp:
            args.dir, args.out = args.dir or os.path.join(tmp, "sets"), args.out or os.path.join(tmp, "result.json")
            args.samples, args.tokens, args.layers, args.hidden, args.repeats, args.pool = 4, 16, 2, 64, 1, 2
            return run(args)
    if not (args.dir and args.out):
        parser.error("--dir and --out are required (or --smoke)")
    run(args)


def run(args: argparse.Namespace) -> None:
    rows = [measure(f, args.dir, args.samples, args.tokens, args.layers, args.hidden, args.repeats,
                    args.pool)
            for f in args.formats.split(",")]
    result = {"what": "completion check (formats.check_whole_set) over a set's files, as a ratio to writing them",
              "shape": {"tokens": args.tokens, "layers": args.layers, "hidden": args.hidden, "dtype": "bfloat16"},
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
              "torch": torch.__version__, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
