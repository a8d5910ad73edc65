"""Whether each CUDA vLLM release's requirements can be carried to the H200 machine (it reaches no package
registry; docs/gpu-parity.md): for every requirement a release's wheel adds over vLLM 0.20.0's (whose bundle is
measured, scripts/gpu_bundle.sh), and for the torch its wheel pins where that is not the image's 2.11.0, ask this
machine's package registry for a wheel that fits the image (CPython 3.12, manylinux x86_64) and note its size.
Appends a markdown section per release to OUT.md and a JSON line to OUT.jsonl (read by
compat_matrix/render.py for the GPU table of docs/compatibility.md).

  python scripts/gpu_requirements_probe.py compat_matrix/results/gpu/carry-probe 0.21.0 0.22.1 ... 0.27.1

Nothing is installed: pip's dry run with --report, then the wheel's size from its download address.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

# every manylinux tag the image's glibc takes, none skipped: an earlier list lacked 2_18 and 2_31, the only tags
# of the NCCL and llguidance wheels, and called both "not served"
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            *[a for minor in range(35, 16, -1) for a in ("--platform", f"manylinux_2_{minor}_x86_64")],
            "--platform", "manylinux2014_x86_64"]
REFERENCE = "0.20.0"
IMAGE_TORCH = "2.11.0"


def resolve_one(requirement: str) -> dict | None:
    """The wheel pip would take for `requirement` alone (no dependencies), or None if none is served."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "r.json")
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
                               "--no-deps", "--target", os.path.join(tmp, "t"), *PLATFORM, "--report", report,
                               requirement], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0 or not os.path.exists(report):
            return None
        item = json.load(open(report))["install"][0]
    url = item["download_info"]["url"]
    head = subprocess.run(["curl", "-sIL", url], capture_output=True, text=True, timeout=120).stdout
    sizes = [line.split(":", 1)[1].strip() for line in head.splitlines() if line.lower().startswith("content-length")]
    return {"name": item["metadata"]["name"], "version": item["metadata"]["version"],
            "requires": item["metadata"].get("requires_dist", []),
            "mb": round(int(sizes[-1]) / 1e6, 1) if sizes else None}


def base_requirements(meta: dict) -> list[str]:
    return sorted(r for r in meta.get("requires") or [] if "extra ==" not in r)


def strip_marker(requirement: str) -> str:
    return requirement.split(";", 1)[0].strip()


def main() -> int:
    out, releases = sys.argv[1], sys.argv[2:]
    ref = resolve_one(f"vllm=={REFERENCE}")
    ref_reqs = set(base_requirements(ref))
    with open(out + ".md", "a") as f, open(out + ".jsonl", "a") as jf:
        for release in releases:
            meta = resolve_one(f"vllm=={release}")
            if meta is None:
                f.write(f"\n## vllm {release}\nno CUDA wheel for CPython 3.12 served\n")
                jf.write(json.dumps({"release": release, "wheel_served": False}) + "\n")
                continue
            added = sorted(set(base_requirements(meta)) - ref_reqs)
            torch_pin = next((strip_marker(r) for r in base_requirements(meta) if r.startswith("torch")), "torch")
            lines = [f"\n## vllm {release} (wheel {meta['mb']} MB; {torch_pin})"]
            missing = []
            wanted = [strip_marker(r) for r in added]
            if f"=={IMAGE_TORCH}" not in torch_pin:
                torch = resolve_one(torch_pin)
                lines.append(f"- {torch_pin}: " + (f"served, {torch['version']}, {torch['mb']} MB" if torch else
                                                    "NOT served"))
                if torch is None:
                    missing.append(torch_pin)
                else:  # the CUDA libraries and Triton it pins, which the image has at other versions
                    wanted += [strip_marker(r) for r in base_requirements(torch)
                               if r.startswith(("nvidia-", "triton", "cuda-"))]
            total = meta["mb"] or 0.0
            for requirement in wanted:
                got = resolve_one(requirement)
                if got is None:
                    missing.append(requirement)
                    lines.append(f"- {requirement}: NOT served")
                else:
                    total += got["mb"] or 0.0
                    lines.append(f"- {requirement}: served, {got['name']} {got['version']}, {got['mb']} MB")
            lines.append(f"- to carry beyond the image (these and the wheel): {total:.0f} MB, "
                         f"{int(total // 57) + 1} calls of 57 MB; "
                         + ("every added requirement served" if not missing else
                            f"not served: {', '.join(missing)}"))
            f.write("\n".join(lines) + "\n")
            jf.write(json.dumps({"release": release, "wheel_served": True, "wheel_mb": meta["mb"], "torch": torch_pin,
                                 "not_served": missing, "carry_mb": round(total), "carry_calls": int(total // 57) + 1})
                     + "\n")
            f.flush()
            jf.flush()
            print(lines[0], "missing:", missing, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
