"""Extraction throughput, measured as ratios in one run (same model, same prompts, same machine):

  plain      vLLM's own LLM.generate, prefill only (max_tokens=1): the speed to match
  delivered  eagle_compat.VllmHiddenStatesGenerator: hidden states of the chosen layers handed to the caller (host)
  written    eagle-compat extract: the same, written to disk as training files

Each phase runs in its own process (one engine at a time). Results: JSON with tokens/s per phase and the ratios.

  python benchmarks/throughput.py --model tiny-llama --prompts 64 --tokens 256            # CPU
  python benchmarks/throughput.py --model llama-8b-dummy --prompts 256 --tokens 1024 --gmu 0.85   # H200
`tiny-llama` builds the tests' tiny model; `llama-8b-dummy` writes an 8B-shaped Llama config and runs it with
dummy weights (`load_format="dummy"`).
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


def resolve_model(name: str, work: str) -> tuple[str, bool]:
    if name == "tiny-llama":
        from eagle_compat import tiny_models
        return tiny_models.build_tiny_model("llama"), False
    if name == "llama-8b-dummy":
        return llama_8b_dummy(os.path.join(work, "llama-8b-dummy")), True
    return name, False


def prompts(n: int, t: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(7, 500) for _ in range(t)] for _ in range(n)]


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
        llm.generate([{"prompt_token_ids": batch[0]}], sp)  # warm
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids} for ids in batch], sp, use_tqdm=False)
        return {"seconds": time.perf_counter() - t0, "tokens": tokens}
    from eagle_compat import VllmHiddenStatesGenerator

    gen = VllmHiddenStatesGenerator(model, layer_ids=layers, max_model_len=args.tokens + 8,
                                    gpu_memory_utilization=args.gmu, max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=max(args.batch_tokens, args.tokens + 8), **extra)
    gen.generate([batch[0]])  # warm
    t0 = time.perf_counter()
    if args.phase == "delivered":
        for k in range(0, len(batch), args.batch):
            out = gen.generate(batch[k:k + args.batch])
            assert out[0]["hidden_states"][0].device.type == "cpu"
    else:  # written: the extract job's own writer, same batches
        from eagle_compat.extract import writer
        import torch

        out_dir = tempfile.mkdtemp(prefix="eagle-bench-", dir=args.write_dir)
        for k in range(0, len(batch), args.batch):
            for i, r in enumerate(gen.generate(batch[k:k + args.batch])):
                writer.save_sample(out_dir, k + i, {"input_ids": r["input_ids"], "hidden_states": r["hidden_states"],
                                                    "loss_mask": torch.ones_like(r["input_ids"])}, "pt")
    seconds = time.perf_counter() - t0
    gen.close()
    return {"seconds": seconds, "tokens": tokens}


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
    ap.add_argument("--write-dir", default=None)
    ap.add_argument("--out", default=None, help="write the results JSON here")
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dummy", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print("PHASE " + json.dumps(phase(args)), flush=True)
        return 0
    work = tempfile.mkdtemp(prefix="eagle-bench-work-")
    model_path, dummy = resolve_model(args.model, work)
    with open(os.path.join(model_path, "config.json")) as f:
        n = json.load(f)["num_hidden_layers"]
    layers = args.layers or ",".join(str(i) for i in sorted({2, n // 2, n - 3, n - 1}))
    results = {"model": args.model, "prompts": args.prompts, "tokens_per_prompt": args.tokens, "layers": layers,
               "batch": args.batch, "phases": {}}
    for name in ("plain", "delivered", "written"):
        cmd = [sys.executable, os.path.abspath(__file__), "--phase", name, "--model-path", model_path,
               "--prompts", str(args.prompts), "--tokens", str(args.tokens), "--batch", str(args.batch),
               "--batch-tokens", str(args.batch_tokens), "--max-num-seqs", str(args.max_num_seqs), "--layers", layers,
               "--gmu", str(args.gmu)] + (["--dummy"] if dummy else []) + (
               ["--write-dir", args.write_dir] if args.write_dir else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("PHASE ")), None)
        if line is None:
            results["phases"][name] = {"error": proc.stderr[-3000:]}
            print(f"{name}: FAILED\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        r = json.loads(line[6:])
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        results["phases"][name] = r
        print(f"{name:>10}: {r['tokens_per_s']:>12,.0f} tok/s  ({r['seconds']:.2f} s)", flush=True)
    plain = results["phases"].get("plain", {}).get("tokens_per_s")
    if plain:
        for name in ("delivered", "written"):
            tps = results["phases"].get(name, {}).get("tokens_per_s")
            if tps:
                results[f"{name}_over_plain"] = tps / plain
                print(f"{name} / plain = {tps / plain:.3f}")
    import platform

    from eagle_compat import detect
    results["versions"] = detect.installed_versions().as_dict()
    results["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        import torch
        if torch.cuda.is_available():
            results["machine"]["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        pass
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
