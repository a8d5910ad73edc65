"""What checking the model's weight files costs at each run's start (extract hashes them before the engine starts).

Weight files over 1 GiB are hashed by their header and each tensor's first and last 4 KiB (`file_hashes.HASHED_TENSORS`;
benchmarks/results/cpu-model-checksum-cost.json); earlier releases hashed their size and first and last MiB
(`HASHED_ENDS`), which took a fine-tune of a middle layer for its base. This writes two synthetic safetensors files
with real checkpoints' tensor layouts and times both methods (median of --repeats) and a full hash (once), cold (the
file's pages dropped with posix_fadvise first) and warm, in one run:

* `llama8b`: --llama-layers decoder layers of Llama-3-8B (bf16, 9 tensors a layer; a real shard holds about 8);
* `kimi_int4`: one MoE layer of Kimi-K2.5's INT4 checkpoint (384 experts x 3 projections x packed weight, group
  scale and shape: 3,456 tensors, as in a real shard), its matrices --kimi-shrink times smaller in each dimension
  (the tensor count, which sets the number of reads, is the real one).

Run: PYTHONPATH=src python3 benchmarks/model_checksum_cost.py --dir /tmp/ckcost --out RESULT.json
--smoke: one Llama layer 16 times smaller in each dimension, Kimi's 64 times, one repeat, in a temporary folder
(seconds, the real tensor counts; CI: tests/test_benchmark_smoke.py).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import struct
import tempfile
import time

from eagle_compat.extract import file_hashes


def _write_safetensors(path: str, tensors: list[tuple[str, str, list[int], int]]) -> int:
    """tensors: (name, dtype, shape, bytes). Data is random (a sparse or zero file would read without I/O)."""
    header, offset = {}, 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    block = os.urandom(64 << 20)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        left = offset
        while left:
            f.write(block[:min(left, len(block))])
            left -= min(left, len(block))
        f.flush()
        os.fsync(f.fileno())
    return len(tensors)


def llama8b(layers: int, shrink: int = 1) -> list[tuple[str, str, list[int], int]]:
    h, kv, ffn = 4096 // shrink, 1024 // shrink, 14336 // shrink
    out = []
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj.weight", [h, h]), ("self_attn.k_proj.weight", [kv, h]),
                            ("self_attn.v_proj.weight", [kv, h]), ("self_attn.o_proj.weight", [h, h]),
                            ("mlp.gate_proj.weight", [ffn, h]), ("mlp.up_proj.weight", [ffn, h]),
                            ("mlp.down_proj.weight", [h, ffn]), ("input_layernorm.weight", [h]),
                            ("post_attention_layernorm.weight", [h])):
            out.append((p + name, "BF16", shape, 2 * _numel(shape)))
    return out


def kimi_int4(shrink: int) -> list[tuple[str, str, list[int], int]]:
    hidden, inter, group = 7168 // shrink, 2048 // shrink, 32
    out = []
    for e in range(384):
        for proj, (rows, cols) in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                   ("down_proj", (hidden, inter))):
            p = f"language_model.model.layers.3.mlp.experts.{e}.{proj}."
            out += [(p + "weight_packed", "I32", [rows, cols // 8], 4 * rows * (cols // 8)),
                    (p + "weight_scale", "BF16", [rows, cols // group], 2 * rows * (cols // group)),
                    (p + "weight_shape", "I64", [2], 16)]
    return out


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _time(fn, path: str, cold: bool) -> float:
    if cold:
        _drop(path)
    else:
        fn()  # warm the pages this method reads
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", help="required unless --smoke")
    parser.add_argument("--out", help="required unless --smoke")
    parser.add_argument("--llama-layers", type=int, default=4)
    parser.add_argument("--llama-shrink", type=int, default=1, help="the Llama's matrices N times smaller a side")
    parser.add_argument("--kimi-shrink", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny files in a temporary folder: seconds")
    args = parser.parse_args()
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="checksum-cost-") as tmp:
            args.dir, args.out = args.dir or os.path.join(tmp, "files"), args.out or os.path.join(tmp, "result.json")
            args.llama_layers, args.llama_shrink, args.kimi_shrink, args.repeats = 1, 16, 64, 1
            return run(args)
    if not (args.dir and args.out):
        parser.error("--dir and --out are required (or --smoke)")
    run(args)


def run(args: argparse.Namespace) -> None:
    os.makedirs(args.dir, exist_ok=True)
    layouts = {"llama8b": llama8b(args.llama_layers, args.llama_shrink), "kimi_int4": kimi_int4(args.kimi_shrink)}
    methods = {"ends (earlier releases)": file_hashes.HASHED_ENDS, "tensor ends (now)": file_hashes.HASHED_TENSORS}
    results = {}
    for layout, tensors in layouts.items():
        path = os.path.join(args.dir, f"{layout}.safetensors")
        count = _write_safetensors(path, tensors)
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            reads = file_hashes._tensor_end_reads(file_hashes._safetensors_layout(f, path, size)[2])
        row = {"bytes": size, "tensors": count, "reads_tensor_ends": len(reads),
               "bytes_read_tensor_ends": sum(end - begin for begin, end, _ in reads)}
        calls = {label: (lambda m=m: file_hashes._large_file_sha256(path, m)) for label, m in methods.items()}
        calls["full"] = lambda: file_hashes.file_sha256(path)
        for label, fn in calls.items():
            for state in ("cold", "warm"):
                times = [_time(fn, path, state == "cold") for _ in range(args.repeats if label != "full" else 1)]
                row[f"{label} {state} s"] = round(statistics.median(times), 4)
        for state in ("cold", "warm"):
            row[f"now / earlier {state}"] = round(row[f"tensor ends (now) {state} s"]
                                                  / row[f"ends (earlier releases) {state} s"], 2)
            row[f"now / full {state}"] = round(row[f"tensor ends (now) {state} s"] / row[f"full {state} s"], 4)
        row["GB/s full cold"] = round(size / row["full cold s"] / 1e9, 2)
        results[layout] = row
        os.unlink(path)
        print(layout, json.dumps(row, indent=1))
    record = {"machine": {"cpu": _cpu_name(), "cores": os.cpu_count()},
              "what": "extract's model checksum at a run's start, per weight file (benchmarks/model_checksum_cost.py)",
              "args": vars(args), "results": results}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
