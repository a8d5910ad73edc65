"""--format arrow and `eagle-compat convert` without an engine: the deterministic stand-in of
test_extract_integrity.py replaces vLLM (hidden states are a pure function of token, position and layer id), so these
tests are about the layout, the layer ids, resume and refusals. test_arrow.py checks the tensors on real vLLM against
HF and reads them back with speculators 0.9.0's own ArrowDataset."""
from __future__ import annotations

import json
import os

import pytest
import torch

from eagle_compat import InvalidInput, tiny_models
from eagle_compat.extract import arrow, atomic_io, convert, directory_lock, job, writer
from eagle_compat import options as options_mod
from eagle_compat.extract import layers as layers_mod

from test_extract_integrity import THINK_TEMPLATE, _opts, _with_template, _write_lines
from helpers import FakeEngine, prompts

NUM_LAYERS = 6  # the tiny Llama
LAYERS = [0, 2, 5]  # leaving; 5 = N-1, the final pre-norm state


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny Llama with a template that drops earlier turns' reasoning: a conversation can be uncovered."""
    return _with_template(tiny_models.build_tiny_model("llama"), tmp_path_factory.mktemp("think") / "model",
                          THINK_TEMPLATE)


@pytest.fixture
def dataset(tmp_path):
    """10 samples; line 4 is a conversation whose reply the template cannot locate (skipped with --skip-uncovered),
    so Arrow rows (0..8) and sample indices (0..9 without 4) differ from there on."""
    records = [{"input_ids": ids, "loss_mask": [int(k % 2 == 0) for k in range(len(ids))]}
               for ids in prompts(10, 10, 40, seed=9)]
    records[4] = {"conversations": [
        {"role": "user", "content": "w10 w11"}, {"role": "assistant", "content": "w12 w13 </think> w14 w15"},
        {"role": "user", "content": "w16"}, {"role": "assistant", "content": "w17 w18"}]}
    return _write_lines(tmp_path / "data.jsonl", records)


def _arrow_equal(a, b):
    """Same Arrow rows and the same hs files, tensor for tensor."""
    ra, rb = arrow.read_rows(str(a)), arrow.read_rows(str(b))
    assert ra.to_dict() == rb.to_dict() and len(ra) > 0
    assert arrow.hs_files(str(a)) == arrow.hs_files(str(b)) == [f"hs_{r}.safetensors" for r in range(len(ra))]
    for name in arrow.hs_files(str(a)):
        x = arrow.load_hs(os.path.join(a, "hidden_states", name))
        y = arrow.load_hs(os.path.join(b, "hidden_states", name))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name


def _pt_equal(a, b):
    names, other = writer.sample_files(str(a)), writer.sample_files(str(b))
    assert [n.split(".")[0] for n in names] == [n.split(".")[0] for n in other] and names
    for name, name_b in zip(names, other):
        x, y = writer.load_sample(os.path.join(a, name)), writer.load_sample(os.path.join(b, name_b))
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        assert len(x["hidden_states"]) == len(y["hidden_states"])
        assert all(torch.equal(h, g) for h, g in zip(x["hidden_states"], y["hidden_states"])), name


def test_arrow_layout_rows_layers_and_manifest(model, dataset, tmp_path, fake_engine):
    out = tmp_path / "out"
    summary = job.run(_opts(model, dataset, out, layers=LAYERS, format="arrow", skip_uncovered=True))
    skipped = {s["index"] for s in summary["skipped"]}
    assert skipped == {4}
    indices = [i for i in range(10) if i not in skipped]
    rows = arrow.read_rows(str(out))
    assert len(rows) == len(indices) == len(arrow.hs_files(str(out)))
    assert rows.column_names == ["input_ids", "loss_mask", "seq_len"]
    lines = [json.loads(x) for x in open(dataset)]
    for r, i in enumerate(indices):  # row r is the r-th sample present
        hs = arrow.load_hs(arrow.hs_path(str(out), r))
        assert set(hs) == {"hidden_states", "token_ids"} and hs["token_ids"].dtype == torch.long
        if "input_ids" in lines[i]:
            assert rows[r]["input_ids"] == lines[i]["input_ids"] == hs["token_ids"].tolist()
            assert rows[r]["loss_mask"] == lines[i]["loss_mask"]
        assert rows[r]["seq_len"] == len(rows[r]["input_ids"]) == hs["hidden_states"].shape[0]
        assert hs["hidden_states"].shape[1:] == (len(LAYERS), 256)
        want = FakeEngine("m", LAYERS).generate([hs["token_ids"].tolist()])[0]["hidden_states"]
        for j in range(len(LAYERS)):  # slot j is layer LAYERS[j]; the last slot is N-1
            assert torch.equal(hs["hidden_states"][:, j], want[j])
    m = json.load(open(out / "manifest.json"))
    assert m["layers"]["leaving_speculators_0_3_0"] == [0, 2, 5]
    assert m["layers"]["entering_vllm_native"] == [1, 3, 6]
    assert m["layers"]["eagle_aux_hidden_state_layer_ids"] == [1, 3]
    assert m["layers"]["final_pre_norm"] == {"leaving": 5, "entering": 6}
    assert m["settings"]["format"] == "arrow" and m["status"] == "complete"
    assert not (out / "data_config.json").exists()


@pytest.mark.parametrize("fmt", ["arrow", "pt", "safetensors"])
def test_training_files_need_ascending_layers_with_the_final_pre_norm_state_last(model, dataset, tmp_path, no_engine,
                                                                                 fmt):
    """Every format: speculators' trainers take the last slot as the verifier's last hidden state (0.3.0's
    standardize_data_v1, 0.8-0.9's Arrow reader) and the others in file order, while vLLM feeds a drafter its
    auxiliary states in model order at inference. Refused before anything is written."""
    out = tmp_path / "out"
    with pytest.raises(InvalidInput, match=r"the last layer must be the final pre-norm state, layer 5 .* id 6 in "
                                           r"vLLM's native 'entering' convention.*e\.g\. --layers 0,2,5"):
        job.run(_opts(model, dataset, out, layers=[0, 2], format=fmt))
    for unordered in ([5, 0, 2], [2, 0, 5]):
        with pytest.raises(InvalidInput, match=rf"layers \{unordered}\ .* are not in ascending order: .* "
                                               r"permuted features.*e\.g\. --layers 0,2,5"):
            job.run(_opts(model, dataset, out, layers=unordered, format=fmt))
    assert not out.exists()


def test_arrow_shards_and_resume_equal_a_clean_run(model, dataset, tmp_path, fake_engine):
    clean, out = tmp_path / "clean", tmp_path / "out"
    job.run(_opts(model, dataset, clean, layers=LAYERS, format="arrow", skip_uncovered=True))
    job.run(_opts(model, dataset, out, layers=LAYERS, format="arrow", skip_uncovered=True, shard=(0, 2)))
    assert not (out / "state.json").exists()  # a partial set cannot be opened as a dataset
    (out / ".arrow-dataset.tmp-999999").mkdir()  # what a run killed while writing the dataset leaves
    (out / "hidden_states" / "hs_2.safetensors.tmp-999999").write_bytes(b"partial")
    summary = job.run(_opts(model, dataset, out, layers=LAYERS, format="arrow", skip_uncovered=True, shard=(1, 2)))
    assert sorted(summary["temp_files_swept"]) == [".arrow-dataset.tmp-999999", "hidden_states/hs_2.safetensors.tmp-999999"]
    _arrow_equal(clean, out)
    os.unlink(arrow.hs_path(str(out), 3))
    with pytest.raises(writer.OutputDirectoryConflict, match="pass --resume"):
        job.run(_opts(model, dataset, out, layers=LAYERS, format="arrow", skip_uncovered=True))
    before = FakeEngine.started
    summary = job.run(_opts(model, dataset, out, layers=LAYERS, format="arrow", skip_uncovered=True, resume=True))
    assert summary["written_this_run"] == 4 and FakeEngine.started == before + 1  # the batch of hs_3, whole
    _arrow_equal(clean, out)


def test_a_directory_of_hs_files_without_a_record_is_refused(model, dataset, tmp_path, no_engine):
    out = tmp_path / "out"
    (out / "hidden_states").mkdir(parents=True)
    (out / "hidden_states" / "hs_0.safetensors").write_bytes(b"x")
    with pytest.raises(writer.OutputDirectoryConflict, match=r"1 sample files \(hidden_states/hs_0.safetensors\) "
                                                             "but no settings record"):
        job.run(_opts(model, dataset, out, layers=LAYERS, format="arrow"))
    with pytest.raises(InvalidInput, match="no eagle_compat settings record"):
        convert.convert(str(out), str(tmp_path / "dst"))


def test_convert_both_ways_equals_direct_runs(model, dataset, tmp_path, fake_engine):
    kw = dict(layers=LAYERS, skip_uncovered=True)
    pt, arr = tmp_path / "pt", tmp_path / "arrow"
    job.run(_opts(model, dataset, pt, **kw))
    job.run(_opts(model, dataset, arr, format="arrow", **kw))
    convert.convert(str(pt), str(tmp_path / "pt2arrow"))
    _arrow_equal(arr, tmp_path / "pt2arrow")
    convert.convert(str(arr), str(tmp_path / "arrow2pt"))
    _pt_equal(pt, tmp_path / "arrow2pt")
    convert.convert(str(arr), str(tmp_path / "arrow2st"), to="safetensors")
    _pt_equal(tmp_path / "arrow2pt", tmp_path / "arrow2st")
    m = json.load(open(tmp_path / "pt2arrow" / "manifest.json"))
    assert m["settings"] == json.load(open(arr / "manifest.json"))["settings"]  # extract --resume accepts it
    assert m["layers"]["eagle_aux_hidden_state_layer_ids"] == [1, 3]
    assert json.load(open(tmp_path / "arrow2pt" / "data_config.json"))["hidden_states"]["layer_ids"] == LAYERS
    # the converted directory is one an extract run of the same settings accepts as complete: nothing is redone
    before = FakeEngine.started
    job.run(_opts(model, dataset, tmp_path / "pt2arrow", format="arrow", resume=True, **kw))
    assert FakeEngine.started == before


def test_a_set_converted_from_fp8_is_accepted_by_a_resume_and_a_foreign_source_file_is_refused(model, dataset,
                                                                                                 tmp_path, fake_engine):
    """fp8 files convert to bfloat16 whatever the source's engine ran: the destination says so (`states_dtype`), or
    the stamp check of a resume refused every file as another precision. And a source file made otherwise (another
    run's, copied in) is refused by name rather than converted under a fresh stamp."""
    kw = dict(layers=LAYERS, skip_uncovered=True)
    fp8 = tmp_path / "fp8"
    job.run(_opts(model, dataset, fp8, format="arrow-fp8", **kw))
    convert.convert(str(fp8), str(tmp_path / "fp8_to_pt"), to="pt")
    before = FakeEngine.started
    assert job.run(_opts(model, dataset, tmp_path / "fp8_to_pt", resume=True, **kw))["complete"]
    assert job.run(_opts(model, dataset, tmp_path / "fp8_to_pt", resume=True, shard=(0, 2), **kw))["complete"]
    assert FakeEngine.started == before
    os.unlink(tmp_path / "fp8_to_pt" / "data_0.pt")  # a file to redo: not beside states of another precision
    with pytest.raises(writer.OutputDirectoryConflict, match=r"was converted from arrow-fp8 with loss"):
        job.run(_opts(model, dataset, tmp_path / "fp8_to_pt", resume=True, **kw))
    assert FakeEngine.started == before
    pt, other = tmp_path / "pt", tmp_path / "other"
    job.run(_opts(model, dataset, pt, **kw))
    job.run(_opts(model, dataset, other, layers=[1, 2, 5], skip_uncovered=True))
    os.replace(other / "data_3.pt", pt / "data_3.pt")
    with pytest.raises(InvalidInput, match=r"SRC .*data_3\.pt: its states were made with other settings"):
        convert.convert(str(pt), str(tmp_path / "pt_to_arrow"))


def test_convert_refuses_files_without_the_final_layer_and_puts_layers_in_ascending_order(
        model, dataset, tmp_path, fake_engine, monkeypatch):
    """Sets extracted before extract refused such layers (layers.check_training_layers) may hold any layers in any
    order: without the final pre-norm state they are refused, otherwise their slots are put in ascending order."""
    with monkeypatch.context() as m:
        m.setattr(layers_mod, "check_training_layers", lambda *a: None)  # an extract of an earlier release
        m.setattr(options_mod, "check_training_layers", lambda *a: None)
        job.run(_opts(model, dataset, tmp_path / "no_last", layers=[0, 2], skip_uncovered=True))
        job.run(_opts(model, dataset, tmp_path / "last_first", layers=[5, 0, 2], skip_uncovered=True))
        job.run(_opts(model, dataset, tmp_path / "aux_swapped", layers=[2, 0, 5], skip_uncovered=True))
    for to in ("arrow", "safetensors"):
        with pytest.raises(InvalidInput, match=rf"cannot become training files in '{to}': its files hold layers "
                                               r"\[0, 2\] \(leaving; entering \[1, 3\]\) of a 6-layer model, without the "
                                               r"final pre-norm state \(leaving 5, entering 6\)"):
            convert.convert(str(tmp_path / "no_last"), str(tmp_path / "dst"), to=to)
    assert not (tmp_path / "dst").exists()
    job.run(_opts(model, dataset, tmp_path / "direct", layers=LAYERS, format="arrow", skip_uncovered=True))
    job.run(_opts(model, dataset, tmp_path / "direct_pt", layers=LAYERS, format="safetensors", skip_uncovered=True))
    for src in ("last_first", "aux_swapped"):
        summary = convert.convert(str(tmp_path / src), str(tmp_path / f"{src}_arrow"))
        assert summary["layer_ids"] == [0, 2, 5] and summary["eagle_aux_hidden_state_layer_ids"] == [1, 3]
        _arrow_equal(tmp_path / "direct", tmp_path / f"{src}_arrow")
        convert.convert(str(tmp_path / src), str(tmp_path / f"{src}_st"), to="safetensors")
        _pt_equal(tmp_path / "direct_pt", tmp_path / f"{src}_st")


def test_convert_refuses_an_incomplete_source_and_resumes_into_its_own_dst(model, dataset, tmp_path, fake_engine):
    job.run(_opts(model, dataset, tmp_path / "half", layers=LAYERS, skip_uncovered=True, shard=(0, 2)))
    with pytest.raises(InvalidInput, match="is not complete .* --resume first"):
        convert.convert(str(tmp_path / "half"), str(tmp_path / "dst"))
    job.run(_opts(model, dataset, tmp_path / "half", layers=LAYERS, skip_uncovered=True, shard=(1, 2)))
    convert.convert(str(tmp_path / "half"), str(tmp_path / "dst"))
    os.unlink(arrow.hs_path(str(tmp_path / "dst"), 2))
    with pytest.raises(InvalidInput, match="pass --resume"):
        convert.convert(str(tmp_path / "half"), str(tmp_path / "dst"))
    assert convert.convert(str(tmp_path / "half"), str(tmp_path / "dst"), resume=True)["written"] == 1
    job.run(_opts(model, dataset, tmp_path / "direct", layers=LAYERS, format="arrow", skip_uncovered=True))
    _arrow_equal(tmp_path / "direct", tmp_path / "dst")
    with pytest.raises(InvalidInput, match="already holds another extraction"):
        convert.convert(str(tmp_path / "direct"), str(tmp_path / "dst"), resume=True)


def test_convert_takes_speculators_0_3_0_own_output(model, dataset, tmp_path, fake_engine):
    """What speculators 0.3.0's data_generation_offline.py leaves (e.g. under `eagle-compat run`): data_{i}.pt and
    data_config.json, no manifest. Its ids are 0.3.0's (leaving); the layer count comes from its model directory or
    --num-layers."""
    kw = dict(layers=LAYERS, skip_uncovered=True)
    own = tmp_path / "own"
    job.run(_opts(model, dataset, own, **kw))
    for name in ("manifest.json", ".eagle-compat.lock"):
        os.unlink(own / name)
    job.run(_opts(model, dataset, tmp_path / "direct", format="arrow", **kw))
    summary = convert.convert(str(own), str(tmp_path / "dst"))
    assert summary["eagle_aux_hidden_state_layer_ids"] == [1, 3]
    _arrow_equal(tmp_path / "direct", tmp_path / "dst")
    cfg = json.load(open(own / "data_config.json"))
    cfg["model"]["target_model_path"] = "/elsewhere/model"
    json.dump(cfg, open(own / "data_config.json", "w"))
    with pytest.raises(InvalidInput, match="number of decoder layers is unknown .* pass --num-layers N"):
        convert.convert(str(own), str(tmp_path / "dst2"))
    with pytest.raises(InvalidInput, match=r"cannot become training files in 'arrow': its files hold layers \[0, 2, 5\] "
                                           r"\(leaving; entering \[1, 3, 6\]\) of a 9-layer model"):
        convert.convert(str(own), str(tmp_path / "dst2"), num_layers=9)
    convert.convert(str(own), str(tmp_path / "dst2"), num_layers=6)
    _arrow_equal(tmp_path / "direct", tmp_path / "dst2")
    os.unlink(own / "data_1.pt")
    with pytest.raises(InvalidInput, match="holds 8 data_{i} files, its data_config.json says 9 samples"):
        convert.convert(str(own), str(tmp_path / "dst3"), num_layers=6)


def test_the_manifest_says_complete_only_after_the_arrow_dataset_is_written(model, dataset, tmp_path, fake_engine,
                                                                             monkeypatch):
    import errno
    out = tmp_path / "out"

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(arrow, "write_dataset", full_disk)
    with pytest.raises(atomic_io.OutputWriteError, match="could not write the Arrow dataset"):
        job.run(_opts(model, dataset, out, layers=LAYERS, format="arrow", skip_uncovered=True))
    m = json.load(open(out / "manifest.json"))
    assert m["status"] == "incomplete" and "Arrow dataset" in m["runs"][-1]["status"], m["status"]
    monkeypatch.undo()
    job.run(_opts(model, dataset, out, layers=LAYERS, format="arrow", skip_uncovered=True, resume=True))
    assert json.load(open(out / "manifest.json"))["status"] == "complete" and len(arrow.read_rows(str(out))) == 9


def test_replacing_the_arrow_dataset_keeps_the_earlier_one_whole_until_the_new_one_is_in(model, dataset, tmp_path,
                                                                                          fake_engine, monkeypatch):
    """A run that dies while moving the new dataset in (here: at state.json) leaves the earlier dataset readable: its
    data files are removed only once the new state.json is in place."""
    import datasets
    out = tmp_path / "out"
    job.run(_opts(model, dataset, out, layers=LAYERS, format="arrow", skip_uncovered=True))
    # the earlier dataset under other data file names (as a dataset of another size has)
    state = json.load(open(out / "state.json"))
    (old,) = [f["filename"] for f in state["_data_files"]]
    os.replace(out / old, out / "data-00000-of-00002.arrow")
    state["_data_files"] = [{"filename": "data-00000-of-00002.arrow"}]
    json.dump(state, open(out / "state.json", "w"))
    before = datasets.load_from_disk(str(out)).to_dict()
    replace = os.replace

    def dies_at_state_json(src, dst):
        if str(dst).endswith("state.json"):
            raise KeyboardInterrupt  # the run is stopped there
        replace(src, dst)
    monkeypatch.setattr(os, "replace", dies_at_state_json)
    with pytest.raises(KeyboardInterrupt):
        job.run(_opts(model, dataset, out, layers=LAYERS, format="arrow", skip_uncovered=True, resume=True))
    monkeypatch.undo()
    assert datasets.load_from_disk(str(out)).to_dict() == before  # the earlier dataset, whole


@pytest.mark.parametrize("fmt, refusal", [
    ("arrow", r"hs_0\.safetensors does not hold its row's sample: row 0 \(input line 1\)"),
    ("pt", r"data_0\.pt does not hold its sample: input line 1: the file holds")])
def test_shards_made_from_differing_sample_sets_do_not_become_one_dataset(model, dataset, tmp_path, fake_engine,
                                                                          monkeypatch, fmt, refusal):
    """Arrow rows are bound by position: shard 1 run where line 1 tokenizes otherwise (another transformers
    version on that machine) must not write a dataset pairing row 0 with shard 0's states of other tokens. Nor may
    a pt set be described as whole (data_config.json) when its shards tokenized line 1 differently: the run that
    completes a set checked only its own files."""
    from eagle_compat.extract import inputs
    out = tmp_path / "out"
    job.run(_opts(model, dataset, out, layers=LAYERS, format=fmt, skip_uncovered=True, shard=(0, 2)))
    real = inputs.read_dataset

    def other_tokenizer(*args, into, **kwargs):
        data = real(*args, **kwargs)  # into a list, changed, then where extract keeps its samples
        s = data.samples[0]  # row 0: written by shard 0
        data.samples[0] = inputs.Sample(s.index, s.input_ids[::-1], s.loss_mask, s.line)
        for sample in data.samples:
            into.append(sample)
        data.samples = into
        return data
    monkeypatch.setattr(inputs, "read_dataset", other_tokenizer)
    import transformers  # another release: the input kept tokenized in --out does not stand for its reading
    monkeypatch.setattr(transformers, "__version__", "99.0.0")
    with pytest.raises(writer.OutputDirectoryConflict, match=refusal):
        job.run(_opts(model, dataset, out, layers=LAYERS, format=fmt, skip_uncovered=True, shard=(1, 2)))
    assert not (out / "state.json").exists() and not (out / "data_config.json").exists()
    assert json.load(open(out / "manifest.json"))["status"] == "incomplete"


def test_convert_reads_speculators_0_3_0_slots_in_model_order_whatever_its_config_lists(model, dataset, tmp_path,
                                                                                      fake_engine):
    """speculators 0.3.0's worker collects the layers in model order (a frozenset looked up as the layers run), but
    its data_config.json lists them as the user gave them: `--layer-ids 5 0 2` leaves files of slots [0, 2, 5]."""
    kw = dict(layers=LAYERS, skip_uncovered=True)
    own = tmp_path / "own"
    job.run(_opts(model, dataset, own, **kw))
    for name in ("manifest.json", ".eagle-compat.lock"):
        os.unlink(own / name)
    cfg = json.load(open(own / "data_config.json"))
    cfg["hidden_states"]["layer_ids"] = [5, 0, 2, 2]
    json.dump(cfg, open(own / "data_config.json", "w"))
    job.run(_opts(model, dataset, tmp_path / "direct", format="arrow", **kw))
    summary = convert.convert(str(own), str(tmp_path / "dst"))
    assert summary["layer_ids"] == [0, 2, 5] and summary["eagle_aux_hidden_state_layer_ids"] == [1, 3]
    _arrow_equal(tmp_path / "direct", tmp_path / "dst")


def test_convert_takes_a_set_with_samples_left_out_for_too_few_loss_tokens(model, dataset, tmp_path, fake_engine):
    kw = dict(layers=LAYERS, skip_uncovered=True, min_loss_tokens=12)
    summary = job.run(_opts(model, dataset, tmp_path / "pt", **kw))
    assert json.load(open(tmp_path / "pt" / "manifest.json"))["left_out_few_loss_tokens"], summary  # some left out
    job.run(_opts(model, dataset, tmp_path / "direct", format="arrow", **kw))
    convert.convert(str(tmp_path / "pt"), str(tmp_path / "dst"))
    _arrow_equal(tmp_path / "direct", tmp_path / "dst")


def test_convert_refuses_a_destination_another_run_wrote_while_it_started(model, dataset, tmp_path, fake_engine,
                                                                       monkeypatch):
    """DST is read before its lock is taken (to refuse early): a run that wrote it in between is caught under the
    lock, and what it wrote is left as it was."""
    job.run(_opts(model, dataset, tmp_path / "pt", layers=LAYERS, skip_uncovered=True))
    dst = tmp_path / "dst"
    real_enter, raced = directory_lock.DirectoryLock.__enter__, []

    def another_run_first(lock):
        if not raced:
            raced.append(True)
            job.run(_opts(model, dataset, dst, layers=LAYERS, format="arrow", skip_uncovered=True))
            raced.append(_tree(dst))
        return real_enter(lock)

    monkeypatch.setattr(directory_lock.DirectoryLock, "__enter__", another_run_first)
    with pytest.raises(InvalidInput, match="already holds another extraction or conversion"):
        convert.convert(str(tmp_path / "pt"), str(dst))
    assert _tree(dst) == raced[1]


def test_convert_resume_refuses_a_destination_another_resume_changed_while_it_started(model, dataset, tmp_path,
                                                                                    fake_engine, monkeypatch):
    job.run(_opts(model, dataset, tmp_path / "pt", layers=LAYERS, skip_uncovered=True))
    dst = tmp_path / "dst"
    convert.convert(str(tmp_path / "pt"), str(dst))
    os.unlink(arrow.hs_path(str(dst), 2))  # a conversion to resume
    real_enter, raced = directory_lock.DirectoryLock.__enter__, []

    def another_resume_first(lock):
        if not raced:
            raced.append(True)
            assert convert.convert(str(tmp_path / "pt"), str(dst), resume=True)["written"] == 1
            raced.append(_tree(dst))
        return real_enter(lock)

    monkeypatch.setattr(directory_lock.DirectoryLock, "__enter__", another_resume_first)
    with pytest.raises(InvalidInput, match=r"was written by another run while this convert started \(nothing was "
                                           r"written by this one\): run the same command again, with --resume"):
        convert.convert(str(tmp_path / "pt"), str(dst), resume=True)
    assert _tree(dst) == raced[1]


def test_convert_resume_refuses_an_earlier_releases_conversion_in_another_slot_order(model, dataset, tmp_path,
                                                                                  fake_engine, monkeypatch):
    """An earlier release converted `--layers 2,0,5` keeping that order; resuming it now would add ascending files."""
    with monkeypatch.context() as m:
        m.setattr(layers_mod, "check_training_layers", lambda *a: None)
        m.setattr(options_mod, "check_training_layers", lambda *a: None)
        job.run(_opts(model, dataset, tmp_path / "pt", layers=[2, 0, 5], skip_uncovered=True))
    dst = tmp_path / "dst"
    convert.convert(str(tmp_path / "pt"), str(dst))
    record = json.load(open(dst / "manifest.json"))
    record["converted_from"]["slot_order"], record["layer_ids"] = [0, 1, 2], [2, 0, 5]  # as the earlier release did
    record["status"] = "converting"
    json.dump(record, open(dst / "manifest.json", "w"))
    os.unlink(arrow.hs_path(str(dst), 2))
    with pytest.raises(InvalidInput, match=r"holds an earlier conversion of this SRC in another slot order .* "
                                           r"resuming would mix the two"):
        convert.convert(str(tmp_path / "pt"), str(dst), resume=True)


def _tree(root):
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".eagle-compat.lock"}
