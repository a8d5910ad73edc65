"""Layer ids in the two conventions in use, and the mapping between them.

* speculators 0.3.0 (and `eagle-compat extract --layers`): id k is the residual stream **leaving** decoder layer k;
  the last layer N-1 is the input of the final norm (pre-norm).
* vLLM's native `extract_hidden_states` (what speculators >= 0.5 runs) and EAGLE-3 drafters at inference
  (`eagle_aux_hidden_state_layer_ids`): id k is the residual stream **entering** decoder layer k; id N is the final
  pre-norm state (entering the final norm). id 0 would be the embeddings.

So entering = leaving + 1, for every layer, the final pre-norm state included (leaving N-1 == entering N). HF
transformers' `output_hidden_states[j]` is entering id j for j <= N-1; its `[N]` is after the final norm, so the
pre-norm state is not among HF's outputs (the tests take it with a hook on the norm).
"""
from __future__ import annotations

from typing import Any

from ..errors import InvalidInput
# checked where the job checks its other options (options.py, a leaf); convert and report take them from here
from ..options import check_training_layers, to_entering  # noqa: F401


def record(layer_ids: list[int], num_layers: int) -> dict[str, Any]:
    """The manifest's `layers` block: both conventions, slot by slot, and what a drafter config must carry."""
    entering = to_entering(layer_ids)
    last_is_final = bool(layer_ids) and layer_ids[-1] == num_layers - 1
    return {
        "num_layers": num_layers,
        "leaving_speculators_0_3_0": list(layer_ids),
        "entering_vllm_native": entering,
        "final_pre_norm": {"leaving": num_layers - 1, "entering": num_layers},
        "slots": "slot j of a sample (hidden_states[j] in data_{i}; hidden_states[:, j] in hs_{i}) is leaving id "
                 "leaving_speculators_0_3_0[j] == entering id entering_vllm_native[j]",
        # the drafter reads the auxiliary layers (all but the last slot) in the entering convention; the last slot
        # is the verifier's last hidden state, which the drafter does not list
        "eagle_aux_hidden_state_layer_ids": entering[:-1] if last_is_final else None,
        "eagle_aux_hidden_state_layer_ids_note": (
            "the ids to put in an EAGLE-3 drafter config (vLLM, speculators >= 0.5) trained on these files: the "
            "auxiliary slots (all but the last) in the entering convention. Writing the leaving ids there instead "
            "shifts every auxiliary layer by one with no error anywhere" if last_is_final else
            "not defined: the last slot is not the final pre-norm state (leaving N-1), so these files have no "
            "verifier-last slot in the layout speculators' trainers read"),
    }


def problems_of(record: dict) -> list[str]:
    """What makes a finished directory's files train a drafter wrongly, as its record shows it: layers an earlier
    release did not check (check_training_layers), or a conversion of speculators 0.3.0's own output that an earlier
    release read in data_config.json's order instead of the files' (model) order."""
    problems = []
    ids, n = record.get("layer_ids"), record.get("num_layers")
    if ids and n:
        try:
            check_training_layers([int(k) for k in ids], int(n), "its layers")
        except InvalidInput as exc:
            problems.append(f"{exc} (written by an earlier release, which did not check this)")
    converted = record.get("converted_from") or {}
    order = converted.get("slot_order")
    if (str((record.get("settings") or {}).get("made_by", "")).startswith("speculators 0.3.0") and order and
            order != list(range(len(order)))):
        problems.append("converted from speculators 0.3.0's own output by an earlier release, which took the layers "
                        "in data_config.json's order, not in the files' (model) order: the slots are permuted. "
                        "Convert the source again")
    return problems
