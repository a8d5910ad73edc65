"""On an H200: speculators 0.3.0's `scripts/train.py` (vendored, unmodified) trains for real (CUDA, its
torch.compile'd forward with FlexAttention, backward, checkpoint) under `python -m eagle_compat`, with the units its
trainer needs here (speculators_config_init, speculators_trainer_target_norm), on synthetic files of a tiny random
Llama verifier. A check of the units under the trainer's own compile and backward, before a long run depends on them.
No vLLM needed: carry .gpu/extra and .gpu/extra2 (pydantic) only.
usage: python3 scripts/gpu_trainer_check.py WORKDIR   -> prints TRAINER_CHECK {json}"""
import glob
import json
import os
import subprocess
import sys

import numpy as np
import torch

work = sys.argv[1]
os.makedirs(work, exist_ok=True)
repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

torch.manual_seed(0)
config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False)
LlamaForCausalLM(config).save_pretrained(f"{work}/verifier")
os.makedirs(f"{work}/data", exist_ok=True)
for i in range(64):
    n = 100
    mask = torch.zeros(n, dtype=torch.long)
    mask[10:] = 1
    torch.save({"input_ids": torch.randint(0, 512, (n,)), "loss_mask": mask,
                "hidden_states": [torch.randn(n, 64).to(torch.bfloat16) * (1 + 10 * (j == 3)) for j in range(4)]},
               f"{work}/data/data_{i}.pt")
np.save(f"{work}/d2t.npy", np.zeros(256, dtype=np.int64))  # draft token k = target token k
t2d = np.zeros(512, dtype=bool)
t2d[:256] = True
np.save(f"{work}/t2d.npy", t2d)
cmd = [sys.executable, "-m", "eagle_compat", f"{repo}/tests/data/speculators_v0_3_0/train.py",
       "--verifier-name-or-path", f"{work}/verifier", "--data-path", f"{work}/data", "--save-path", f"{work}/ckpt",
       "--epochs", "2", "--total-seq-len", "1024", "--d2t-path", f"{work}/d2t.npy", "--t2d-path", f"{work}/t2d.npy",
       "--log-dir", f"{work}/logs"]
proc = subprocess.run(cmd, capture_output=True, text=True, timeout=500, cwd=work)
log = proc.stdout + proc.stderr
open(f"{work}/train.log", "w").write(log)
losses = [float(x) for x in __import__("re").findall(r"val/loss_epoch=([0-9.]+)", log)]
saved = sorted(os.path.basename(p) for p in glob.glob(f"{work}/ckpt/*"))
print("TRAINER_CHECK " + json.dumps({"returncode": proc.returncode, "val_loss_per_epoch": losses,
                                     "checkpoints": saved, "tail": log[-1500:] if proc.returncode else ""}))
