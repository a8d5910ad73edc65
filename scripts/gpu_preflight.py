"""Time `--preflight` (docs/adr/0032-preflight.md) on checkpoints of real size, config only (no weights exist here),
and on the tiny quantized checkpoints, each as a fresh command timed from outside (what a user waits for), with the
default in-process worker and, for the ratio in the same run, a spawned one. One JSON line per run to
OUT/preflight.jsonl.

  python scripts/gpu_preflight.py [--device cuda|cpu] [--only NAME,...] [--work DIR] [--dry-run]

--dry-run builds the checkpoints and prints each command it would time, running none (no GPU, no engine: seconds;
scripts/gpu_parity.sh SMOKE=1, CI: tests/test_benchmark_smoke.py).

Config-only checkpoints written here (published shapes; a tiny tokenizer, since preflight feeds 16 token ids):
  qwen3-8b        Qwen3-8B: 36 layers, hidden 4096, bf16
  kimi-k25        Kimi-K2.5: 61 layers, hidden 7168, 384 experts, INT4 W4A16 experts (compressed-tensors, group 32),
                  the wrapper (KimiK25ForConditionalGeneration) with its remote-code config, as the real repository
  deepseek-v3     DeepSeek-V3: 61 layers, hidden 7168, 256 experts, FP8 128x128 blocks
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
            "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645, "use_sliding_window": False}
# DeepSeek-V3 / Kimi-K2's text model (Kimi: 384 experts, 64 heads)
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
               "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
               "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
               "num_experts_per_tok": 8, "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536,
               "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_group": 8, "topk_group": 4,
               "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
               "routed_scaling_factor": 2.5, "vocab_size": 129280, "max_position_embeddings": 163840,
               "rms_norm_eps": 1e-6, "rope_theta": 10000, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
               "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1, "num_nextn_predict_layers": 1,
               "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "original_max_position_embeddings": 4096, "type": "yarn"},
               "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                       "weight_block_size": [128, 128]}}
KIMI_K2_TEXT = dict(DEEPSEEK_V3, model_type="kimi_k2", num_attention_heads=64, num_key_value_heads=64,
                    n_routed_experts=384, first_k_dense_replace=1, n_group=1, topk_group=1, vocab_size=163840,
                    num_nextn_predict_layers=0, bos_token_id=163584, eos_token_id=163585,
                    rope_scaling={"beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0,
                                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"})


def _with_tokenizer(dest: str, config: dict) -> str:
    from eagle_compat import tiny_models
    os.makedirs(dest, exist_ok=True)
    src = tiny_models.build_tiny_model("llama")
    for name in os.listdir(src):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            shutil.copy(os.path.join(src, name), dest)
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return dest


def kimi_k25(dest: str) -> str:
    """The tiny Kimi-K2.5 checkpoint's files (remote-code config, processor) with Kimi-K2.5's text config."""
    from eagle_compat import quantized_models, tiny_models
    src = tiny_models.build_family("kimi_k25")[0]
    tiny_models.copy_without_weights(src, dest)
    with open(os.path.join(dest, "config.json")) as f:
        config = json.load(f)
    text = {k: v for k, v in KIMI_K2_TEXT.items() if k != "quantization_config"}
    text["quantization_config"] = quantized_models.quantization_config(quantized_models.QUANTIZED["kimi_k25_w4a16"])
    config["text_config"] = text
    config["vision_config"]["text_hidden_size"] = text["hidden_size"]
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return dest


def command(path: str, worker: str, trust_remote_code: bool) -> list[str]:
    if worker == "default":
        cmd = [sys.executable, "-m", "eagle_compat.cli", "check", "--model", path, "--preflight", "--json",
               *(["--trust-remote-code"] if trust_remote_code else [])]
    else:
        cmd = [sys.executable, "-c", "import json, sys; from eagle_compat import cli, preflight; "
               f"r = preflight.run({path!r}, trust_remote_code={trust_remote_code}, in_process=False, "
               "gpu_memory_utilization=cli._default_gmu()); print(json.dumps(r, default=str))"]
    return cmd


def timed_command(path: str, name: str, worker: str, trust_remote_code: bool) -> dict:
    """One preflight as a fresh command, timed from outside (Python start, every import, the engine, the exit)."""
    cmd = command(path, worker, trust_remote_code)
    env = {**os.environ, "VLLM_CONFIGURE_LOGGING": "0"}
    started = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    seconds = round(time.time() - started, 1)
    text = "\n" + proc.stdout
    start = max(text.rfind("\n{\n"), text.rfind("\n{\""))
    try:
        record = json.loads(text[start:]) if start >= 0 else {}
    except json.JSONDecodeError:
        record = {}
    if not record:
        record = {"ok": False, "error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
    return {**record, "command": " ".join(cmd[1:4]) + " ...", "returncode": proc.returncode,
            "command_seconds": seconds}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", default="")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--work", default=None, help="where the config-only checkpoints are written (default: "
                                                 "$EAGLE_COMPAT_TINY_MODELS or /tmp/tiny, /config-only)")
    ap.add_argument("--dry-run", action="store_true", help="build the checkpoints, print the commands, run none")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", default="default,spawned",
                    help="default: the user's command, `eagle-compat check --model PATH --preflight` (one rank: the "
                         "worker in its process); spawned: the same preflight with a spawned worker, for the ratio")
    args = ap.parse_args()
    from eagle_compat import preflight, quantized_models
    work = args.work or os.path.join(os.environ.get("EAGLE_COMPAT_TINY_MODELS", "/tmp/tiny"), "config-only")
    cases = {"qwen3-8b": lambda: _with_tokenizer(os.path.join(work, "qwen3-8b"), QWEN3_8B),
             "deepseek-v3": lambda: _with_tokenizer(os.path.join(work, "deepseek-v3"), DEEPSEEK_V3),
             "kimi-k25": lambda: kimi_k25(os.path.join(work, "kimi-k25"))}
    cases.update({name: (lambda n=name: quantized_models.build(n)[0]) for name in quantized_models.QUANTIZED})
    wanted = [c for c in (args.only.split(",") if args.only else cases) if c]
    os.makedirs(args.out, exist_ok=True)
    for name in wanted:
        path = cases[name]()
        for round_ in range(1, args.rounds + 1):  # round 1 meets a fresh machine's empty kernel caches
          for worker in args.workers.split(","):
            if args.dry_run:
                print(f"{name}: ok=dry-run worker={worker} round {round_}: "
                      f"{' '.join(command(path, worker, trust_remote_code='kimi' in name))[:300]}", flush=True)
                continue
            record = timed_command(path, name, worker, trust_remote_code="kimi" in name)
            record.update(case=name, device=args.device, round=round_)
            with open(os.path.join(args.out, "preflight.jsonl"), "a") as f:
                f.write(json.dumps(record, default=str) + "\n")
            print(f"{name}: ok={record.get('ok')} worker={record.get('worker')} command {record['command_seconds']} s "
                  f"(inside {record.get('seconds')} s) {(record.get('error') or '')[:300]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
