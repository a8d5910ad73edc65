"""eagle-compat: the command line.

  eagle-compat extract --model PATH --data FILE.jsonl --out DIR   conversations/token ids -> EAGLE-3 training files
  eagle-compat convert SRC DST [--to FORMAT]   data_{i}.pt <-> Arrow + hidden_states/hs_{i}.safetensors
  eagle-compat demo [--family deepseek_v3]   tiny model: speculators 0.3.0 under install() vs HF, then extract
  eagle-compat check [--family F ...] [--json]  extraction on this vLLM vs HF (exit status for CI)
  eagle-compat report DIR [--json] [--plot PNG]  what a finished directory's data is (ours or speculators 0.3.0's)
  eagle-compat doctor [--model PATH] [--json] [--release X.Y.Z]  versions, API features, patches needed; the model's decoder contract
  eagle-compat run SCRIPT.py ARGS... | run -m MODULE ARGS...   any script unmodified under install(), spawned
                                               processes included (e.g. speculators' data_generation_offline.py)
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from . import settings
from .doctor import cmd_doctor
from .plugin import QUIET_MARK

# Loggers a quiet run keeps to this level: vLLM's and torch's (their warnings are not the user's business unless they
# ask, --verbose), and eagle_compat's own INFO (kept where a library below configured the root logger at INFO)
QUIET_LOGGERS = {"vllm": logging.ERROR, "torch": logging.ERROR, "eagle_compat": logging.WARNING}


def _quiet_loggers() -> None:
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)


# A quiet run's spawned vLLM workers import this module again (as __mp_main__ or through the console script) before
# they import vLLM: its first messages, logged before vLLM configures its loggers, would reach stderr.
if os.environ.get(QUIET_MARK) == "1":
    _quiet_loggers()


def _default_gmu() -> float:
    from .model_facts import default_gpu_memory_utilization
    return default_gpu_memory_utilization()


def cmd_demo(args: argparse.Namespace) -> int:
    if not args.verbose:
        quiet_engine_output()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch

    from . import tiny_models

    path = tiny_models.build_tiny_model(args.family)
    n = tiny_models.num_layers(args.family)
    layer_ids = sorted({0, (n - 1) // 2, n - 2, n - 1})
    print(f"tiny {args.family} model ({n} layers) at {path}")
    from .errors import InvalidInput
    from .extract import writer
    earlier = (writer.read_manifest(args.out) or {}).get("settings") or {}
    if (earlier and writer.sample_files(args.out) and
            (earlier.get("model"), earlier.get("layer_ids")) != (os.path.abspath(path), layer_ids)):
        # refused now, not after the comparison below: the main job could not add to that directory
        raise InvalidInput(f"--out {args.out} holds the demo of another model or layers ({earlier.get('model')}, "
                           f"layers {earlier.get('layer_ids')}): give this one another --out (e.g. --out "
                           f"{args.out.rstrip('/')}-{args.family}) or remove {args.out}")
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
    from . import check as parity
    precision = parity.precision_of(gen.vllm_config.model_config.dtype)
    layers = parity.judge(results, path, batch, layer_ids, precision)
    print("\nspeculators 0.3.0 VllmHiddenStatesGenerator under eagle_compat.install(), vs HF transformers (fp32)")
    print(f"engine dtype: auto (bf16 on CPU); judged against HF's own bf16 error on the same tokens: per-token "
          f"relative error, median and p{parity.PERCENTILE} within {parity.FACTOR:g} x HF's + {parity.FLOOR:g}")
    print(f"{'layer':>6} {'HF reference':>22} {'median':>9} {'p' + str(parity.PERCENTILE):>9} {'HF bf16 p':>10}  ok")
    ok_all = True
    for e in layers:
        ok_all &= e.ok
        which = f"hidden_states[{e.layer_id + 1}]" if e.layer_id < n - 1 else "final norm input"
        stats = (f"{e.median:>9.2e} {e.high:>9.2e} {e.reference_high:>10.2e}" if e.median is not None
                 else f"{'max abs':>9} {e.max_abs:>9.2e} {'(fp32)':>10}")
        print(f"{e.layer_id:>6} {which:>22} {stats}  {'yes' if e.ok else 'NO'}")
    eagle_compat.uninstall()
    ok_all &= demo_extract(path, args.out, layer_ids)
    return 0 if ok_all else 1


def cmd_check(args: argparse.Namespace) -> int:
    """Extraction vs HF on the installed vLLM, per (check, family): exit 0 only if every one passes."""
    if args.json:  # keep stdout for the JSON: vLLM's own log handler writes to stdout
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    from . import check as parity
    from .errors import EagleCompatError, InvalidInput

    if args.preflight:
        if not args.model:
            raise InvalidInput("--preflight checks a checkpoint of yours: give --model PATH")
        return run_preflight(args.model, args.trust_remote_code, args.json)
    checks = [c for c in args.checks.split(",") if c]
    families = [f for f in (args.family or ["llama", "deepseek_v3"])] if not args.model else [None]
    bad = [c for c in checks if c not in parity.CHECKS]
    if bad or not checks:
        raise InvalidInput(f"--checks: unknown {bad or checks}; allowed: {', '.join(parity.CHECKS)}")
    from . import tiny_models
    known = tiny_models.FAMILIES + tiny_models.GPU_VARIANTS + tuple(tiny_models.REAL_MODELS)
    bad = [f for f in families if f is not None and f not in known]
    if bad:
        raise InvalidInput(f"--family: unknown {bad}; allowed: {', '.join(known)}")
    if args.model:
        from .model_source import local_model_path
        args.model = local_model_path(args.model)
    rows, ok = [], True
    for check in checks:
        for family in families:
            try:
                result = parity.run(check, family, model=args.model, dtype=args.dtype,
                                    trust_remote_code=args.trust_remote_code)
                row = {"check": check, "family": family, "model": result.model, "status":
                       "pass" if result.ok else "fail", "precision": result.precision,
                       "worst_rel": max(e.max_rel_to_layer_max for e in result.layers),
                       "failures": result.failures()}
            except EagleCompatError as exc:
                row = {"check": check, "family": family, "model": args.model, "status": "error",
                       "error": f"{type(exc).__name__}: {exc}"}
            ok &= row["status"] == "pass"
            rows.append(row)
            if not args.json:
                what = f"{check:9s} {family or args.model}"
                detail = (f"{row['precision']}, worst {row['worst_rel']:.2e} of layer max" if "precision" in row
                          else row["error"].splitlines()[0])
                print(f"{row['status'].upper():5s} {what}: {detail}", flush=True)
                for line in row.get("failures", []):
                    print(f"      {line}")
    if args.json:
        from . import detect
        print(json.dumps({"versions": detect.installed_versions().as_dict(), "results": rows, "ok": ok}, indent=2))
    return 0 if ok else 1


# What keeps vLLM, torch and Python warnings off a run's output (the user's own settings win); --verbose keeps them.
QUIET_ENV = {"VLLM_LOGGING_LEVEL": "ERROR", "TORCH_CPP_LOG_LEVEL": "ERROR", "TORCH_LOGS": "-all",
             "PYTHONWARNINGS": "ignore", QUIET_MARK: "1"}


def quiet_engine_output() -> list[str] | None:
    """Before vLLM is imported: its loggers read VLLM_LOGGING_LEVEL once, and the workers inherit the environment.
    Returns the variables set here (none where an earlier quiet run of this process, or its parent, set them all),
    or None where the user asked for vLLM's logs: the run is not quiet then."""
    import warnings
    # the user asked for vLLM's logs at some level (not a quiet run's own setting, inherited): keep everything else
    if settings.is_set("VLLM_LOGGING_LEVEL") and os.environ.get(QUIET_MARK) != "1":
        return None
    warnings.simplefilter("ignore")
    # the driver: vLLM configures its loggers only inside its own engines; without a handler its warnings reach
    # Python's last-resort handler (stderr)
    _quiet_loggers()
    set_here = [k for k in QUIET_ENV if k not in os.environ]
    for k in set_here:
        os.environ[k] = QUIET_ENV[k]
    return set_here


def cmd_report(args: argparse.Namespace) -> int:
    from .errors import InvalidInput
    from .extract import report as data_report
    if not os.path.isdir(args.dir):
        raise InvalidInput(f"{args.dir}: not a directory")
    try:
        rep = data_report.of_directory(args.dir)
    except FileNotFoundError as exc:
        raise InvalidInput(str(exc)) from None
    print(json.dumps(rep, indent=2) if args.json else data_report.text(rep, title=args.dir))
    if args.plot:
        print(f"length histogram in {data_report.plot(rep, args.plot)}")
    return 1 if rep.get("problems") else 0  # files that would train a drafter wrongly


def run_preflight(model: str, trust_remote_code: bool, as_json: bool = False, dtype: str = "auto",
                  tensor_parallel_size: int = 1) -> int:
    from . import preflight
    from .model_source import local_model_path
    model = local_model_path(model)
    record = preflight.run(model, trust_remote_code=trust_remote_code, gpu_memory_utilization=_default_gmu(),
                           dtype=dtype, tensor_parallel_size=tensor_parallel_size)
    print(json.dumps(record, indent=2, default=str) if as_json else preflight.text(record), flush=True)
    return 0 if record.get("ok") else 1


def _time_split(summary: dict) -> str:
    """Where the run's time went: the engine's start (minutes for a large model) apart from the extraction."""
    extraction = (summary.get("pipeline") or {}).get("seconds")
    start = summary.get("engine_start_s")
    if extraction is None or start is None:
        return ""
    return f": engine start {start:.1f} s, extraction {extraction:.1f} s"


def cmd_extract(args: argparse.Namespace) -> int:
    quiet = not args.verbose and quiet_engine_output() is not None
    if args.preflight:  # the engine the run would build (dtype, tensor parallel), on the config cut short
        return run_preflight(args.model, args.trust_remote_code, dtype=args.dtype,
                             tensor_parallel_size=args.tensor_parallel_size)
    from .errors import InvalidInput
    from .extract import job, job_options
    from .extract import report as data_report

    missing = [flag for flag, value in (("--data", args.data), ("--out", args.out)) if not value]
    if missing:
        raise InvalidInput(f"the following arguments are required: {', '.join(missing)} (only --preflight runs "
                           "without them)")
    opts = job.ExtractOptions(
        model=args.model, data=args.data, out=args.out, layers=job_options.parse_layers(args.layers),
        batch_size=args.batch_size, max_len=args.max_len, resume=args.resume, shard=job_options.parse_shard(args.shard),
        validate=args.validate, format=args.format, tensor_parallel_size=args.tensor_parallel_size,
        # None: the device's default, found after the cheap checks (it asks torch); an explicit 0 meets the refusal
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, dtype=args.dtype, trust_remote_code=args.trust_remote_code,
        progress=not args.no_progress, verify_kept=args.verify_kept, skip_uncovered=args.skip_uncovered,
        skip_non_finite=args.skip_non_finite, ray=args.ray, ray_actors=args.ray_actors,
        ray_cpus_per_actor=args.ray_cpus_per_actor, min_loss_tokens=args.min_loss_tokens, loss_mask=args.loss_mask,
        quiet=quiet)
    if args.report_plot:
        data_report.check_plot_path(args.report_plot, "--report-plot")  # before anything reaches the engine
    summary = job.run(opts)
    plural, line_list = data_report.plural, data_report.line_list
    print(f"extract: {summary['samples']} {plural(summary['samples'], 'sample')} in {summary['out']} "
          f"({summary['written_this_run']} written now, {summary['tokens_this_run']} "
          f"{plural(summary['tokens_this_run'], 'token')}, {summary['seconds']:.1f} s{_time_split(summary)}, max-len "
          f"{summary['max_len']}); manifest {summary['manifest']}")
    if swept := len(summary["temp_files_swept"]):
        print(f"extract: removed {swept} temporary {plural(swept, 'file')} left by an earlier run")
    if disk_note := job.writers_set_the_pace(summary.get("pipeline")):
        print(f"extract: {disk_note}")
    print(data_report.text(summary["report"]))
    if args.report_plot:
        try:  # the training files are whole whatever happens to the picture
            print(f"extract: length histogram in {data_report.plot(summary['report'], args.report_plot)}")
        except Exception as exc:  # noqa: BLE001
            print(f"extract: the length histogram could not be drawn ({type(exc).__name__}: {exc}); the run's "
                  "files are complete: `eagle-compat report OUT --plot FILE` draws it again", file=sys.stderr)
    if skipped := summary["skipped"]:
        print(f"extract: skipped {len(skipped)} {plural(len(skipped), 'conversation')} whose assistant tokens could "
              f"not all be located (--skip-uncovered; {line_list([s['line'] for s in skipped], len(skipped))}; "
              "reasons in manifest.json)")
    if left := summary.get("left_out_non_finite"):
        print(f"extract: left out {len(left)} {plural(len(left), 'sample')} whose hidden states hold NaN or Inf "
              f"(--skip-non-finite; {line_list([e['line'] for e in left], len(left))}; what was found in "
              "manifest.json's left_out_non_finite)")
    if not summary["complete"]:
        print(f"extract: shard {summary['shard']} done; {summary['samples']} of {summary['samples_in_data']} "
              f"{plural(summary['samples_in_data'], 'sample is', 'samples are')} in the directory. data_config.json (--format arrow: the Arrow dataset) is written by the run that "
              "completes the set: run the other "
              "shards into this directory (or copy their files here and run once more without --shard, with "
              "--resume)")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from .extract import convert

    summary = convert.convert(args.src, args.dst, to=args.to, resume=args.resume, num_layers=args.num_layers)
    print(f"convert: {summary['samples']} samples, {summary['from']} -> {summary['to']} in {summary['dst']} "
          f"({summary['written']} written now); layers (leaving, speculators 0.3.0) {summary['layer_ids']}; a drafter "
          f"config trained on them carries eagle_aux_hidden_state_layer_ids {summary['eagle_aux_hidden_state_layer_ids']}")
    return 0


def demo_extract(path: str, out_dir: str, layer_ids: list[int]) -> bool:
    """The main job on the shipped conversations, then one written sample checked against HF."""
    import importlib.resources as res

    import torch

    from .extract import job, writer

    data = str(res.files("eagle_compat") / "data" / "demo_conversations.jsonl")
    opts = job.ExtractOptions(model=path, data=data, out=out_dir, layers=layer_ids, batch_size=8, max_len=512,
                              resume=os.path.exists(os.path.join(out_dir, "manifest.json")), validate=True,
                              gpu_memory_utilization=_default_gmu())
    summary = job.run(opts)
    from .extract import report
    print(f"\nextract: {summary['samples']} training files in {out_dir} ({summary['seconds']:.1f} s)")
    print(report.text(summary["report"]))
    sample = writer.load_sample(writer.sample_path(out_dir, 5, "pt"))
    from . import check as parity
    import json
    with open(os.path.join(out_dir, "manifest.json")) as f:
        precision = parity.precision_of(json.load(f).get("engine_dtype", "bfloat16"))
    layers = parity.judge([sample], path, [sample["input_ids"].tolist()], layer_ids, precision)
    ok = all(e.ok for e in layers)
    worst = (f"per-token relative error p{parity.PERCENTILE} {max(e.high for e in layers):.2e} at worst over "
             f"{len(layer_ids)} layers (HF's own {precision}: {max(e.reference_high for e in layers):.2e})"
             if precision != "fp32" else f"max abs error {max(e.max_abs for e in layers):.2e} (fp32)")
    print(f"data_5.pt vs HF: {worst}: {'ok' if ok else 'FAILED'}; assistant tokens in its loss mask: "
          f"{int(sample['loss_mask'].sum())}/{sample['loss_mask'].numel()}")
    return ok and torch.isfinite(sample["hidden_states"][0]).all().item()


TRUST_REMOTE_CODE_HELP = ("run the Python code the model folder ships (its config's auto_map), as transformers' "
                          "trust_remote_code; only for a model whose source you trust (default off)")


def build_parser() -> argparse.ArgumentParser:
    from .extract import job_options  # the options' defaults and choices from their owners
    from .extract.conversation import LOSS_MASKS
    default = job_options.defaults()
    parser = argparse.ArgumentParser(prog="eagle-compat", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="versions, detected vLLM API features, patches needed, model contract")
    p.add_argument("--model", help="local model directory: start an engine and print its decoder contract")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object on stdout")
    p.add_argument("--trust-remote-code", action="store_true", help=TRUST_REMOTE_CODE_HELP)
    p.add_argument("--release", default=None, help="list what eagle_compat changes on this vLLM release, from the "
                                                     "declared contracts (no vLLM needed)")
    p.add_argument("--fix", action="store_true",
                   help="uninstall torchvision/torchaudio/torchcodec builds that cannot load next to this torch")
    p.add_argument("--verbose", action="store_true",
                   help="after the verdict and the versions, also list the CPU's kernel flags, the vLLM API features "
                        "detected, the patch units and workarounds that apply, the start-up hook and vLLM's bytecode "
                        "(default: the verdict, what to do, the versions; --json always has everything)")
    p.set_defaults(func=cmd_doctor)
    p = sub.add_parser("demo", help="tiny model + speculators 0.3.0 under install(), compared with HF")
    from .capture.families import TINY
    p.add_argument("--family", default="deepseek_v3", choices=sorted(n for n, (_, t) in TINY.items() if not t.wraps),
                   help="the tiny model's architecture, built here with random weights (default deepseek_v3)")
    p.add_argument("--out", default="out/demo", help="where the demo's training files go")
    p.add_argument("--verbose", action="store_true", help="show vLLM's logs and warnings")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("convert", help="speculators 0.3.0 files (data_{i}.pt) <-> Arrow layout (speculators 0.8-0.9)")
    p.add_argument("src", help="a complete directory written by eagle-compat extract (or convert)")
    p.add_argument("dst", help="a new or empty directory")
    p.add_argument("--to", choices=["pt", "safetensors", "arrow", "arrow-fp8"],
                   help="default: arrow for data_{i} files, pt for an Arrow directory")
    p.add_argument("--resume", action="store_true", help="complete an interrupted conversion into DST")
    p.add_argument("--num-layers", type=int, default=None,
                   help="the model's decoder layers, for speculators 0.3.0's own output (data_config.json, no "
                        "manifest.json) whose model directory is not here")
    p.set_defaults(func=cmd_convert)
    p = sub.add_parser("extract", help="conversations or token ids -> EAGLE-3 training files")
    p.add_argument("--model", required=True,
                   help="a local model folder, or a Hugging Face name already in the local cache (HF_HUB_CACHE); "
                        "nothing is downloaded")
    p.add_argument("--data", help="JSONL: {'conversations': [...]} or {'input_ids': [...]} (needed but with "
                                  "--preflight)")
    p.add_argument("--out", help="the training files' directory, new or made by extract (needed but with "
                                 "--preflight)")
    p.add_argument("--layers", help="comma-separated layer ids, ascending, the last N-1 (the final pre-norm state "
                                    "speculators' trainers take as the target); default speculators' "
                                    "[2, N//2, N-3, N-1]")
    p.add_argument("--batch-size", type=int, default=default["batch_size"],
                   help=f"prompts per engine call (default {default['batch_size']})")
    p.add_argument("--max-len", type=int, default=None,
                   help="tokens per sample (longer ones are truncated); default min(2048, what the model takes)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    p.add_argument("--verify-kept", action="store_true",
                   help="with --resume: open every kept file to check it (on 8 threads where reads wait on storage) "
                        "instead of trusting the files the directory's index says its runs wrote, unchanged since "
                        "(the default: a restart in seconds)")
    p.add_argument("--shard", default="/".join(map(str, default["shard"])), metavar="I/N",
                   help="this machine's share of the batches: every N-th batch, starting at batch I; I counts from 0 "
                        "(0 <= I < N); run each I into the same --out (default 0/1: all)")
    p.add_argument("--validate", action="store_true",
                   help="check ids, lengths, NaN/Inf before writing, and that loss masks spell the assistant replies")
    p.add_argument("--skip-uncovered", action="store_true",
                   help="leave out (count, list) conversations whose assistant tokens cannot all be located, "
                        "instead of stopping")
    p.add_argument("--skip-non-finite", action="store_true",
                   help="leave out (list in manifest.json and the summary) samples whose hidden states hold NaN or "
                        "Inf, instead of stopping; may be added on --resume to finish a set such a sample stopped "
                        "(pt and safetensors formats)")
    p.add_argument("--format", default=default["format"], choices=job_options.FORMATS,
                   help="pt/safetensors: speculators 0.3.0's data_{i} files; arrow: speculators 0.8-0.9's Arrow "
                        "dataset + hidden_states/hs_{i}.safetensors; arrow-fp8: the same, states in hs-connectors' "
                        "FP8 format (docs/formats.md); default pt")
    p.add_argument("--tensor-parallel-size", type=int, default=default["tensor_parallel_size"],
                   help=f"default {default['tensor_parallel_size']}")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of device memory for the engine (default 0.8 on a GPU, 0.3 on CPU)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="the KV cache's size in bytes, instead of what --gpu-memory-utilization leaves")
    p.add_argument("--dtype", default=default["dtype"],
                   help=f"the engine's dtype (default {default['dtype']}: bf16 for float32 checkpoints, as speculators "
                        "runs it; float32 for exact parity)")
    p.add_argument("--trust-remote-code", action="store_true", help=TRUST_REMOTE_CODE_HELP)
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar on stderr (samples, samples/s, tokens/s); default: shown")
    p.add_argument("--min-loss-tokens", type=int, default=default["min_loss_tokens"], metavar="N",
                   help="leave out samples with fewer than N tokens in their loss mask after --max-len (default 1: "
                        "a sample with nothing to train on; 0 keeps everything); counted and listed in the report")
    p.add_argument("--loss-mask", choices=LOSS_MASKS, default=default["loss_mask"],
                   help="what of each assistant reply is trained on: generated (default: its reasoning where the "
                        "template renders it, its content, its tool calls) or replies (its content only)")
    p.add_argument("--report-plot", metavar="PNG", help="also draw the length histogram (needs matplotlib)")
    p.add_argument("--verbose", action="store_true", help="show vLLM's logs, warnings and its model-load bar")
    p.add_argument("--preflight", action="store_true",
                   help="only check, in seconds, that the model will run: its config cut to a few layers with dummy "
                        "weights, the decoder contract resolved and one short capture (no weights read, nothing "
                        "written)")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run the batches on a pool of Ray actors: ADDRESS (host:port or ray://...), 'auto' (the "
                        "cluster on this node), or nothing (RAY_ADDRESS, else a new local cluster); needs the [ray] "
                        "extra")
    p.add_argument("--ray-actors", type=int, default=None,
                   help="actors in the pool, one engine each (default: as many as the cluster fits)")
    p.add_argument("--ray-cpus-per-actor", type=int, default=None,
                   help="CPUs reserved per actor (default: --tensor-parallel-size on CPU, 1 on GPU; GPUs per actor "
                        "are --tensor-parallel-size)")
    p.set_defaults(func=cmd_extract)
    p = sub.add_parser("check", help="extraction on this vLLM vs HF transformers (tiny models or --model); for CI")
    p.add_argument("--family", action="append", help="tiny model family (repeatable; default llama, deepseek_v3)")
    p.add_argument("--checks", default="shim,generator",
                   help="shim (speculators under install()), generator, extract (the command line's files)")
    p.add_argument("--model", help="a local checkpoint instead of tiny models")
    p.add_argument("--dtype", default="float32", help="the generator's engine dtype (the shim always runs auto)")
    p.add_argument("--trust-remote-code", action="store_true", help=TRUST_REMOTE_CODE_HELP)
    p.add_argument("--json", action="store_true", help="print the versions and each result as one JSON object")
    p.add_argument("--preflight", action="store_true",
                   help="with --model: in seconds, without reading its weights, whether the checkpoint will run (its "
                        "config cut to a few layers, dummy weights, the decoder contract and one short capture)")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("report", help="what a finished directory's data is: samples, tokens, loss tokens, truncation, "
                                      "lengths (ours or speculators 0.3.0's)")
    p.add_argument("dir", help="a directory written by eagle-compat extract or convert, or speculators 0.3.0's "
                               "data_{i}.pt files")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--plot", metavar="PNG", help="also draw the length histogram (needs matplotlib)")
    p.set_defaults(func=cmd_report)
    sub.add_parser("run", help="run SCRIPT.py ARGS... (or -m MODULE ARGS...) unmodified under install()")
    return parser


def _resume_hint(args: argparse.Namespace) -> None:
    if args.command == "extract":
        print(f"eagle-compat extract: every file already in {args.out} is complete (no partial file is counted); "
              "rerun the same command with --resume to continue", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    if argv is not None:  # called from Python: processes it shares with its caller are the caller's
        return _main(argv)
    # the command line: every process it started ends with it, on every way out (a hung vLLM worker keeps its GPU
    # memory); SIGTERM and SIGHUP, whose default skips `finally`, end them first
    from . import leftovers
    processes = leftovers.CommandProcesses()
    put_back_handlers = leftovers.end_on_deadly_signals()
    try:
        return _main(sys.argv[1:])
    finally:
        try:
            ray = sys.modules.get("ray")
            if ray is not None and getattr(ray, "is_initialized", lambda: False)():
                ray.shutdown()  # a local cluster this run started ends the way Ray ends it, before anything is counted
        finally:
            ended = processes.end()
            put_back_handlers()
            if ended:
                print(leftovers.ended_line(ended), file=sys.stderr)


def _main(argv: list[str]) -> int:
    if argv[:2] == ["run", "--online"]:  # speculators' trainer, its data from the engine (online_trainer.py)
        from . import online_trainer
        return online_trainer.main(argv[2:])
    if argv[:1] == ["run"]:  # everything after `run` belongs to the script: argparse must not read it
        from . import launcher
        return launcher.main(argv[1:])
    args = build_parser().parse_args(argv)
    from .errors import EagleCompatError, InvalidInput, WorkerError
    from .extract.atomic_io import OutputWriteError
    try:
        return int(args.func(args) or 0)
    except InvalidInput as exc:
        print(f"eagle-compat {args.command}: {exc}", file=sys.stderr)
        return 2
    except OutputWriteError as exc:
        print(f"eagle-compat {args.command}: {exc}", file=sys.stderr)
        return 1
    except WorkerError as exc:  # the worker's own traceback is in the message; the driver's adds nothing
        print(f"eagle-compat {args.command}: {exc}", file=sys.stderr)
        _resume_hint(args)
        return 1
    except EagleCompatError as exc:  # refusals (environment, model): they name the cause and the fix
        print(f"eagle-compat {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        if getattr(exc, "run_failed", False):  # a run that failed part-way (extract --ray): not a refusal
            _resume_hint(args)
            return 1
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C: one line, no traceback (the job says what is kept)
        print(f"eagle-compat {args.command}: {exc or 'interrupted'}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
