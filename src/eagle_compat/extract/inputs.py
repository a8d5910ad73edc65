"""Read the input JSONL: conversations (chat template applied, loss mask on assistant tokens, as speculators 0.3.0's
preprocessing does) or pre-tokenized ids. Every problem is an `InvalidInput` naming the file and line, raised before
any engine starts."""
from __future__ import annotations

import bisect
import collections
import hashlib
import json
import os
from array import array
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..errors import InvalidInput
from . import harmony
from .conversation import (Chat, UncoveredConversation, as_chat, assistant_pieces, assistant_spans,  # noqa: F401
                           chat_of, count_cut, preview, replies_only, reply_number)
from .conversation import shown as _shown

LINE_FORMS = ("{\"conversations\": [{\"role\": \"user\", \"content\": \"...\"}, ...]} (or \"messages\"), or "
              "{\"input_ids\": [ints], \"loss_mask\": [0/1 per id]}")


@dataclass
class Cut:
    """What --max-len took from one sample, and what its kept loss tokens are (extract's data report)."""
    tokens: int = 0  # tokens cut away
    loss_tokens: int = 0  # of which in the loss mask
    replies: int = 0  # assistant replies in the conversation (0: pre-tokenized)
    replies_cut_wholly: int = 0
    replies_cut_partly: int = 0
    reasoning_tokens: int = 0  # kept loss tokens over the replies' reasoning
    tool_call_tokens: int = 0  # and over their tool calls (the rest of a conversation's: the replies' content)


@dataclass
class Sample:
    """One sample of the input. Its ids and mask are compact arrays (4 bytes a token id, 1 a mask value, against
    about 36 and 8 in Python lists): the driver holds every sample of the input."""
    index: int
    input_ids: Sequence[int]  # array("i")
    loss_mask: Sequence[int]  # array("b") of 0/1
    line: int = 0
    cut: Cut = field(default_factory=Cut)


@dataclass
class Dataset:
    samples: list[Sample]
    # conversations left out under --skip-uncovered: {"line", "index", "reason"}
    skipped: list[dict] = field(default_factory=list)
    # samples left out under --min-loss-tokens (too few tokens to train on): {"line", "index", "loss_tokens", "reason"}
    few_loss_tokens: list[dict] = field(default_factory=list)
    # what the input gave that the samples do not use, said once: {note: count or {key: count}}
    notes: dict = field(default_factory=dict)
    report: dict | None = None  # the data report of the samples (report.of_samples), where it was made with them
    # the SHA-256 of the input's bytes the samples were read from (read_dataset: the bytes it consumed, as it read
    # them; a spool: those its samples were read from); "" where not known
    data_sha256: str = ""


def tokenize_conversation(tokenizer: Any, messages: "Chat | list[dict]", max_len: int, *, check_decoded: bool = False,
                          cut: Cut | None = None, template_tokens: frozenset[int] | None = None,
                          without_reasoning: set | None = None,
                          loss_mask: str = "generated") -> tuple[list[int], list[int]]:
    """Token ids of the chat-templated conversation and a mask that is 1 on what the assistant generated: each
    reply's reasoning (where the template renders it), content and tool calls (assistant_pieces). Role headers, the
    template's markup, user, system and tool messages stay out.

    Every assistant message must be located (UncoveredConversation otherwise); spans past `max_len` tokens are
    truncated away, as the text is. `check_decoded` (--validate) also decodes the masked tokens of each piece and
    checks that they spell it (as the piece tokenized alone decodes): an independent check of the tokenizer's
    character offsets, and that no special token among them reaches outside the piece (`template_tokens`:
    `special_ids(tokenizer)`, given by a caller that tokenizes many). `cut` is filled with what `max_len` took away
    (tokens, loss tokens, replies); `loss_mask="replies"` keeps the replies' content alone; `without_reasoning` gets the
    replies kept as context because the template drops their reasoning. Linear in the conversation: two renderings (the
    text, the placeholders) and one per reply with tool calls, one tokenization, one pass over the tokens; a template
    that renders placeholders otherwise adds a rendering per reply that --max-len keeps, none for the replies it cuts
    away.
    """
    chat = as_chat(messages)
    text = chat.render(tokenizer)
    try:  # the whole text (what --max-len takes away is reported), then cut: what truncation=True would keep
        enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False, verbose=False)
    except NotImplementedError:
        raise InvalidInput("conversations need a fast tokenizer (character offsets locate the assistant's tokens); "
                           "this model's tokenizer has none. Pre-tokenize into input_ids + loss_mask") from None
    full_offsets = enc["offset_mapping"]
    ids, offsets = list(enc["input_ids"])[:max_len], full_offsets[:max_len]
    reach = max((e_tok for _, e_tok in offsets), default=0)  # a reply beginning past it covers no kept token
    pieces = assistant_pieces(tokenizer, chat, text, reach, without_reasoning)
    if loss_mask == "replies":
        pieces = replies_only(pieces)
    spans = [(b, e) for b, e, _, _ in pieces]
    full_mask, covering = _tokens_over_spans(full_offsets, spans)
    mask = full_mask[:max_len]
    kept = [cover[:bisect.bisect_left(cover, max_len)] for cover in covering]  # each piece's kept tokens
    if cut is not None:
        count_cut(cut, pieces, covering, kept, len(full_offsets) - len(ids), sum(full_mask) - sum(mask))
    kept_end = offsets[-1][1] if offsets else 0
    if check_decoded and template_tokens is None:  # given by read_dataset, once for the file
        template_tokens = special_ids(tokenizer)
    for k, (s, e, i, _) in enumerate(pieces):
        if s >= kept_end:
            continue  # truncated away by --max-len, with the text
        if not kept[k]:
            raise UncoveredConversation(f"assistant message {reply_number(chat, i)}: no token of the tokenized text "
                                        f"covers its characters {s}..{e}")
        if check_decoded:
            _check_spelled(tokenizer, text, ids, offsets, (s, e), kept[k], reply_number(chat, i) - 1, kept_end,
                           template_tokens)
    return ids, mask


def _tokens_over_spans(offsets: Sequence[tuple[int, int]],
                       spans: list[tuple[int, int]]) -> tuple[list[int], list[list[int]]]:
    """In one pass over the tokens: each token's mask value (1 where it overlaps a span: span start < token end and
    token start < span end) and each span's covering tokens, in order. A test of every span per token was quadratic
    in a long conversation. `spans` are in order and disjoint (as assistant_spans gives them), so the spans a token
    overlaps are a run from the first whose end is past the token's start: bisected, whatever the offsets' order."""
    if any(b >= e for b, e in spans) or any(e > b for (_, e), (b, _) in zip(spans, spans[1:])):
        raise ValueError(f"reply spans must be non-empty, in order and disjoint: {spans[:8]}")
    ends = [e for _, e in spans]
    mask, covering = [], [[] for _ in spans]
    for j, (b_tok, e_tok) in enumerate(offsets):
        k = bisect.bisect_right(ends, b_tok)
        overlaps = k < len(spans) and spans[k][0] < e_tok
        while k < len(spans) and spans[k][0] < e_tok:
            covering[k].append(j)
            k += 1
        mask.append(int(overlaps))
    return mask, covering


def _check_spelled(tokenizer: Any, text: str, ids: list[int], offsets: Sequence[tuple[int, int]],
                   span: tuple[int, int], covering: list[int], k: int, kept_end: int,
                   template_tokens: frozenset[int]) -> None:
    """--validate on reply `k` (its characters `span`, its kept tokens `covering`): the reply tokenized alone,
    decoded, must be what its masked tokens decode to (words the vocabulary lacks read <unk> on both sides), and no
    special or added token among them may reach outside the reply."""
    s, e = span
    alone = tokenizer(text[s:min(e, kept_end)], add_special_tokens=False)["input_ids"]
    want, got = (_decoded(tokenizer, alone), _decoded(tokenizer, [ids[j] for j in covering]))
    if want not in got:
        raise UncoveredConversation(f"assistant message {k + 1}: its masked tokens decode to "
                                    f"{preview(got)}, not to the reply {preview(want)}")
    # a reply found inside the template's own header decodes as part of it: a special or added token that
    # reaches outside the reply's characters is the template's (by position: tokens are spelled otherwise)
    outside = [j for j in covering if ids[j] in template_tokens and not s <= offsets[j][0] <= offsets[j][1] <= e]
    if outside:
        token = tokenizer.convert_ids_to_tokens(ids[outside[0]])
        raise UncoveredConversation(f"assistant message {k + 1}: its masked tokens hold {token!r}, a special "
                                    f"token reaching outside the reply {preview(text[s:e])}")


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of special and added tokens (a template's headers), but for the unknown-word token. Read once per
    input file (Gemma 3 has thousands of added tokens)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids |= set((tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}).values())
    return frozenset(ids - {getattr(tokenizer, "unk_token_id", None)})


def _decoded(tokenizer: Any, ids: list[int]) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return "".join(text.split())  # tokenizers differ in the spaces they restore


class _DuplicateKey(ValueError):
    """A key given twice in one JSON object."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """json's object_pairs_hook: a JSON object as a dict, refusing a key given twice (json.loads would keep the
    last value without a word)."""
    record = dict(pairs)
    if len(record) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return record


def _record_of(raw: bytes, where: str) -> dict | None:
    """One input line as its JSON object (None: a blank line)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not line.strip():
        return None
    try:
        record = json.loads(line, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise InvalidInput(f"{where}: the key {exc.args[0]!r} appears twice in one object (a JSON reader keeps one "
                           f"of them silently); give each key once: {LINE_FORMS}") from None
    except ValueError as exc:
        raise InvalidInput(f"{where}: not JSON ({exc}); each line is one JSON object: {LINE_FORMS}") from None
    if not isinstance(record, dict):
        raise InvalidInput(f"{where}: a JSON {type(record).__name__}; each line is one JSON object: {LINE_FORMS}")
    return record


def _conversation_tokens(tokenizer: Any, chat: Chat, record: dict, where: str, max_len: int, cut: Cut,
                         check_decoded: bool, template_tokens: frozenset[int] | None, tokenizer_error: str,
                         without_reasoning: set, loss_mask: str,
                         chat_format: str = "template") -> tuple[list[int], list[int], frozenset[int] | None]:
    """A conversation line's ids and loss mask, and --validate's special tokens (read at the first conversation,
    given back for the next); UncoveredConversation as raised: the caller may skip the line."""
    if chat_format == "harmony":  # gpt-oss: the server renders harmony, not the template
        try:
            context: set = set()
            ids, mask = harmony.tokenize_conversation(chat, max_len, cut=cut, without_reasoning=context,
                                                      loss_mask=loss_mask)
        except UncoveredConversation:
            raise
        except InvalidInput as exc:
            raise InvalidInput(f"{where}: {exc}") from None
        without_reasoning.update((where, i) for i in context)
        _same_as_given(record, where, ids, mask, max_len)
        return ids, mask, template_tokens
    if tokenizer is None:  # the model folder's problem, not the line's
        raise InvalidInput(f"{where} is a conversation, which needs the model's tokenizer: "
                           + (tokenizer_error or "it did not load"))
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidInput(
            f"{where} is a conversation, which needs the model's chat template, and its tokenizer has none (no "
            "'chat_template' in tokenizer_config.json, no chat_template.jinja): add the model's own template to its "
            "folder, or give the data as 'input_ids' with 'loss_mask'")
    try:
        if check_decoded and template_tokens is None:
            template_tokens = special_ids(tokenizer)
        context: set = set()
        ids, mask = tokenize_conversation(tokenizer, chat, max_len, check_decoded=check_decoded, cut=cut,
                                          template_tokens=template_tokens, without_reasoning=context,
                                          loss_mask=loss_mask)
        without_reasoning.update((where, i) for i in context)
    except UncoveredConversation:
        raise
    except InvalidInput as exc:
        raise InvalidInput(f"{where}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the template's own error (e.g. roles must alternate)
        raise InvalidInput(f"{where}: the chat template failed on this conversation: "
                           f"{type(exc).__name__}: {exc}") from None
    _same_as_given(record, where, ids, mask, max_len)
    return ids, mask, template_tokens


def _same_as_given(record: dict, where: str, ids: list[int], mask: list[int], max_len: int) -> None:
    if "input_ids" in record:  # both forms: used only where they agree, never one chosen silently
        given, given_mask = _token_record(record, where)
        given, given_mask = given[:max_len], given_mask[:max_len]
        if given != ids or ("loss_mask" in record and given_mask != mask):
            raise InvalidInput(
                f"{where}: holds both a conversation and 'input_ids'/'loss_mask', which differ (the conversation "
                f"gives {len(ids)} tokens {ids[:6]}... with {sum(mask)} loss tokens, the line {len(given)} "
                f"{given[:6]}... with {sum(given_mask)}); keep one form in each line: {LINE_FORMS}")


def chat_format_of(model: str) -> str:
    """How vLLM's chat endpoint renders this model's conversations: "harmony" for gpt-oss (its `use_harmony`, by the
    config's model type), else "template" (the tokenizer's chat template)."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return "template"  # no readable config here: the engine's own loading says what is wrong
    return "harmony" if harmony.uses_harmony(model_type) else "template"


def _few_loss_tokens_reason(mask: list[int], cut: Cut, min_loss_tokens: int) -> str:
    if cut.replies_cut_wholly and not sum(mask):
        return "its replies were cut away by --max-len"
    if not sum(mask):
        return "no token of it is in the loss mask"
    return f"{sum(mask)} loss tokens, fewer than --min-loss-tokens {min_loss_tokens}"


def read_dataset(path: str, tokenizer: Any, max_len: int, *, vocab_size: int = 0, skip_uncovered: bool = False,
                 check_decoded: bool = False, min_loss_tokens: int = 0, tokenizer_error: str = "",
                 on_line: Any = None, into: Any = None, loss_mask: str = "generated",
                 chat_format: str = "template") -> Dataset:
    """Every line parsed and tokenized, in order (extract runs this on a thread of its own: a large new set's batches
    start before it ends, input_reading.READ_AHEAD_LINES). Samples with fewer than
    `min_loss_tokens` tokens in their loss mask (after --max-len) are left out and listed. `on_line()` after each
    line (the run's progress); `into`: where the samples go (anything with append and len; a list by default).
    `data_sha256` of the result: the SHA-256 of the bytes this reading consumed, taken as they were read (a file
    rewritten between a digest taken before and this reading gives another one)."""
    data = Dataset(into if into is not None else [])
    consumed = hashlib.sha256()
    unused_keys: collections.Counter = collections.Counter()
    without_mask = 0
    without_reasoning: set = set()  # (line, message) of replies kept as context: the template drops their reasoning
    template_tokens: frozenset[int] | None = None  # --validate's special tokens, read at the first conversation
    index = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f):
            consumed.update(raw)
            if on_line is not None:
                on_line()
            where = f"{path}:{n + 1}"
            record = _record_of(raw, where)
            if record is None:
                continue
            chat = chat_of(record, where, unused_keys)
            cut = Cut()
            if chat is not None:
                try:
                    ids, mask, template_tokens = _conversation_tokens(
                        tokenizer, chat, record, where, max_len, cut, check_decoded, template_tokens,
                        tokenizer_error, without_reasoning, loss_mask, chat_format)
                except UncoveredConversation as exc:
                    if not skip_uncovered:
                        raise UncoveredConversation(
                            f"{where}: {exc}. Fix the line (or the chat template), or pass --skip-uncovered to leave "
                            "such conversations out (counted, and listed in manifest.json)") from None
                    data.skipped.append({"line": n + 1, "index": index, "reason": str(exc)})
                    index += 1
                    continue
            else:
                _refuse_formless(record, where)
                without_mask += "loss_mask" not in record
                ids, mask = _token_record(record, where)
                cut.tokens, cut.loss_tokens = max(0, len(ids) - max_len), sum(mask[max_len:])
                ids, mask = ids[:max_len], mask[:max_len]
            _check_ids(ids, vocab_size, where)
            if sum(mask) < min_loss_tokens:
                data.few_loss_tokens.append({"line": n + 1, "index": index, "loss_tokens": sum(mask),
                                             "reason": _few_loss_tokens_reason(mask, cut, min_loss_tokens), "cut": cut})
            else:
                data.samples.append(Sample(index, array("i", ids), array("b", mask), n + 1, cut))
            index += 1
    if not len(data.samples):
        left = ([f"{len(data.skipped)} skipped as uncovered"] * bool(data.skipped)
                + [f"{len(data.few_loss_tokens)} with fewer than --min-loss-tokens {min_loss_tokens} loss tokens"]
                * bool(data.few_loss_tokens))
        raise InvalidInput(f"{path}: no samples" + (f" ({'; '.join(left)})" if left else ""))
    if unused_keys:  # speculators 0.3.0 keeps role and content only, too: said, never silent
        data.notes["message_keys_not_passed_to_the_template"] = dict(sorted(unused_keys.items()))
    if without_mask:
        data.notes["token_lines_without_loss_mask"] = without_mask
    if without_reasoning:
        data.notes["replies_rendered_without_their_reasoning"] = len(without_reasoning)
    data.data_sha256 = consumed.hexdigest()
    return data


def _refuse_formless(record: dict, where: str) -> None:
    """A line that is neither a conversation (checked first) nor token ids is refused, naming what it has."""
    if "input_ids" not in record:
        raise InvalidInput(f"{where}: a line needs 'conversations' (or 'messages') or 'input_ids' (it has "
                           f"{sorted(record)[:5]}); allowed: {LINE_FORMS}")


def _check_ids(ids: Sequence[int], vocab_size: int, where: str) -> None:
    """A sample's ids (after --max-len): at least one, each inside the vocabulary of `vocab_size` (0: not known)."""
    if not ids:
        raise InvalidInput(f"{where}: the sample tokenizes to nothing")
    # min and max first, in C: a per-token Python test was a fifth of a pre-tokenized input's read
    bad = [t for t in ids if not 0 <= t < vocab_size] if vocab_size and (
        min(ids) < 0 or max(ids) >= vocab_size) else []
    if bad:
        raise InvalidInput(f"{where}: token id {bad[0]} outside the model's vocabulary [0, {vocab_size - 1}]")


def check_lines(path: str, max_len: int, vocab_size: int = 0, on_line: Any = None) -> int:
    """Every line checked as read_dataset checks it where it needs no tokenizer and no chat template: UTF-8, one JSON
    object with each key once, a conversation's messages (roles, string contents, both spellings agreeing), token
    ids and a loss mask of their JSON types, ids (those --max-len keeps) inside the vocabulary. Raises the
    InvalidInput read_dataset raises at the first line that fails these; returns the number of lines. A streamed
    input's reading meets a line only while the batches run: this pass, before the engine starts, makes a bad line
    cost no GPU time. About 7 s for a million short conversations, 16 s for a million lines of 10-60 token ids, on
    one core of a loaded 2-core machine (benchmarks/results/line-check.md), against minutes to tokenize them.
    `on_line()` after each line."""
    lines = records = 0
    with open(path, "rb") as f:
        for lines, raw in enumerate(f, 1):
            if on_line is not None:
                on_line()
            where = f"{path}:{lines}"
            record = _record_of(raw, where)
            if record is None:
                continue
            records += 1
            if chat_of(record, where) is None:  # (a conversation's own input_ids are read against its tokens)
                _refuse_formless(record, where)
                _check_ids(_token_record(record, where)[0][:max_len], vocab_size, where)
    if not records:
        raise InvalidInput(f"{path}: no samples")
    return lines


def describe_notes(notes: dict) -> list[str]:
    """One line per note of `Dataset.notes`, for the run's output."""
    lines = []
    keys = dict(notes.get("message_keys_not_passed_to_the_template") or {})
    weighted = keys.pop("weight", 0)
    if keys:
        lines.append("conversations carry keys the chat template is not given ("
                     + ", ".join(f"{k!r} in {n}" for k, n in keys.items()) + "): a message's role, content, "
                     "reasoning, tool_calls, tool_call_id and name are, and the line's tools and "
                     "chat_template_kwargs, as vLLM's chat endpoint passes them")
    if notes.get("replies_rendered_without_their_reasoning"):
        lines.append(f"{notes['replies_rendered_without_their_reasoning']} assistant replies carry reasoning that the "
                     "chat template drops once later turns follow (as Qwen3's does): the model generated them after "
                     "their reasoning, so they are context here, out of the loss mask; to train on each turn, give "
                     "one line per turn, ending at it")
    if weighted:
        lines.append(f"{weighted} messages carry a 'weight', which is not applied: every assistant reply is in the "
                     "loss mask (for a mask of your own, give input_ids with loss_mask)")
    if notes.get("token_lines_without_loss_mask"):
        lines.append(f"{notes['token_lines_without_loss_mask']} lines give input_ids without loss_mask: every token "
                     "of them is in the loss mask")
    return lines


def _first_not_int(values: list, allowed: frozenset[int] | None = None) -> int | None:
    """The index of the first value that is not exactly an int (JSON's 1.0 is a float and true a bool here), or not
    in `allowed`; None where every value is. Types and values are checked in C first: a per-value Python test was a
    fifth of a pre-tokenized input's read."""
    if set(map(type, values)) <= {int} and (allowed is None or set(values) <= allowed):
        return None
    return next(k for k, v in enumerate(values) if type(v) is not int or (allowed is not None and v not in allowed))


def _token_record(record: dict, where: str) -> tuple[list[int], list[int]]:
    ids = record["input_ids"]
    if not isinstance(ids, list):
        raise InvalidInput(f"{where}: input_ids must be a list of ints, got {preview(json.dumps(ids))}")
    bad = _first_not_int(ids)
    if bad is not None:
        raise InvalidInput(f"{where}: input_ids must be a list of ints, got input_ids[{bad}] = "
                           f"{_shown(ids[bad])} (token ids are JSON integers: no 5.0, no true/false)")
    mask = record.get("loss_mask", [1] * len(ids))
    if not isinstance(mask, list) or len(mask) != len(ids):
        got = f"{len(mask)} values" if isinstance(mask, list) else f"a {type(mask).__name__}"
        raise InvalidInput(f"{where}: loss_mask must be a list of 0/1 values, one per input id ({len(ids)}); "
                           f"got {got}")
    # Exactly the ints 0 and 1, as input_ids are exactly ints: 1.0 or true would convert faithfully, but a float
    # column is also where weights live (0.5), and one rule said plainly beats a conversion that takes some floats
    # and refuses others. The message says how to write the column.
    bad = _first_not_int(mask, frozenset((0, 1)))
    if bad is not None:
        raise InvalidInput(f"{where}: loss_mask must be a list of 0/1 values, one per input id ({len(ids)}); got "
                           f"loss_mask[{bad}] = {_shown(mask[bad])}: write the JSON integers 0 and 1 "
                           "(not 1.0/0.0 or true/false; pandas: .astype(int) before exporting)")
    return ids, mask
