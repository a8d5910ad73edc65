"""eagle-compat: the command line.

  eagle-compat demo [--family deepseek_v3]   build a tiny model, run speculators 0.3.0 under install(), compare to HF
  eagle-compat doctor [--model PATH] [--json]  versions, API features, patches needed; the model's decoder contract
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def _print_table(rows: list[tuple[str, str]], title: str) -> None:
    print(title)
    width = max((len(k) for k, _ in rows), default=0)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def cmd_doctor(args: argparse.Namespace) -> int:
    from . import detect, installer
    from .errors import EagleCompatError

    problems: list[str] = []
    report: dict = {"versions": detect.installed_versions().as_dict()}
    try:
        installer.check_environment()
    except EagleCompatError as exc:
        problems.append(str(exc))
    if detect.installed_versions().vllm is not None:
        report["features"] = detect.features()
        report["patches_needed"] = installer.needed_units()
        problems += [f"feature probe {k}: {v}" for k, v in report["features"].items() if not isinstance(v, bool)]
    if args.model:
        try:
            report["model"] = describe_model(args.model, trust_remote_code=args.trust_remote_code)
        except EagleCompatError as exc:
            report["model"] = {"error": f"{type(exc).__name__}: {exc}"}
            problems.append(str(exc))
    report["problems"] = problems
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print_table([(k, str(v)) for k, v in report["versions"].items()], "Installed")
        if "features" in report:
            _print_table([(k, str(v)) for k, v in report["features"].items()], "vLLM API features detected")
            _print_table([(k, "needed" if v is True else "not needed" if v is False else str(v))
                          for k, v in report["patches_needed"].items()], "Patch units (install())")
        if "model" in report:
            _print_table([(k, str(v)) for k, v in report["model"].items()], f"Decoder contract of {args.model}")
        if problems:
            print("Problems:")
            for p in problems:
                print(f"  - {p}")
        else:
            print("OK: nothing unsupported found.")
    return 1 if problems else 0


def describe_model(model: str, *, trust_remote_code: bool = False) -> dict:
    """Start a capture engine on the model (eager, CPU or GPU) and return its resolved decoder contract."""
    from .generator import VllmHiddenStatesGenerator

    with VllmHiddenStatesGenerator(model, max_model_len=256, gpu_memory_utilization=_default_gmu(),
                                   trust_remote_code=trust_remote_code) as gen:
        return gen.describe()


def _default_gmu() -> float:
    from . import detect
    # on CPU vLLM reserves this fraction of host memory per NUMA node; 0.8 fails on small machines
    return 0.8 if detect.feature("cuda_available") else 0.3


def cmd_demo(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch

    from . import tiny_models

    path = tiny_models.build_tiny_model(args.family)
    n = tiny_models.TINY_CONFIGS[args.family][2]["num_hidden_layers"]
    layer_ids = sorted({0, (n - 1) // 2, n - 2, n - 1})
    print(f"tiny {args.family} model ({n} layers) at {path}")
    import eagle_compat

    report = eagle_compat.install()
    print(report)
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    gen = VllmHiddenStatesGenerator(path, layer_ids=layer_ids, max_model_len=512, gpu_memory_utilization=0.3)
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(7, 512, (int(k),), generator=g).tolist() for k in (24, 57, 130)]
    try:
        results = gen.generate(batch)
    finally:
        gen.executor.shutdown()
    reference = tiny_models.hf_reference(path, batch, layer_ids)
    print("\nspeculators 0.3.0 VllmHiddenStatesGenerator under eagle_compat.install(), vs HF transformers (fp32)")
    print("engine dtype: auto (bf16 on CPU); tolerance: 5e-2 of each layer's max |value|")
    print(f"{'layer':>6} {'HF reference':>22} {'max abs err':>12} {'rel to max':>11}  ok")
    ok_all = True
    for j, lid in enumerate(layer_ids):
        err = max((r["hidden_states"][j].float() - ref[j]).abs().max().item() for r, ref in zip(results, reference))
        scale = max(ref[j].abs().max().item() for ref in reference)
        ok = err <= 5e-2 * scale
        ok_all &= ok
        which = f"hidden_states[{lid + 1}]" if lid < n - 1 else "final norm input"
        print(f"{lid:>6} {which:>22} {err:>12.3e} {err / scale:>11.3e}  {'yes' if ok else 'NO'}")
    eagle_compat.uninstall()
    return 0 if ok_all else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle-compat", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="versions, detected vLLM API features, patches needed, model contract")
    p.add_argument("--model", help="local model directory: start an engine and print its decoder contract")
    p.add_argument("--json", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    p.set_defaults(func=cmd_doctor)
    p = sub.add_parser("demo", help="tiny model + speculators 0.3.0 under install(), compared with HF")
    from .tiny_models import TINY_CONFIGS
    p.add_argument("--family", default="deepseek_v3", choices=sorted(TINY_CONFIGS))
    p.set_defaults(func=cmd_demo)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
