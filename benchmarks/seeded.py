"""Run a Python script as __main__ with torch's and Python's random seeds set first: speculators 0.3.0's
`scripts/train.py` sets none, so two trainings would start from the same initial weights (torch's fixed default seed)
and differ only by GPU nondeterminism. The script itself runs unmodified.

    python -m eagle_compat benchmarks/seeded.py SEED SCRIPT.py ARGS...
"""
import random
import runpy
import sys

import torch

seed, script, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
random.seed(seed)
torch.manual_seed(seed)  # also seeds CUDA's generators
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
