"""The physical limits extraction meets on a machine, torch only (no vLLM): GPU -> host copies (pinned and
pageable), host memcpy with 1/4/16 threads, torch.save + fsync to a local directory with 1 and 8 threads, and a
sequential O_DIRECT write. docs/performance.md compares what the 8B shape needs at plain speed with these.

usage: python benchmarks/machine_limits.py --dir /tmp/limits --out limits.json [--mib 1024]
On a machine without CUDA the GPU rows are left out (they say why).
--smoke: 8 MiB per measurement in a temporary folder (seconds; CI: tests/test_benchmark_smoke.py)."""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import mmap
import os
import platform
import shutil
import tempfile
import time

import torch


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2)


def _best_of(n: int, fn) -> float:
    """Fastest of n timed runs (a shared machine: the slowest says little)."""
    return min(fn() for _ in range(n))


def gpu_to_host(nbytes: int) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst in (("pinned", torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)),
                      ("pageable", torch.empty(nbytes, dtype=torch.uint8))):
        dst.copy_(src)  # warm-up: first touch of the pages
        torch.cuda.synchronize()

        def once():
            t = time.perf_counter()
            dst.copy_(src, non_blocking=(name == "pinned"))
            torch.cuda.synchronize()
            return time.perf_counter() - t
        out[name + "_gbps"] = _gbps(nbytes, _best_of(3, once))
    return out


def host_memcpy(nbytes: int, threads: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    chunks = list(zip(src.chunk(threads), dst.chunk(threads)))
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda c: c[1].copy_(c[0]), chunks))  # warm-up

        def once():
            t = time.perf_counter()
            list(pool.map(lambda c: c[1].copy_(c[0]), chunks))  # torch releases the GIL in copy_
            return time.perf_counter() - t
        return _gbps(nbytes, _best_of(3, once))


def save_fsync(directory: str, nbytes: int, threads: int, files: int) -> float:
    """torch.save of `files` tensors of nbytes/files each, fsynced, as extract's writer does (one file per sample)."""
    os.makedirs(directory, exist_ok=True)
    per = nbytes // files
    tensor = torch.ones(per // 2, dtype=torch.bfloat16)

    def write(i: int) -> None:
        path = os.path.join(directory, f"s{threads}-{i}.pt")
        with open(path, "wb") as f:
            torch.save({"hidden_states": tensor}, f)
            f.flush()
            os.fsync(f.fileno())
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, range(files)))
    seconds = time.perf_counter() - t
    for name in os.listdir(directory):
        os.remove(os.path.join(directory, name))
    return _gbps(per * files, seconds)


def direct_write(directory: str, nbytes: int) -> dict:
    """Sequential writes with O_DIRECT (the page cache bypassed), 8 MiB blocks, like `dd oflag=direct bs=8M`."""
    if not hasattr(os, "O_DIRECT"):
        return {"skipped": "no O_DIRECT here"}
    path = os.path.join(directory, "direct.bin")
    block = mmap.mmap(-1, 8 << 20)  # page-aligned, as O_DIRECT requires
    block.write(b"\1" * (8 << 20))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
    except OSError as e:  # tmpfs and some overlay file systems refuse O_DIRECT
        return {"skipped": f"O_DIRECT refused: {e}"}
    t = time.perf_counter()
    try:
        for _ in range(nbytes // (8 << 20)):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
        os.remove(path)
    return {"gbps": _gbps(nbytes // (8 << 20) * (8 << 20), time.perf_counter() - t)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", help="a directory on the disk to measure (emptied files only); required unless --smoke")
    ap.add_argument("--out", help="required unless --smoke")
    ap.add_argument("--mib", type=int, default=1024, help="bytes moved per measurement, MiB")
    ap.add_argument("--smoke", action="store_true", help="8 MiB per measurement in a temporary folder: seconds")
    args = ap.parse_args()
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="machine-limits-") as tmp:
            args.dir, args.out = args.dir or os.path.join(tmp, "disk"), args.out or os.path.join(tmp, "limits.json")
            args.mib = 8
            return run(args)
    if not (args.dir and args.out):
        ap.error("--dir and --out are required (or --smoke)")
    run(args)


def run(args: argparse.Namespace) -> None:
    nbytes = args.mib << 20
    result = {
        "what": "torch-only limits: GPU->host, host memcpy, torch.save+fsync, O_DIRECT (benchmarks/machine_limits.py)",
        "bytes_per_measurement": nbytes,
        "gpu_to_host": gpu_to_host(nbytes),
        "host_memcpy_gbps": {str(n): host_memcpy(nbytes, n) for n in (1, 4, 16)},
        "torch_save_fsync_gbps": {str(n): save_fsync(args.dir, nbytes * 2, n, files=64) for n in (1, 8)},
        "o_direct_write": direct_write(args.dir, nbytes * 2),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                    "disk_free_gb": round(shutil.disk_usage(args.dir).free / 1e9, 1)},
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
