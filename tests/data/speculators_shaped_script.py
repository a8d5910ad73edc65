"""Shaped like speculators 0.3.0's scripts/data_generation_offline.py, and run unmodified by tests/test_launcher.py:
speculators is imported at the top (so a spawned vLLM worker, which first re-imports this file, imports it too),
the generator is built in main() under the __main__ guard, and the script exits with a status of its own."""
import argparse
import json
import sys

import torch
from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator


def extract(args, batch):
    gen = VllmHiddenStatesGenerator(args.target_model_path, layer_ids=args.layer_ids, max_model_len=512,
                                    gpu_memory_utilization=0.3)
    try:
        return gen.generate(batch)
    finally:
        gen.executor.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target-model-path", required=True)
    parser.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    parser.add_argument("--layer-ids", type=int, nargs="+", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--exit-status", type=int, default=0)
    args = parser.parse_args()
    with open(args.prompts) as f:
        batch = json.load(f)
    results = extract(args, batch)  # the generator is collected on return: its __del__ runs then
    torch.save([[h.clone() for h in r["hidden_states"]] for r in results], args.output)
    print(f"wrote {len(results)} samples to {args.output}")
    sys.exit(args.exit_status)


if __name__ == "__main__":
    main()
