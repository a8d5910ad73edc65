"""speculators 0.3.0's trainer, as its `scripts/train.py` (vendored beside this file) builds it, on files written by
`eagle-compat extract`: the drafter config and model (train.py's own helpers), its dataset reader and collate over
our files, one forward pass with the training loss, then save and reload, as its checkpointer does each epoch; and
how often the top token of the target it trains on is the verifier's own (HF: final norm, then lm_head).
On CPU the pass runs without gradients (FlexAttention has no CPU backward); the GPU run is docs/training-proof.md.

usage: python -m eagle_compat speculators_trainer_forward.py MODEL DATA_DIR VOCAB_SIZE SAVE_DIR
Prints one line `TRAINER_FORWARD {json}`."""
import json
import os
import sys

import numpy as np
import torch

model, data, draft_vocab, save = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
sys.argv = [sys.argv[0], "--verifier-name-or-path", model, "--total-seq-len", "1024"]
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "speculators_v0_3_0"))
import train  # noqa: E402  speculators 0.3.0's scripts/train.py, unmodified

from speculators.config import SpeculatorsConfig, VerifierConfig  # noqa: E402
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig  # noqa: E402
from speculators.proposals.greedy import GreedyTokenProposalConfig  # noqa: E402
from speculators.train.data import (Eagle3SampleFileDataset, create_collate_fn, list_files,  # noqa: E402
                                    standardize_data_v1)
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution  # noqa: E402

train.args = train.parse_args()
files = sorted(str(p) for p in list_files(data))
counts = {}
for f in files:
    s = torch.load(f, weights_only=True)
    for t in s["input_ids"][s["loss_mask"].bool()].tolist():
        counts[t] = counts.get(t, 0) + 1
config = train.create_transformer_layer_config(model, 1)
d2t, t2d = build_vocab_mappings_from_distribution(counts, draft_vocab, config.vocab_size)
speculator_config = Eagle3SpeculatorConfig(  # as train.main() builds it
    transformer_layer_config=config, draft_vocab_size=d2t.shape[0], norm_before_residual=train.NORM_BEFORE_RESIDUAL,
    speculators_config=SpeculatorsConfig(
        algorithm="eagle3", default_proposal_method="greedy",
        proposal_methods=[GreedyTokenProposalConfig(proposal_type="greedy", speculative_tokens=3)],
        verifier=VerifierConfig(name_or_path=model, architectures=["LlamaForCausalLM"])))
drafter = Eagle3DraftModel(config=speculator_config, t2d=t2d, d2t=d2t).eval()
dataset = Eagle3SampleFileDataset(file_list=files, max_len=1024, standardize_fn=standardize_data_v1)
batch = create_collate_fn(1024)([dataset[i] for i in range(len(files))])
with torch.no_grad():
    _, loss, metrics = drafter(**batch, use_off_policy_tokens=False, ttt_steps=3, ttt_step_loss_decay=1.0)
# the target the drafter is trained on, against the verifier's own next-token logits (HF, final norm then lm_head)
from transformers import AutoModelForCausalLM  # noqa: E402
verifier = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
last = batch["verifier_last_hidden_states"][0]
with torch.no_grad():
    target = drafter.verifier_lm_head(last)
    verifier_logits = verifier.lm_head(verifier.model.norm(last))[:, t2d.bool()]
in_loss = batch["loss_mask"][0].bool()
agreement = float((target.argmax(-1) == verifier_logits.argmax(-1))[in_loss].float().mean())
drafter.save_pretrained(save)
reloaded = Eagle3SpeculatorConfig.from_pretrained(save)
saved = json.load(open(os.path.join(save, "config.json")))
print("TRAINER_FORWARD " + json.dumps({
    "samples": len(files), "aux_width": batch["hidden_states"].shape[-1], "hidden": config.hidden_size,
    "loss": float(loss), "metrics": sorted(metrics), "reloaded_draft_vocab": reloaded.draft_vocab_size,
    "saved_aux_ids": saved.get("eagle_aux_hidden_state_layer_ids", "absent"),
    "loss_tokens": int(batch["loss_mask"].sum()), "target_top1_agreement_with_verifier": agreement}))
