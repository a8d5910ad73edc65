"""Hybrid-attention models at the shapes real checkpoints have, against HF transformers: which engine is wrong, and
for which shape. Each variant is a tiny random Gemma 3 (bf16 checkpoint, weights normal(0, 0.03)) that differs from
the base in one fact (the layer pattern, the head size, the KV heads, the window, the layer count); every sequence but
the shortest is longer than the window.

For each variant, three engines on the same tokens:
  plain      vLLM's own engine (`vllm.LLM`, its own KV planning and scheduler, no eagle_compat): the residual stream
             after each decoder layer, taken by forward hooks inside the engine's process, and the prompt's logprobs
  generator  eagle_compat.VllmHiddenStatesGenerator (dtype auto, as speculators passes)
  shim       speculators 0.3.0's generator under eagle_compat.install()
and each engine with one setting changed (ENGINE:SETTING): `kv2g` a 2 GiB KV cache (the plain engine's default here),
`util` a KV cache of 0.2 of the GPU's memory (the generators' default here), `triton` vLLM's Triton attention backend
instead of the one it picks (FlashAttention on Hopper);
each judged against HF fp32 with HF's own bf16 error on the same tokens (eagle_compat.check.compare), and the KV-cache
groups each engine planned.

  python scripts/gpu_hybrid_shapes.py all [--variants base,alt,...] [--engines plain,generator,shim] --out DIR
  python scripts/gpu_hybrid_shapes.py one VARIANT ENGINE --out DIR     (one engine, in its own process)
  python scripts/gpu_hybrid_shapes.py table RESULTS.jsonl ...           (the results' markdown table, on any machine)
Results: DIR/hybrid_shapes.jsonl, one line per (variant, engine).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback

BASE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=7, num_attention_heads=4,
            num_key_value_heads=1, head_dim=128, query_pre_attn_scalar=128, sliding_window=64, vocab_size=4096,
            layer_types=["sliding_attention"] * 5 + ["full_attention", "sliding_attention"],
            max_position_embeddings=2048, tie_word_embeddings=True, initializer_range=0.03,
            hidden_activation="gelu_pytorch_tanh", bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _pattern(n: int, every: int) -> list[str]:
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]


VARIANTS: dict[str, dict] = {
    "base": {},
    "alt": dict(layer_types=_pattern(7, 2)),                       # alternating, as the committed GPU cells
    "hd64": dict(head_dim=64, query_pre_attn_scalar=64),            # the committed cells' head size
    "hd256": dict(head_dim=256, query_pre_attn_scalar=256),         # Gemma-3-270M/1B/4B's head size
    "kv4": dict(num_key_value_heads=4),                             # as many KV heads as query heads
    "win512": dict(sliding_window=512),                             # most sequences inside the window
    "l12": dict(num_hidden_layers=12, layer_types=_pattern(12, 6)),  # 5:1 twice (10 local, 2 global)
    "l18": dict(num_hidden_layers=18, layer_types=_pattern(18, 6)),  # Gemma-3-270M's layout at head size 128
}
LENGTHS = (32, 96, 150, 230, 320, 410, 500, 587)
ENGINES = ("plain", "generator", "shim")
SETTINGS = ("", "kv2g", "util", "triton", "big")
KV_2G = 2 << 30
UTIL = 0.2  # three engines side by side on one GPU


def model_dir(root: str, variant: str) -> str:
    return os.path.join(root, "models", variant)


def sequences(vocab: int) -> list[list[int]]:
    import random
    rng = random.Random(65)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in LENGTHS]


def build(root: str, variant: str) -> str:
    import torch
    import transformers

    path = model_dir(root, variant)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    config = transformers.Gemma3TextConfig(**{**BASE, **VARIANTS[variant]})
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path + ".tmp", safe_serialization=True)
    from eagle_compat.tiny_models import save_tokenizer
    save_tokenizer(path + ".tmp", config.vocab_size)
    os.replace(path + ".tmp", path)
    return path


def hf_states_and_logprobs(path: str, seqs: list[list[int]], dtype: str, device: str) -> tuple[list, list]:
    """Every layer's residual stream (speculators' numbering: leaving layer i; the last layer before the final norm)
    and each prompt token's logprob given the tokens before it."""
    import torch
    from eagle_compat import tiny_models

    n = json.load(open(os.path.join(path, "config.json")))["num_hidden_layers"]
    states = tiny_models.hf_reference(path, seqs, list(range(n)), device=device, dtype=dtype)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    logprobs = []
    with torch.no_grad():
        for ids in seqs:
            logits = model(torch.tensor([ids], device=device)).logits[0].float()
            lp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:], device=device)[:, None])[:, 0]
            logprobs.append(lp.cpu())
    return states, logprobs


def groups_of(kv_cache_config) -> list[dict]:
    return [{"spec": type(g.kv_cache_spec).__name__,
             "window": getattr(g.kv_cache_spec, "sliding_window", None),
             "layers": [name.split(".layers.")[-1].split(".")[0] for name in g.layer_names]}
            for g in kv_cache_config.kv_cache_groups]


def kv_sizes(kv_cache_config) -> dict:
    return {"num_blocks": kv_cache_config.num_blocks,
            "tensors": [{"bytes": t.size, "layers": len(getattr(t, "shared_by", None) or getattr(t, "layers", []))}
                        for t in kv_cache_config.kv_cache_tensors]}


def run_plain(path: str, seqs: list[list[int]], n: int, setting: str) -> dict:
    """vLLM's own engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), one prompt per step; the hooks compute
    hidden + residual inside the layer's call (the next layer's fused add-norm overwrites the returned tensors)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(path, dtype="auto", enforce_eager=True, max_model_len=1024, skip_tokenizer_init=True,
              enable_prefix_caching=False, gpu_memory_utilization=UTIL, seed=0,
              **({} if setting == "util" else {"kv_cache_memory_bytes": KV_2G}),
              **({"attention_backend": "TRITON_ATTN"} if setting == "triton" else {}))
    captured: dict[int, list] = {i: [] for i in range(n)}

    def install(model):
        for i, layer in enumerate(model.model.layers):
            def hook(mod, args, out, i=i):
                captured[i].append((out[0] + out[1]).detach().float().cpu())  # Gemma's layers return (h, residual)
            layer.register_forward_hook(hook)

    llm.apply_model(install)
    states, logprobs = [], []
    for ids in seqs:
        for v in captured.values():
            v.clear()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                           SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0), use_tqdm=False)[0]
        states.append([torch.cat(captured[i])[:len(ids)] for i in range(n)])
        logprobs.append(torch.tensor([d[t].logprob for t, d in zip(ids[1:], out.prompt_logprobs[1:])]))
    groups = None
    try:
        core = llm.llm_engine.engine_core.engine_core
        groups = groups_of(core.scheduler.kv_cache_config)
        sizes = kv_sizes(core.scheduler.kv_cache_config)
    except Exception as exc:  # noqa: BLE001 - a diagnostic only
        groups = sizes = f"unread: {type(exc).__name__}: {exc}"
    return {"states": states, "logprobs": logprobs, "groups": groups, "kv": sizes}


def use_triton_attention() -> None:
    """The generator's VllmConfig with vLLM's Triton attention backend (its workers read the config's choice)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from eagle_compat.engine import configs
    build = configs.build_vllm_config

    def with_triton(*args, **kwargs):
        vllm_config = build(*args, **kwargs)
        vllm_config.attention_config.backend = AttentionBackendEnum.TRITON_ATTN
        return vllm_config
    configs.build_vllm_config = with_triton


def run_generator(path: str, seqs: list[list[int]], n: int, setting: str) -> dict:
    from eagle_compat import VllmHiddenStatesGenerator
    if setting == "triton":
        use_triton_attention()
    kv = {"kv_cache_memory_bytes": KV_2G} if setting == "kv2g" else {}
    with VllmHiddenStatesGenerator(path, layer_ids=list(range(n)), max_model_len=1024,
                                   gpu_memory_utilization=0.85 if setting == "big" else UTIL, **kv) as gen:
        results = gen.generate(seqs)
        groups = groups_of(gen.scheduler.kv_cache_config)
        sizes = kv_sizes(gen.scheduler.kv_cache_config)
    return {"states": [r["hidden_states"] for r in results], "groups": groups, "kv": sizes}


def run_shim(path: str, seqs: list[list[int]], n: int, setting: str) -> dict:
    import eagle_compat
    eagle_compat.install()
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
    gen = VllmHiddenStatesGenerator(path, layer_ids=list(range(n)), max_model_len=1024, gpu_memory_utilization=UTIL)
    try:
        results = gen.generate(seqs)
        groups = groups_of(gen.scheduler.kv_cache_config)
        sizes = kv_sizes(gen.scheduler.kv_cache_config)
    finally:
        gen.executor.shutdown()
    return {"states": [r["hidden_states"] for r in results], "groups": groups, "kv": sizes}


def one(variant: str, engine: str, root: str, device: str) -> dict:
    import torch
    from eagle_compat import check

    path = model_dir(root, variant)
    n = json.load(open(os.path.join(path, "config.json")))["num_hidden_layers"]
    seqs = sequences(json.load(open(os.path.join(path, "config.json")))["vocab_size"])
    ref = torch.load(os.path.join(path, "reference.pt"))
    start = time.time()
    record: dict = {"variant": variant, "engine": engine, "config": {**BASE, **VARIANTS[variant]}}
    try:
        kind, _, setting = engine.partition(":")
        got = {"plain": run_plain, "generator": run_generator, "shim": run_shim}[kind](path, seqs, n, setting)
        results = [{"hidden_states": s} for s in got["states"]]
        layers = check.compare(results, ref["fp32"], list(range(n)), "bf16", ref["bf16"])
        record.update(status="pass" if all(e.ok for e in layers) else "fail", groups=got["groups"], kv=got["kv"],
                      layers={e.layer_id: {"ok": e.ok, "median": e.median, "p95": e.high,
                                           "hf_bf16_median": e.reference_median, "hf_bf16_p95": e.reference_high,
                                           "max_rel_to_layer_max": e.max_rel_to_layer_max}
                              for e in layers})
        # per sequence: the worst layer's largest error relative to that layer's largest value
        record["per_sequence"] = [{"tokens": len(ids), "max_rel": max(
            float((s.float() - r.float()).abs().max() / r.float().abs().max()) for s, r in zip(got_s, ref_s))}
            for ids, got_s, ref_s in zip(seqs, got["states"], ref["fp32"])]
        if "logprobs" in got:
            diff = [float((a - b).abs().max()) for a, b in zip(got["logprobs"], ref["lp_fp32"])]
            hf = [float((a - b).abs().max()) for a, b in zip(ref["lp_bf16"], ref["lp_fp32"])]
            record["prompt_logprobs"] = {"max_abs_vs_hf_fp32": max(diff), "hf_bf16_max_abs": max(hf),
                                         "per_sequence": diff}
    except Exception as exc:  # noqa: BLE001 - every failure is a result
        record.update(status="error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
    record["seconds"] = round(time.time() - start, 1)
    return record


def prepare(root: str, variants: list[str], device: str) -> None:
    import torch
    for v in variants:
        path = build(root, v)
        if os.path.exists(os.path.join(path, "reference.pt")):
            continue
        seqs = sequences(VARIANTS[v].get("vocab_size", BASE["vocab_size"]))
        fp32, lp32 = hf_states_and_logprobs(path, seqs, "float32", device)
        bf16, lp16 = hf_states_and_logprobs(path, seqs, "bfloat16", device)
        torch.save({"fp32": fp32, "bf16": bf16, "lp_fp32": lp32, "lp_bf16": lp16}, os.path.join(path, "reference.pt"))


def table(paths: list[str]) -> list[str]:
    """One row per (variant, engine) of each results file, the release from its name (h100-vllm-0.34.0.jsonl)."""
    rows = ["| release | variant | engine | status | worst median / HF bf16 | max rel. | prompt logprobs vs HF fp32 "
            "(HF bf16's) | KV groups | KV GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for path in paths:
        release = os.path.basename(path).rsplit("-", 1)[-1].removesuffix(".jsonl")
        for line in filter(str.strip, open(path)):
            r = json.loads(line)
            layers = list(r.get("layers", {}).values())
            worst = max((L["median"] / L["hf_bf16_median"] for L in layers), default=None)
            rel = max((L["max_rel_to_layer_max"] for L in layers), default=None)
            lp = r.get("prompt_logprobs")
            logprobs = f"{lp['max_abs_vs_hf_fp32']:.3f} ({lp['hf_bf16_max_abs']:.3f})" if lp else "-"
            groups = len(r["groups"]) if isinstance(r.get("groups"), list) else "-"
            gib = sum(t["bytes"] for t in r.get("kv", {}).get("tensors", [])) / (1 << 30)
            rows.append(f"| {release} | {r['variant']} | {r['engine']} | {r['status']} | "
                        f"{'-' if worst is None else f'{worst:.2f}'} | {'-' if rel is None else f'{rel:.3f}'} | "
                        f"{logprobs} | {groups} | {gib:.1f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("all", "one", "table"))
    ap.add_argument("args", nargs="*")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--jobs", default=None, help="VARIANT/ENGINE,... in this order (instead of the two lists)")
    ap.add_argument("--out")
    ap.add_argument("--root", default="/tmp/hybrid-shapes")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--parallel", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=300)
    a = ap.parse_args()
    if a.what == "table":
        print("\n".join(table(a.args)))
        return
    if not a.out:
        ap.error("--out DIR is needed to run engines")
    if a.what == "one":
        variant, engine = a.args
        print("HYBRID_SHAPES " + json.dumps(one(variant, engine, a.root, a.device), default=str), flush=True)
        return
    # every variant's first engine before any variant's second: a call cut short still covers every shape
    jobs = ([tuple(job.split("/", 1)) for job in a.jobs.split(",")] if a.jobs
            else [(v, e) for e in a.engines.split(",") for v in a.variants.split(",")])
    variants = list(dict.fromkeys(v for v, _ in jobs))
    unknown = [v for v in variants if v not in VARIANTS] + [
        e for _, e in jobs if e.partition(":")[0] not in ENGINES or e.partition(":")[2] not in SETTINGS]
    if unknown:
        ap.error(f"unknown {unknown}; variants: {', '.join(VARIANTS)}; engines: {', '.join(ENGINES)}, each with "
                 f"an optional :SETTING of {', '.join(SETTINGS[1:])}")
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    prepare(a.root, variants, a.device)
    print(f"references ready in {time.time() - t0:.0f} s", flush=True)
    running: list = []
    results = open(os.path.join(a.out, "hybrid_shapes.jsonl"), "a")

    def reap() -> None:
        for job in list(running):
            proc, (v, e), log, started = job
            if proc.poll() is None and time.time() - started > a.timeout:
                os.killpg(proc.pid, 9)  # the engine's own processes with it: they hold GPU memory
                proc.wait()
            if proc.poll() is not None:
                text = open(log).read()
                line = [ln for ln in text.splitlines() if ln.startswith("HYBRID_SHAPES ")]
                rec = json.loads(line[-1][14:]) if line else {"variant": v, "engine": e, "status": "no result",
                                                               "log_tail": text[-2500:]}
                results.write(json.dumps(rec) + "\n")
                results.flush()
                worst = max((L["median"] or 0) / max(L["hf_bf16_median"] or 1e-9, 1e-9)
                            for L in rec["layers"].values()) if rec.get("layers") else None
                print(f"{v:7s} {e:9s} {rec['status']:9s} worst median/hf {worst} "
                      f"logprobs {rec.get('prompt_logprobs', {}).get('max_abs_vs_hf_fp32')} "
                      f"groups {len(rec['groups']) if isinstance(rec.get('groups'), list) else rec.get('groups')} "
                      f"({rec.get('seconds')} s) max_rel by layer "
                      f"{[round(L['max_rel_to_layer_max'], 3) for L in rec.get('layers', {}).values()]} "
                      f"kv {rec.get('kv')}", flush=True)
                running.remove(job)

    def stop(signum, frame):  # `timeout` around this script: the engines go with it
        for proc, *_ in running:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
    for v, e in jobs:
        while len(running) >= a.parallel:
            reap()
            time.sleep(1)
        log = os.path.join(a.root, f"log-{v}-{e}.txt")
        proc = subprocess.Popen([sys.executable, __file__, "one", v, e, "--root", a.root, "--device", a.device,
                                 "--out", a.out], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        running.append((proc, (v, e), log, time.time()))
    while running:
        reap()
        time.sleep(1)
    print(f"done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
