"""Run a Python script as __main__ with torch's and Python's random seeds set first: speculators 0.3.0's
`scripts/train.py` sets none, so two trainings would start from the same initial weights (torch's fixed default seed)
and differ only by GPU nondeterminism. The script itself runs unmodified.

    python -m eagle_compat benchmarks/seeded.py SEED SCRIPT.py ARGS...
    python benchmarks/seeded.py --smoke   # a script printing its first draws and arguments, under seed 0 (CI)
"""
import os
import random
import runpy
import shutil
import sys
import tempfile

import torch

smoke = sys.argv[1:] == ["--smoke"]
if smoke:  # tests/test_benchmark_smoke.py compares the draws with seed 0's
    folder = tempfile.mkdtemp(prefix="seeded-")
    with open(os.path.join(folder, "draws.py"), "w") as f:
        f.write("import random, sys, torch\nprint('draws', random.random(), torch.rand(1).item(), sys.argv[1:])\n")
    sys.argv[1:] = ["0", os.path.join(folder, "draws.py"), "--an-argument"]
seed, script, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
random.seed(seed)
torch.manual_seed(seed)  # also seeds CUDA's generators
sys.argv = [script, *args]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    if smoke:
        shutil.rmtree(folder, ignore_errors=True)
