"""On an H200 machine, after scripts/gpu_setup.sh: how long the first use of FlashInfer's top-k/top-p
sampling kernels takes on a fresh machine. vLLM 0.21+ routes its sampler to FlashInfer when FlashInfer is installed
(VLLM_USE_FLASHINFER_SAMPLER defaults on) and warms it up at every engine start with top_k/top_p set
(gpu_model_runner._dummy_sampler_run); without prebuilt kernels FlashInfer compiles them with the image's nvcc.
Prints JSON lines: the compiler processes seen 45 s in, then the first call's time (vLLM's own call and arguments)."""
import json
import shutil
import subprocess
import threading
import time

import torch

started = time.time()


def compilers_running(after_s: float) -> None:
    time.sleep(after_s)
    ps = subprocess.run(["ps", "-eo", "etime,args"], capture_output=True, text=True).stdout
    seen = [line[:300] for line in ps.splitlines() if any(c in line for c in ("nvcc", "cicc", "ptxas", "ninja"))]
    print(json.dumps({"at_s": after_s, "compiler_processes": seen}), flush=True)


threading.Thread(target=compilers_running, args=(45,), daemon=True).start()
import flashinfer  # noqa: E402  (after the clock starts: its import is part of first use)
import flashinfer.sampling  # noqa: E402

logits = torch.randn(4, 32000, device="cuda")
k = torch.full((4,), 31999, dtype=torch.int32, device="cuda")
p = torch.full((4,), 0.9, device="cuda")
flashinfer.sampling.top_k_top_p_sampling_from_logits(logits, k, p, deterministic=True)
torch.cuda.synchronize()
first = time.time() - started
again = time.time()
flashinfer.sampling.top_k_top_p_sampling_from_logits(logits, k, p, deterministic=True)
torch.cuda.synchronize()
print(json.dumps({"flashinfer": flashinfer.__version__, "nvcc": shutil.which("nvcc"), "first_use_s": round(first, 1),
                  "second_call_s": round(time.time() - again, 4)}), flush=True)
