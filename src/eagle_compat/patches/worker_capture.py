"""speculators 0.3.0's worker extension replaces the base model's forward with a copy written for Llama:

* it gates on `supports_eagle3(model)` (False for DeepSeek/Kimi before 0.18, Gemma, Mixtral, GLM-4-MoE …);
* it reads `model.model` (a multimodal wrapper such as Kimi-K2.5 keeps it at `language_model.model`);
* it calls `get_input_embeddings`, renamed `embed_input_ids` in 0.11.1;
* it calls every layer as `layer(hidden_states=, positions=, residual=)` and expects a pair back (gpt-oss,
  Granite, Olmo2 differ) and drops per-family steps of the real forward (Gemma2's normalizer, Granite's
  embedding multiplier, DeepSeek's llama_4_scaling, sequence-parallel gathers).

Its `_setup_hidden_states_capture` is replaced by eagle_compat's capture (forward hooks on the decoder layers,
resolved per family at run time; the model's own forward runs untouched). The captured states keep speculators'
contract: one tensor per layer id in ascending layer order (duplicates collapse), rows in request order, stored
through speculators' own `_store_captured_states`, so its `_reset_capture` / `_get_captured_states` work as before.
"""
from __future__ import annotations

from ._base import WORKER_MODULE, PatchUnit


def _apply(patcher, module) -> None:
    from ..remote_errors import reported
    from ..capture.handshake import worker_report
    from ..capture.worker import CaptureSession

    @reported("_setup_hidden_states_capture")
    def _setup_hidden_states_capture(self, layer_ids):
        old = getattr(self, "_eagle_compat_session", None)
        if old is not None:
            old.close()
        self._layer_ids = frozenset(layer_ids)
        self._captured_states = None
        # speculators appends layers in the order its loop meets them: ascending, each once
        self._eagle_compat_session = CaptureSession(self, sorted(set(layer_ids)), self._store_captured_states)

    @reported("eagle_compat_handshake")
    def eagle_compat_handshake(self):
        return worker_report("shim")

    ext = module.HiddenStatesWorkerExtension
    patcher.set(ext, "_setup_hidden_states_capture", _setup_hidden_states_capture)
    # the driver asks every worker for this before any capture (capture/handshake.py): present only where patched
    patcher.set(ext, "eagle_compat_handshake", eagle_compat_handshake)


UNIT = PatchUnit(
    name="worker_capture",
    broke="speculators' replacement forward: eagle3 gate, model.model, get_input_embeddings, one guessed layer "
          "signature, dropped per-family steps",
    affects="",
    condition="every family from 0.11.1; DeepSeek/Kimi-K2.5/Gemma/Granite/gpt-oss on every release",
    delete_when="speculators captures with hooks or vLLM's native extract_hidden_states",
    target=WORKER_MODULE,
    sides=("driver", "worker"),
    silent=True,
    apply=_apply,
)
