"""Extraction throughput, measured as ratios in one run (same model, same prompts, same machine):

  plain      vLLM's own LLM.generate, prefill only (max_tokens=1): the speed to match
  delivered  eagle_compat.VllmHiddenStatesGenerator: hidden states of the chosen layers handed to the caller (host)
  written    eagle-compat extract: the same, written to disk as training files (pipelined, writer threads; each
             file fsynced, as extract does)
  written_shm  the same writer into /dev/shm (memory): the software's speed where the disk is no limit
  disk       the same writer, same threads, writing the same number of same-sized files (fsynced) from memory, no
             engine: how fast this machine's disk takes what `written` writes. `disk_over_plain` < 1 means the disk
             alone cannot keep up with plain prefill, whatever the software does. Needs no GPU (a few seconds).
  online     eagle_compat.online.HiddenStates over the same prompts as token-id lines, in order, batches of --batch:
             every sample's states taken as a training loop takes them (stacked and, on a GPU, copied onto it); no
             file of states written. Its samples are compared bit for bit with `written`'s files where that phase
             ran before it in the same run (same batches: `compared_with_written`).
  native     vLLM's own `extract_hidden_states` speculative method + `ExampleHiddenStatesConnector` (one safetensors
             file per request), same layers (vLLM's id k is the input of layer k: speculators' id i -> vLLM i+1);
             a few of its files are compared with `written`'s at bf16 tolerance. Skipped, with the reason, where this
             vLLM cannot run it. vLLM does not fsync its files: `native_fsynced_over_plain` adds the time to fsync
             them after the phase (`fsync_after_seconds`), native at the durability of `written`.

Each phase runs in its own process (one engine at a time). Results: JSON with tokens/s per phase, the ratios, and
each phase's peak memory (driver and engine processes, VmHWM; shared-memory pages count in both).

  python benchmarks/throughput.py --model tiny-llama --prompts 64 --tokens 256            # CPU
  python benchmarks/throughput.py --model llama-8b-dummy --prompts 256 --tokens 1024 --gmu 0.85   # H200
`tiny-llama` builds the tests' tiny model; `llama-8b-dummy` (and `qwen3-30b-a3b-dummy`, a MoE) write a config of
that shape and run it with dummy weights (`load_format="dummy"`).

  python benchmarks/throughput.py --smoke      # CI: tiny-llama, 8 x 32, phases disk,delivered,written,online
`--stand-in` runs delivered, written, written_shm and online with the stand-in engine of `eagle_compat.testing` (no vLLM:
the phases' own work; plain and native are vLLM's and refused with it); `--smoke` is tiny sizes with it.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def llama_8b_dummy(path: str) -> str:
    from eagle_compat import tiny_models

    os.makedirs(path, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "dtype": "bfloat16",
              "bos_token_id": 1, "eos_token_id": 2}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    tiny_models.save_tokenizer(path)  # ids < 512 are all the benchmark feeds
    return path


def qwen3_30b_a3b_dummy(path: str) -> str:
    from eagle_compat import tiny_models

    os.makedirs(path, exist_ok=True)
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
              "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
              "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
              "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "dtype": "bfloat16", "bos_token_id": 1,
              "eos_token_id": 2, "attention_bias": False, "sliding_window": None, "use_sliding_window": False}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    tiny_models.save_tokenizer(path)
    return path


def resolve_model(name: str, work: str) -> tuple[str, bool]:
    if name == "tiny-llama":
        from eagle_compat import tiny_models
        return tiny_models.build_tiny_model("llama"), False
    if name == "llama-8b-dummy":
        return llama_8b_dummy(os.path.join(work, "llama-8b-dummy")), True
    if name == "qwen3-30b-a3b-dummy":
        return qwen3_30b_a3b_dummy(os.path.join(work, "qwen3-30b-a3b-dummy")), True
    return name, False


def peak_memory() -> dict:
    """VmHWM (peak resident set) of this process and of its child processes (the engine's), in MiB."""
    def hwm(pid: int) -> float | None:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            return None
        return None

    out = {"driver_peak_rss_mib": hwm(os.getpid())}
    try:
        import psutil
        kids = psutil.Process().children(recursive=True)
        out["engine_processes_peak_rss_mib"] = {str(k.pid): hwm(k.pid) for k in kids}
    except Exception:  # noqa: BLE001
        pass
    return out


def native_file_written(path: str) -> bool:
    """Whether vLLM's ExampleHiddenStatesConnector has finished writing `path`. In vLLM 0.25.1-0.27.1 (its source,
    example_hidden_states_connector.py) it writes on a thread pool: it takes an exclusive flock on PATH.lock when
    the request is scheduled, before PATH exists, and releases it once the file is written, but never deletes the
    .lock (only the reader-side cleanup_hidden_states does). 0.20.0's has no lock and writes the file before the
    request's output returns. Waiting for no .lock file at all waited forever: the native phase never finished on
    0.26.0 and 0.27.1."""
    import fcntl

    if not os.path.exists(path):
        return False
    try:
        fd = os.open(path + ".lock", os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def fsync_all(paths: list[str]) -> float:
    """Seconds to fsync every file: vLLM's connector leaves its files in the page cache, ours fsyncs each one before
    it counts (extract/atomic_io.py), so `native` + this is native timed to the same durability as `written`."""
    from eagle_compat.extract.atomic_io import fsync_file

    t0 = time.perf_counter()
    for path in paths:
        fsync_file(path)
    return time.perf_counter() - t0


def native_phase(args: argparse.Namespace, batch: list[list[int]], layers: list[int], extra: dict) -> dict:
    """vLLM's extract_hidden_states + ExampleHiddenStatesConnector, timed until every file is on disk."""
    import glob
    import shutil

    from vllm import LLM, SamplingParams

    store = args.native_dir or tempfile.mkdtemp(prefix="eagle-bench-native-", dir=args.write_dir)
    os.makedirs(store, exist_ok=True)
    vllm_ids = [i + 1 for i in layers]  # vLLM's id k = the input of layer k = the output of layer k-1
    llm = LLM(model=args.model_path, enforce_eager=args.eager, max_model_len=args.tokens + 8,
              gpu_memory_utilization=args.gmu, enable_prefix_caching=False, enable_chunked_prefill=False,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=max(args.batch_tokens, args.tokens + 8),
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": vllm_ids}}},
              kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                                  "kv_connector_extra_config": {"shared_storage_path": store}}, **extra)
    sp = SamplingParams(max_tokens=1, temperature=0.0)

    def wait_for(paths: list[str]) -> None:
        if not paths or None in paths:
            raise RuntimeError(f"vLLM returned no hidden_states_path for {paths.count(None)} of {len(paths)} requests")
        deadline = time.time() + args.native_timeout
        waiting = list(paths)
        while time.time() < deadline:
            waiting = [p for p in waiting if not native_file_written(p)]
            if not waiting:
                return
            time.sleep(0.002)
        raise TimeoutError(f"{len(waiting)} of {len(paths)} native files not written within {args.native_timeout} s "
                           f"in {store} ({len(glob.glob(os.path.join(store, '*.lock')))} .lock files there)")

    def paths_of(outputs) -> list[str]:
        return [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outputs]

    started = time.perf_counter()
    print("native: engine up", file=sys.stderr, flush=True)
    wait_for(paths_of(llm.generate([{"prompt_token_ids": ids} for ids in warm_prompts(args, batch)], sp)))  # warm
    print(f"native: warm-up files written in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    for f in os.listdir(store):
        os.unlink(os.path.join(store, f))
    t0 = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in batch], sp, use_tqdm=False)
    paths = paths_of(outputs)
    wait_for(paths)
    seconds = time.perf_counter() - t0
    result = {"seconds": seconds, "tokens": sum(map(len, batch)), "files": len(paths), "dir": store,
              "vllm_layer_ids": vllm_ids, "fsync_after_seconds": fsync_all(paths)}
    if args.compare_dir:
        try:
            result["compared_with_written"] = compare_native(paths, batch, args.compare_dir)
        except Exception as exc:  # noqa: BLE001 - the timing stands; say why the files could not be compared
            result["compared_with_written"] = {"equal": False, "error": f"{type(exc).__name__}: {exc}"[:1000]}
    result["memory"] = peak_memory()
    del llm
    if not args.keep_files:
        shutil.rmtree(store, ignore_errors=True)
    return result


def compare_native(paths: list[str], batch: list[list[int]], written_dir: str, tolerance: float = 5e-2) -> dict:
    """Max |ours - native| / max |native| per layer, for a few samples: native `hidden_states` is [T, layers, H]."""
    import torch
    from safetensors.torch import load_file

    n = len(batch)
    picks = sorted({0, n // 2, n - 1})
    worst = []
    for i in picks:
        native = load_file(paths[i])
        ours = torch.load(os.path.join(written_dir, f"data_{i}.pt"), weights_only=True)
        if not native["token_ids"].tolist()[:len(batch[i])] == batch[i] == ours["input_ids"].tolist():
            raise ValueError(f"sample {i}: token ids differ between the native file, ours and the prompt")
        hs = native["hidden_states"]
        per_layer = []
        for k, h in enumerate(ours["hidden_states"]):
            ref = hs[: h.shape[0], k].float()
            per_layer.append((h.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30))
        worst.append(per_layer)
    rel = [max(w[k] for w in worst) for k in range(len(worst[0]))]
    return {"samples": picks, "max_rel_error_per_layer": rel, "tolerance": tolerance,
            "equal": all(r <= tolerance for r in rel)}


def prompts(n: int, t: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(7, 500) for _ in range(t)] for _ in range(n)]


def warm_prompts(args: argparse.Namespace, batch: list[list[int]]) -> list[list[int]]:
    """One full engine step's worth of prompts: kernels for that shape are built before the clock starts."""
    return batch[:max(1, min(len(batch), args.batch_tokens // max(1, args.tokens)))]


def phase(args: argparse.Namespace) -> dict:
    """One phase, in this process. Returns seconds for the timed part and the token count."""
    model, dummy = args.model_path, args.dummy
    batch = prompts(args.prompts, args.tokens)
    tokens = sum(map(len, batch))
    layers = [int(x) for x in args.layers.split(",")]
    extra = {"load_format": "dummy"} if dummy else {}
    if args.phase == "plain":
        from vllm import LLM, SamplingParams

        llm = LLM(model=model, enforce_eager=args.eager, max_model_len=args.tokens + 8,
                  gpu_memory_utilization=args.gmu, enable_prefix_caching=False, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=max(args.batch_tokens, args.tokens + 8), **extra)
        sp = SamplingParams(max_tokens=1, temperature=0.0)
        llm.generate([{"prompt_token_ids": ids} for ids in warm_prompts(args, batch)], sp)  # warm
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids} for ids in batch], sp, use_tqdm=False)
        return {"seconds": time.perf_counter() - t0, "tokens": tokens, "memory": peak_memory()}
    if args.phase == "native":
        return native_phase(args, batch, layers, extra)
    if args.phase == "disk":
        return disk_phase(args, batch, layers)
    if args.stand_in:  # the generator looked up below is the stand-in (eagle_compat.testing)
        from eagle_compat import testing
        testing.install()
    if args.phase == "online":
        return online_phase(args, batch, layers, extra)
    from eagle_compat import VllmHiddenStatesGenerator
    from eagle_compat.generator import QUEUED_BATCHES

    gen = VllmHiddenStatesGenerator(model, layer_ids=layers, max_model_len=args.tokens + 8,
                                    gpu_memory_utilization=args.gmu, max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=max(args.batch_tokens, args.tokens + 8), **extra)
    gen.generate(warm_prompts(args, batch))  # warm
    # the ring's buffers are set up once, like the engine's KV cache: the batches queued in the engine, the one
    # collected, the prefetched one, the caller's (written: plus the batches whose samples wait for a writer, at most
    # 4 per writer thread)
    waiting = 0 if args.phase == "delivered" else -(-4 * args.writer_threads // args.batch)
    reserved = gen.reserve_host_buffers(args.batch * args.tokens, QUEUED_BATCHES + 3 + waiting)
    groups = [batch[k:k + args.batch] for k in range(0, len(batch), args.batch)]
    t0 = time.perf_counter()
    if args.phase == "delivered":
        for out in gen.generate_batches(groups):
            assert out[0]["hidden_states"][0].device.type == "cpu"
        del out
        extra_out = {}
    else:  # written: the extract job's writer on its writer pool, the engine running ahead
        import shutil

        import torch

        from eagle_compat.extract import pipeline, writer

        if args.phase == "written_shm":  # the same writer, to memory: what the software does without the disk
            out_dir = tempfile.mkdtemp(prefix="eagle-bench-written-", dir="/dev/shm")
        else:
            out_dir = args.written_dir or tempfile.mkdtemp(prefix="eagle-bench-", dir=args.write_dir)
        os.makedirs(out_dir, exist_ok=True)
        with pipeline.WriterPool(args.writer_threads) as pool:
            for k, out in enumerate(gen.generate_batches(groups)):
                for i, r in enumerate(out):
                    pool.submit(writer.save_sample, out_dir, k * args.batch + i,
                                {"input_ids": r["input_ids"], "hidden_states": r["hidden_states"],
                                 "loss_mask": torch.ones_like(r["input_ids"])}, "pt")
                del out, r
            # the last batch's files can only be written after its compute: the tail no overlap can hide
            engine_done = time.perf_counter() - t0
        # how long submitting waited for a writer slot (pipeline.WriterPool), every batch's, the last one's too
        extra_out = {"writer_threads": pool.threads, "dir": out_dir, "engine_done_seconds": engine_done,
                     "driver_waited_for_writers_s": pool.blocked_s, "submits_that_waited": pool.blocked_submits}
        if args.phase == "written_shm":
            shutil.rmtree(out_dir, ignore_errors=True)
    seconds = time.perf_counter() - t0
    result = {"seconds": seconds, "tokens": tokens, "reserved_buffers": reserved, "handover": gen.handover_stats,
              "memory": peak_memory(), **extra_out}
    gen.close()
    return result


def online_phase(args: argparse.Namespace, batch: list[list[int]], layers: list[int], extra: dict) -> dict:
    """The iterable a training loop takes, fed the prompts as token-id lines in their order; the clock runs from the
    first batch after the warm-up to the last sample taken, as for `delivered`."""
    import torch

    from eagle_compat.online import HiddenStates

    data = os.path.join(tempfile.mkdtemp(prefix="eagle-bench-online-"), "data.jsonl")
    with open(data, "w") as f:
        for ids in batch:
            f.write(json.dumps({"input_ids": ids}) + "\n")
    device = "cuda" if torch.cuda.is_available() else None
    states = HiddenStates(args.model_path, data, layers=layers, max_len=args.tokens, batch_size=args.batch,
                          shuffle=False, read_ahead=2, gpu_memory_utilization=args.gmu, show_load_progress=False,
                          **extra)
    engine = states._started()  # started and warmed before the clock, as the other phases' engines are
    engine.generate(warm_prompts(args, batch))
    compared, differ, checked = 0, [], 8
    t0 = time.perf_counter()
    for k, sample in enumerate(states):
        stacked = torch.stack(sample["hidden_states"])  # what a trainer does with a sample's layers
        if device:
            stacked = stacked.to(device, non_blocking=True)
        if k < checked and args.written_dir and os.path.exists(os.path.join(args.written_dir, f"data_{k}.pt")):
            kept = torch.load(os.path.join(args.written_dir, f"data_{k}.pt"))
            compared += 1
            if not all(torch.equal(a, b) for a, b in zip(kept["hidden_states"], sample["hidden_states"],
                                                         strict=True)):
                differ.append(k)
        del sample, stacked
    if device:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    states.close()
    return {"seconds": seconds, "tokens": sum(map(len, batch)), "memory": peak_memory(),
            "compared_with_written": {"samples": compared, "differ": differ, "equal": compared > 0 and not differ}}


def disk_phase(args: argparse.Namespace, batch: list[list[int]], layers: list[int]) -> dict:
    """`written`'s writer without the engine: one sample's states of the model's shape and dtype, written once per
    prompt by the same pool into the same kind of folder, each file fsynced as extract does. Its files are removed
    after it, also when a write fails (a full disk must not break the next phase)."""
    import shutil

    import torch

    from eagle_compat.extract import pipeline, writer

    with open(os.path.join(args.model_path, "config.json")) as f:
        config = json.load(f)
    config = config.get("text_config", config)  # a wrapped language model (Kimi-K2.5) keeps its sizes there
    dtype = torch.float32 if config.get("torch_dtype", config.get("dtype")) == "float32" else torch.bfloat16
    by_length = {}  # one sample per prompt length, built before the clock starts
    for ids in batch:
        if len(ids) not in by_length:
            by_length[len(ids)] = {"input_ids": torch.tensor(ids), "loss_mask": torch.ones(len(ids), dtype=torch.long),
                                   "hidden_states": [torch.randn(len(ids), config["hidden_size"]).to(dtype)
                                                     for _ in layers]}
    out_dir = tempfile.mkdtemp(prefix="eagle-bench-disk-", dir=args.write_dir)
    try:
        t0 = time.perf_counter()
        with pipeline.WriterPool(args.writer_threads) as pool:  # leaving it waits for every write
            for k, ids in enumerate(batch):
                pool.submit(writer.save_sample, out_dir, k, by_length[len(ids)], "pt")
        seconds = time.perf_counter() - t0
        names = os.listdir(out_dir)
        written = sum(os.path.getsize(os.path.join(out_dir, name)) for name in names)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return {"seconds": seconds, "tokens": sum(map(len, batch)), "files": len(names), "bytes": written,
            "bytes_per_s": written / seconds, "writer_threads": pool.threads}


def native_skip_reason(stderr: str) -> str:
    """The last error line of a failed native phase: why vLLM's own path does not run here."""
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    worker = [x for x in lines if "Worker failed with error" in x]  # the root cause, before any timeout
    errors = worker or [x for x in lines if ("Error" in x or "error" in x) and not x.startswith("File ")]
    reason = (errors[0] if worker else errors[-1]) if errors else (lines[-1] if lines else "no output")
    frames = [x for x in lines if x.split("] ")[-1].strip().startswith("File ") and "vllm/" in x]
    frames = [x for x in frames if "(Worker" in x] or frames  # where the worker failed, when it did
    where = [x.split('"')[1].split("site-packages/")[-1] + ", line " + x.split("line ")[-1].split(",")[0]
             for x in frames]
    return (reason.split("] ")[-1] + (f" (last vLLM frame: {where[-1]})" if where else ""))[:600]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32, help="prompts per generate() call")
    ap.add_argument("--batch-tokens", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--layers", default=None, help="default: speculators' [2, N//2, N-3, N-1]")
    ap.add_argument("--gmu", type=float, default=0.3)
    ap.add_argument("--eager", action="store_true", default=True)
    ap.add_argument("--write-dir", default=None, help="where written/native files go (default: the temp dir)")
    ap.add_argument("--writer-threads", type=int, default=8)
    ap.add_argument("--phases", default="plain,delivered,written,native")
    ap.add_argument("--keep-files", action="store_true", help="keep the written and native files")
    ap.add_argument("--native-timeout", type=float, default=120.0, help="seconds to wait for native files")
    ap.add_argument("--out", default=None, help="write the results JSON here")
    ap.add_argument("--stand-in", action="store_true",
                    help="delivered, written, written_shm, online with the stand-in engine (eagle_compat.testing): "
                         "no vLLM")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny-llama, 8 prompts x 32 tokens, phases disk,delivered,written,online, --stand-in: seconds")
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dummy", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--written-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--native-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--compare-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        args.model, args.prompts, args.tokens, args.batch, args.batch_tokens = "tiny-llama", 8, 32, 4, 256
        args.writer_threads, args.phases, args.stand_in = 2, "disk,delivered,written,online", True
    if args.stand_in and not args.phase and {"plain", "native"} & set(args.phases.split(",")):
        ap.error("--stand-in: the phases plain and native are vLLM's own; leave them out (--phases)")
    if args.phase:
        print("PHASE " + json.dumps(phase(args)), flush=True)
        return 0
    work = tempfile.mkdtemp(prefix="eagle-bench-work-")
    model_path, dummy = resolve_model(args.model, work)
    with open(os.path.join(model_path, "config.json")) as f:
        n = json.load(f)["num_hidden_layers"]
    layers = args.layers or ",".join(str(i) for i in sorted({2, n // 2, n - 3, n - 1}))
    phases = [p for p in args.phases.split(",") if p]
    results = {"model": args.model, "prompts": args.prompts, "tokens_per_prompt": args.tokens, "layers": layers,
               **({"engine": "stand-in (eagle_compat.testing)"} if args.stand_in else {}),
               "batch": args.batch, "writer_threads": args.writer_threads, "phases_asked": phases, "phases": {}}
    written_dir = tempfile.mkdtemp(prefix="eagle-bench-written-", dir=args.write_dir)
    native_dir = tempfile.mkdtemp(prefix="eagle-bench-native-", dir=args.write_dir)
    for name in phases:
        cmd = [sys.executable, os.path.abspath(__file__), "--phase", name, "--model-path", model_path,
               "--prompts", str(args.prompts), "--tokens", str(args.tokens), "--batch", str(args.batch),
               "--batch-tokens", str(args.batch_tokens), "--max-num-seqs", str(args.max_num_seqs), "--layers", layers,
               "--gmu", str(args.gmu), "--writer-threads", str(args.writer_threads),
               "--written-dir", written_dir, "--native-dir", native_dir,
               "--native-timeout", str(args.native_timeout)] + (["--dummy"] if dummy else []) + (
               ["--write-dir", args.write_dir] if args.write_dir else []) + (
               ["--keep-files"] if args.keep_files else []) + (["--stand-in"] if args.stand_in else [])
        if name == "native" and "written" in results["phases"] and "error" not in results["phases"]["written"]:
            cmd += ["--compare-dir", written_dir]
        # the phase's output goes to a file as it runs: a phase cut off by a time limit still shows how far it got
        log_path = (args.out or os.path.join(work, "throughput")) + f".{name}.log"
        with open(log_path, "w") as log:
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
        with open(log_path) as log:
            output = log.read()
        line = next((x for x in output.splitlines() if x.startswith("PHASE ")), None)
        if line is None:
            tail = output[-3000:]
            if name == "native":  # vLLM's own path may not exist or run here: say why, go on
                results["phases"][name] = {"skipped": native_skip_reason(output), "error": tail}
                print(f"{name}: skipped ({results['phases'][name]['skipped']})", file=sys.stderr)
            else:
                results["phases"][name] = {"error": tail}
                print(f"{name}: FAILED\n{output[-2000:]}", file=sys.stderr)
        else:
            r = json.loads(line[6:])
            r["tokens_per_s"] = r["tokens"] / r["seconds"]
            results["phases"][name] = r
            print(f"{name:>10}: {r['tokens_per_s']:>12,.0f} tok/s  ({r['seconds']:.2f} s)", flush=True)
        if args.out:  # after every phase, failed ones too: a run stopped by a time limit keeps what it measured
            with open(args.out, "w") as f:
                json.dump({**results, "complete": False}, f, indent=1)
    if not args.keep_files:
        import shutil
        shutil.rmtree(written_dir, ignore_errors=True)
        shutil.rmtree(native_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    plain = results["phases"].get("plain", {}).get("tokens_per_s")
    if plain:
        for name in ("delivered", "written", "written_shm", "online", "native", "disk"):
            tps = results["phases"].get(name, {}).get("tokens_per_s")
            if tps:
                results[f"{name}_over_plain"] = tps / plain
                print(f"{name} / plain = {tps / plain:.3f}")
        native = results["phases"].get("native", {})
        if "fsync_after_seconds" in native:  # the same durability as `written`: the files fsynced after the phase
            durable = native["tokens"] / (native["seconds"] + native["fsync_after_seconds"]) / plain
            results["native_fsynced_over_plain"] = durable
            print(f"native fsynced / plain = {durable:.3f}")
    cmp = results["phases"].get("native", {}).get("compared_with_written")
    if cmp and "error" in cmp:
        print(f"native files vs ours: not compared ({cmp['error']})")
    elif cmp:
        print(f"native files vs ours: max rel. error per layer {['%.1e' % e for e in cmp['max_rel_error_per_layer']]}"
              f" -> {'equal' if cmp['equal'] else 'DIFFERENT'} at bf16 tolerance {cmp['tolerance']}")
    import platform

    from eagle_compat import cpu, detect
    results["versions"] = detect.installed_versions().as_dict()
    results["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(), **cpu.this_cpu().as_dict()}
    try:
        import torch
        if torch.cuda.is_available():
            results["machine"]["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        pass
    results["complete"] = True
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    failed = [name for name, r in results["phases"].items() if "error" in r and "skipped" not in r]
    return 1 if failed else 0  # (native skipped where vLLM cannot run it is no failure)


if __name__ == "__main__":
    sys.exit(main())
