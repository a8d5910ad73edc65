"""extract --ray on CPU: 1 actor vs 2 actors (one core each) on a local Ray cluster, and a local run for reference.

Same model, same prompts, same batches, one machine. Each run is `eagle-compat extract` in its own process; the
numbers come from the run's manifest (`runs[-1]["ray"]`): `work_seconds` (first batch's start to last batch's end,
i.e. without the first engine's start), the cluster's tokens/s over it, each actor's engine start, forward time and
its own rate once its engine was up (`tokens_per_s_after_start`; their sum is the pool's steady capacity, which
does not count an actor whose engine came up late as idle).
The output directories are compared byte for byte with the local run's.

  python benchmarks/ray_scaling.py --prompts 2048 --tokens 256 --out benchmarks/results/cpu-ray-scaling-vllm-0.32.0.json
  python benchmarks/ray_scaling.py --smoke   # 8 prompts of 16 tokens, 1 actor, the stand-in engine: seconds (CI)

--smoke runs every extract with the stand-in engine of `eagle_compat.testing` (`python -m eagle_compat.testing -m
eagle_compat.cli extract ...`; in the actors too): the runs, the records and the comparison, no vLLM engine.
"""
from __future__ import annotations

import argparse
import filecmp
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--actors", default="1,2")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="8 prompts of 16 tokens, 1 actor, the stand-in engine")
    a = ap.parse_args()
    if a.smoke:
        a.prompts, a.tokens, a.batch_size, a.actors = 8, 16, 4, "1"
    # the command: eagle-compat's, or under the stand-in engine (eagle_compat.testing) for a smoke run
    command = ["-m", "eagle_compat.testing", "-m", "eagle_compat.cli"] if a.smoke else ["-m", "eagle_compat.cli"]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import ray

    from eagle_compat import cpu, detect, tiny_models
    from eagle_compat.extract import writer

    model = tiny_models.build_tiny_model("llama")
    work = tempfile.mkdtemp(prefix="ray-scaling-")
    data = os.path.join(work, "data.jsonl")
    rng = random.Random(0)
    with open(data, "w") as f:
        for _ in range(a.prompts):
            ids = [rng.randrange(7, 512) for _ in range(a.tokens)]
            f.write(json.dumps({"input_ids": ids, "loss_mask": [1] * len(ids)}) + "\n")
    cores = len(os.sched_getaffinity(0))
    ray.init(num_cpus=cores, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING")
    address = ray.get_runtime_context().gcs_address

    def extract(out: str, *extra: str) -> tuple[dict, float]:
        t = time.time()
        proc = subprocess.run([sys.executable, *command, "extract", "--model", model, "--data", data,
                               "--out", out, "--layers", "0,2,4,5", "--batch-size", str(a.batch_size), "--max-len",
                               str(a.tokens + 1), "--gpu-memory-utilization", "0.3", "--no-progress", *extra],
                              capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(proc.stderr[-4000:])
        return json.load(open(os.path.join(out, "manifest.json")))["runs"][-1], time.time() - t

    local_out = os.path.join(work, "local")
    local, local_wall = extract(local_out)
    results = {"machine": f"{cores} cores, {os.cpu_count()} CPUs visible; load average before the runs "
                          f"{os.getloadavg()[0]:.2f} (other work shares the machine)", "model": "tiny llama (6 layers, 256 wide)",
               "versions": detect.installed_versions().as_dict(), "prompts": a.prompts,
               "cpu": cpu.this_cpu().as_dict(), "tokens_per_prompt": a.tokens, "batch_size": a.batch_size, "tokens": local["tokens"],
               "local": {"wall_s": round(local_wall, 1), "note": "one engine, vLLM's own thread binding"}, "ray": {}}
    for n in map(int, a.actors.split(",")):
        out = os.path.join(work, f"ray-{n}")
        run, wall = extract(out, "--ray", address, "--ray-actors", str(n), "--ray-cpus-per-actor", "1")
        names = sorted(f for f in os.listdir(local_out) if writer.SAMPLE_FILE.match(f))  # not data_config.json
        _, mismatch, errors = filecmp.cmpfiles(local_out, out, names, shallow=False)
        r = run["ray"]
        results["ray"][str(n)] = {
            "wall_s": round(wall, 1), "work_s": r["work_seconds"], "tokens_per_s": r["tokens_per_s"],
            "byte_identical_to_local": not mismatch and not errors,
            "per_actor": [{k: p[k] for k in ("rank", "batches", "samples", "tokens", "engine_start_s", "forward_s",
                                             "busy_s", "binding")} for p in r["per_actor"]]}
        results["ray"][str(n)]["files_compared"] = len(names)
        # each actor's own rate once its engine was up (its batches: forward + writing its files)
        for p in results["ray"][str(n)]["per_actor"]:
            steady = p["busy_s"] - p["engine_start_s"]
            p["tokens_per_s_after_start"] = round(p["tokens"] / steady, 1) if steady > 0 else None
        results["ray"][str(n)]["sum_of_actor_rates"] = round(sum(
            p["tokens_per_s_after_start"] or 0 for p in results["ray"][str(n)]["per_actor"]), 1)
        print(json.dumps(results["ray"][str(n)]), flush=True)
    base = results["ray"].get("1")
    if base:
        for n, r in results["ray"].items():
            r["speedup_vs_1_actor"] = {"cluster_tokens_per_s": round(r["tokens_per_s"] / base["tokens_per_s"], 2),
                                       "sum_of_actor_rates": round(r["sum_of_actor_rates"] /
                                                                   base["sum_of_actor_rates"], 2),
                                       "wall": round(base["wall_s"] / r["wall_s"], 2)}
    ray.shutdown()
    if a.smoke:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(results, indent=1, sort_keys=True)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
