"""`eagle-compat convert SRC DST`: speculators 0.3.0's files (data_{i}.pt / .safetensors) <-> the Arrow layout of
speculators 0.8-0.9 (arrow.py), both ways where the layers allow, one sample in memory at a time.

The source must be a complete directory written by `eagle-compat extract` (or an earlier `convert`): its
manifest.json says which layer each slot holds, in which convention, and which sample each file is. The destination
gets the same settings record with the format changed (so `extract --resume` with the destination's format accepts
it, and a converted directory is interchangeable with a directly extracted one: tested), plus `converted_from`.

What cannot be converted is refused before anything is written, with the reason:
* the files must hold the final pre-norm state (layer N-1, leaving; N entering): speculators' trainers take the last
  slot as the verifier's last hidden state. The destination's slots are in ascending layer order, the final pre-norm
  state last (extract/layers.py check_training_layers says why); a source in another order is reordered (the
  manifest's layer lists follow);
* an incomplete source (a run still to be resumed), or one without a settings record.
"""
from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime, timezone
from typing import Any

from ..errors import InvalidInput
from . import arrow, atomic_io, directory_lock, formats, layers, writer

TARGETS = tuple(formats.FORMATS)


def source_format(src: str, record: dict | None) -> str:
    if record is not None:
        return record["settings"].get("format", "pt")
    if arrow.is_arrow_dir(src):
        return "arrow"
    return "pt"


def _indices(record: dict) -> list[int]:
    """The sample indices of a complete set, ascending (Arrow row r is the r-th)."""
    if "sample_indices" in record:  # speculators 0.3.0's own output: the files present
        return list(record["sample_indices"])
    left_out = {int(s["index"]) for key in ("skipped_uncovered", "left_out_few_loss_tokens", "left_out_non_finite")
                for s in record.get(key) or []}  # no file: --skip-uncovered, --min-loss-tokens, --skip-non-finite
    total = int(record.get("num_samples_in_data", record.get("num_samples", 0)))
    return [i for i in range(total) if i not in left_out]


def _speculators_0_3_0_record(src: str, num_layers: int | None) -> dict | None:
    """speculators 0.3.0's own output (its data_generation_offline.py, e.g. under `eagle-compat run`): data_{i}.pt
    and data_config.json, no manifest. Its layer ids are 0.3.0's (leaving); the model's layer count comes from
    --num-layers or from the model directory data_config.json names."""
    path = os.path.join(src, "data_config.json")
    if not os.path.isfile(path) or not writer.sample_files(src):
        return None
    try:
        with open(path) as f:
            cfg = json.load(f)
        # its files hold each listed layer once, in model order (its worker collects them in a frozenset while the
        # layers run), whatever order data_config.json lists them in (the order the user gave)
        layer_ids = sorted({int(k) for k in cfg["hidden_states"]["layer_ids"]})
        num_samples = int(cfg["data"]["num_samples"])
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidInput(f"{path} is not speculators' data-generation config ({exc!r} missing or "
                           "malformed)") from None
    model = (cfg.get("model") or {}).get("target_model_path")
    if num_layers is None and model and os.path.isfile(os.path.join(model, "config.json")):
        from ..model_facts import model_text_config

        num_layers = int(model_text_config(model).num_hidden_layers)
    if num_layers is None:
        raise InvalidInput(f"{src} is speculators 0.3.0's output (data_config.json, no manifest.json) and "
                           f"its model ({model!r}) is not a local directory here, so the number of decoder layers "
                           "is unknown (needed to tell whether its last layer is the final pre-norm state): pass "
                           "--num-layers N")
    present = sorted(int(f[5:].split(".")[0]) for f in writer.sample_files(src) if f.startswith("data_"))
    fmt = "safetensors" if any(f.endswith(".safetensors") for f in writer.sample_files(src)) else "pt"
    if len(present) != num_samples:
        raise InvalidInput(f"{src} holds {len(present)} data_{{i}} files, its data_config.json says "
                           f"{num_samples} samples: the run is not complete (resume it first)")
    data = cfg.get("data") or {}
    return {"layer_convention": writer.LAYER_CONVENTION, "layer_ids": layer_ids, "num_layers": num_layers,
            "settings": {"model": model, "data": data.get("train_data_path"), "layer_ids": layer_ids,
                         "max_len": data.get("seq_length"), "format": fmt,
                         "tensor_parallel_size": (cfg.get("model") or {}).get("tensor_parallel_size", 1),
                         "made_by": "speculators 0.3.0 data generation (data_config.json)"},
            "model_config": {"hidden_size": (cfg.get("model") or {}).get("hidden_size")},
            "versions": (cfg.get("reproducibility") or {}).get("package_versions") or {},
            "num_samples": num_samples, "num_samples_in_data": num_samples, "skipped_uncovered": [],
            "sample_indices": present, "status": "complete", "samples_present": num_samples, "runs": [],
            "record_file": "data_config.json"}


def _read_source(src: str, num_layers: int | None = None) -> tuple[dict, str]:
    if not os.path.isdir(src):
        raise InvalidInput(f"{src!r} is not a directory")
    record = writer.read_manifest(src)
    if record is None:
        record = _speculators_0_3_0_record(src, num_layers)
    if record is None:
        what = ("an Arrow dataset" if arrow.is_arrow_dir(src) else
                f"{len(writer.sample_files(src))} sample files" if writer.sample_files(src) else "no training files")
        raise InvalidInput(f"{src} holds {what} but no eagle_compat settings record ({writer.MANIFEST}): "
                           "nothing says which layer each slot holds (speculators 0.3.0 counts the layer an id "
                           "leaves, vLLM and speculators >= 0.5 the layer it enters) or which sample each file is, "
                           "so a conversion could shift every layer by one silently. Convert directories written by "
                           "eagle-compat extract")
    fmt = source_format(src, record)
    if fmt not in TARGETS:
        raise InvalidInput(f"{src}: unknown format {fmt!r} in its manifest")
    if (record.get("status") != "complete" or record.get("samples_present", record.get("num_samples")) !=
            record.get("num_samples")):
        raise InvalidInput(f"{src} is not complete (manifest status {record.get('status')!r}, "
                           f"{record.get('samples_present')} of {record.get('num_samples')} samples): finish it with "
                           "eagle-compat extract ... --resume first")
    return record, fmt


def plan(src: str, to: str | None, num_layers: int | None = None) -> dict:
    """Everything checked before DST is touched: formats, layers, the sample list, files present."""
    record, fmt = _read_source(src, num_layers)
    source = formats.get(fmt)
    target = to or ("pt" if source.arrow else "arrow")
    formats.get(target, "convert --to")  # refuses an unknown format, naming the known ones
    if target == fmt:
        raise InvalidInput(f"{src} is already in format {fmt!r}; pass --to with another format")
    layer_ids = [int(k) for k in record["layer_ids"]]
    n = int(record.get("num_layers") or record.get("layers", {}).get("num_layers") or 0)
    if not n:
        raise InvalidInput(f"{src}/{writer.MANIFEST} does not record the model's number of layers")
    if n - 1 not in layer_ids:
        raise InvalidInput(
            f"{src} cannot become training files in {target!r}: its files hold layers {layer_ids} (leaving; entering "
            f"{layers.to_entering(layer_ids)}) of a {n}-layer model, without the final pre-norm state (leaving "
            f"{n - 1}, entering {n}), which speculators' trainers (0.3.0's data_{{i}} files, 0.8-0.9's Arrow layout) "
            f"train on as the verifier's last hidden state (the last slot). Extract again with --format {target} "
            f"--layers {','.join(map(str, sorted({*layer_ids, n - 1})))}")
    # source slot of each destination slot: layers ascending, so the final pre-norm state comes last
    # (layers.check_training_layers says why; sets extracted before that check may hold another order)
    order = sorted(range(len(layer_ids)), key=lambda j: layer_ids[j])
    indices = _indices(record)
    formats.SetReader(source, src).check_rows(len(indices))
    missing = [os.path.relpath(path, src) for path in (source.path(src, i, r) for r, i in enumerate(indices))
               if not os.path.exists(path)]
    if missing:
        raise InvalidInput(f"{src} lacks {len(missing)} of its {len(indices)} sample files "
                           f"({', '.join(missing[:3])}, ...): finish it with eagle-compat extract ... --resume first")
    new_ids = [layer_ids[j] for j in order]
    with open(os.path.join(src, record.get("record_file", writer.MANIFEST)), "rb") as f:
        src_sha = hashlib.sha256(f.read()).hexdigest()
    return {"record": record, "from": fmt, "to": target, "indices": indices, "order": order, "layer_ids": new_ids,
            "num_layers": n, "src_manifest_sha256": src_sha}


def _source_states(p: dict) -> writer.StatesExpected:
    """What the source's files must hold: its record's stamp (files of earlier releases and speculators 0.3.0's carry
    none), layer count, hidden size and precision."""
    record = p["record"]
    settings = record.get("settings") or {}
    ours = "model_checksums" in settings  # not a record made up for speculators 0.3.0's own output
    return writer.StatesExpected(writer.states_stamp(settings) if ours else None, len(record["layer_ids"]),
                                 int((record.get("model_config") or {}).get("hidden_size") or 0),
                                 record.get("states_dtype") or record.get("engine_dtype"),
                                 stamped=bool(record.get("stamped_files")))


def _dst_record(src: str, p: dict) -> dict:
    rec = json.loads(json.dumps(p["record"]))  # a deep copy
    rec.pop("record_file", None)
    rec["settings"]["format"] = p["to"]
    rec["settings"]["layer_ids"] = rec["layer_ids"] = p["layer_ids"]
    rec["layers"] = layers.record(p["layer_ids"], p["num_layers"])
    for fmt in formats.FORMATS.values():  # the notes of the destination's format only
        for key in fmt.manifest_notes:
            rec.pop(key, None)
    rec.update(formats.get(p["to"]).manifest_notes)
    rec["converted_from"] = {"path": os.path.abspath(src), "format": p["from"],
                             "manifest_sha256": p["src_manifest_sha256"],
                             "slot_order": p["order"],
                             "lossy": ("fp8 (e4m3, per-token scales) dequantized to bf16" if p["from"] == "arrow-fp8"
                                       else "quantized to fp8 (e4m3, per-token scales)" if p["to"] == "arrow-fp8"
                                       else False)}
    if p["from"] == "arrow-fp8":  # dequantized to bfloat16, whatever the source's engine ran
        rec["states_dtype"] = "torch.bfloat16"
    rec["status"] = "converting"
    return rec


def _check_destination(dst: str, p: dict, resume: bool) -> dict | None:
    """DST's own record, if it holds an earlier conversion of this SRC to be resumed; refuses anything else there."""
    existing = writer.read_manifest(dst, mine=True)
    if existing is not None:
        same = (existing.get("converted_from", {}).get("manifest_sha256") == p["src_manifest_sha256"]
                and existing["settings"].get("format") == p["to"])
        if same and (existing["converted_from"].get("slot_order") != p["order"]
                     or existing.get("layer_ids") != p["layer_ids"]):
            raise InvalidInput(f"DST {dst} holds an earlier conversion of this SRC in another slot order (layers "
                               f"{existing.get('layer_ids')}, slot order {existing['converted_from'].get('slot_order')};"
                               f" this release writes layers {p['layer_ids']} in ascending order, slot order "
                               f"{p['order']}): resuming would mix the two. Choose an empty DST")
        if not same:
            raise InvalidInput(f"DST {dst} already holds another extraction or conversion "
                               f"({writer.MANIFEST}); choose an empty DST")
        if not resume:
            raise InvalidInput(f"DST {dst} holds an earlier conversion of this SRC; pass --resume to "
                               "complete it (files present are whole and kept), or choose an empty DST")
    elif writer.sample_files(dst):
        raise InvalidInput(f"DST {dst} holds training files but no settings record; choose an empty DST")
    return existing


def convert(src: str, dst: str, to: str | None = None, resume: bool = False, num_layers: int | None = None) -> dict:

    p = plan(src, to, num_layers)
    if os.path.abspath(src) == os.path.abspath(dst):
        raise InvalidInput("SRC and DST are the same directory")
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise InvalidInput(f"DST {dst!r} is a file")
    if os.path.isdir(dst):
        directory_lock.refuse_others_folder(dst, "DST")
    fresh = _dst_record(src, p)
    existing = _check_destination(dst, p, resume)
    os.makedirs(dst, exist_ok=True)
    source, destination = formats.get(p["from"]), formats.get(p["to"])
    order, indices = p["order"], p["indices"]
    written = 0
    with directory_lock.DirectoryLock(dst):
        # again under the lock: another run may have written DST since it was read above
        if _check_destination(dst, p, resume) != existing:
            raise writer.OutputDirectoryConflict(f"DST {dst} was written by another run while this convert started "
                                                 "(nothing was written by this one): run the same command again, "
                                                 "with --resume, to see where it stands")
        swept = writer.sweep_temp_files(dst)
        rec = existing or fresh
        rec["status"] = "converting"
        atomic_io.atomic_write_json(os.path.join(dst, writer.MANIFEST), rec)
        reader = formats.SetReader(source, src)
        stamp = writer.states_stamp(rec["settings"])  # the destination's layer order
        made = _source_states(p)
        for r, i in enumerate(indices):  # one sample in memory at a time
            if os.path.exists(destination.path(dst, i, r)):  # --resume: files are written whole or not at all
                continue
            try:
                why = made.mismatch(writer.read_facts(source.path(src, i, r)))  # a new stamp must not cover a stray
            except Exception as exc:  # noqa: BLE001 - a damaged file, named
                why = f"the file cannot be read ({type(exc).__name__}: {str(exc)[:200]})"
            if why:
                raise InvalidInput(f"SRC {source.path(src, i, r)}: {why}; the source is not one extraction, and is "
                                   "not converted (files already written in DST are whole)")
            ids, mask, states = reader.sample(i, r)
            destination.save(dst, i, r, ids, mask, states[:, order], stamp=stamp)
            written += 1
        atomic_io.fsync_renames(dst)
        st = rec["settings"]
        destination.finish(dst, (reader.ids_and_mask(i, r) for r, i in enumerate(indices)),  # streamed
                           formats.DataDescription(
                               model=st["model"], data=st["data"], layer_ids=p["layer_ids"],
                               hidden_size=int((rec.get("model_config") or {}).get("hidden_size") or 0),
                               num_samples=len(indices), max_len=st.get("max_len"),
                               versions=rec.get("versions", {}),
                               tensor_parallel_size=st.get("tensor_parallel_size", 1),
                               command=f"eagle-compat convert {src} {dst}"))
        atomic_io.fsync_renames(dst)
        rec.update(status="complete", samples_present=len(indices))
        rec.setdefault("runs", []).append({"convert": True, "at": datetime.now(timezone.utc).isoformat(),
                                           "written": written, "temp_files_swept": len(swept)})
        atomic_io.atomic_write_json(os.path.join(dst, writer.MANIFEST), rec)
    return {"from": p["from"], "to": p["to"], "samples": len(indices), "written": written, "dst": dst,
            "layer_ids": p["layer_ids"], "eagle_aux_hidden_state_layer_ids":
                rec["layers"]["eagle_aux_hidden_state_layer_ids"]}

