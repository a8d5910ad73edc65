"""Read the input JSONL: conversations (chat template applied, loss mask on assistant tokens, as speculators 0.3.0's
preprocessing does) or pre-tokenized ids. Every problem is an `InvalidInput` naming the file and line, raised before
any engine starts."""
from __future__ import annotations

import bisect
import collections
import hashlib
import json
import re
from array import array
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..errors import InvalidInput

ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "bot": "assistant",
                "model": "assistant", "system": "system"}
LINE_FORMS = ("{\"conversations\": [{\"role\": \"user\", \"content\": \"...\"}, ...]} (or \"messages\"), or "
              "{\"input_ids\": [ints], \"loss_mask\": [0/1 per id]}")


class UncoveredConversation(InvalidInput):
    """An assistant message whose tokens cannot be located in the chat-templated text (no loss mask for it)."""


@dataclass
class Cut:
    """What --max-len took from one sample (extract's data report)."""
    tokens: int = 0  # tokens cut away
    loss_tokens: int = 0  # of which in the loss mask
    replies: int = 0  # assistant replies in the conversation (0: pre-tokenized)
    replies_cut_wholly: int = 0
    replies_cut_partly: int = 0


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


MESSAGE_KEYS = {"role", "content", "from", "value"}  # what a message passes to the chat template (speculators' too)


def _one_spelling(obj: dict, first: str, second: str, where: str, what: str, meaning: Any = None) -> Any:
    """The value of `first`, else of `second` (ShareGPT's spelling). Both given (not null) with different meanings
    (`meaning` of each value; the values themselves by default): refused, never one of them chosen silently."""
    if obj.get(first) is not None and obj.get(second) is not None:
        one, other = (obj[first], obj[second]) if meaning is None else (meaning(obj[first]), meaning(obj[second]))
        if one != other:
            raise InvalidInput(f"{where}: {what} gives both {first!r} ({_shown(obj[first])}) and {second!r} "
                               f"({_shown(obj[second])}), which differ; give one of them")
    return obj[first] if first in obj else obj.get(second)


def _role(given: Any) -> str | None:
    """The role a message's role/from names (None: none): exactly a JSON string, one of ROLE_ALIASES."""
    return ROLE_ALIASES.get(given.lower()) if isinstance(given, str) else None


def _messages(record: dict, where: str, unused_keys: collections.Counter | None = None) -> list[dict] | None:
    conv = _one_spelling(record, "conversations", "messages", where, "the line")
    if conv is None:
        return None
    if not isinstance(conv, list) or not conv:
        raise InvalidInput(f"{where}: 'conversations' must be a non-empty list of messages")
    out = []
    for m in conv:
        if not isinstance(m, dict):
            raise InvalidInput(f"{where}: message {m!r} is not an object")
        role = _role(_one_spelling(m, "role", "from", where, "a message", meaning=_role))
        content = _one_spelling(m, "content", "value", where, "a message")
        if role is None or not isinstance(content, str):
            raise InvalidInput(f"{where}: message needs a role in {sorted(set(ROLE_ALIASES))} and string content "
                               f"(both JSON strings), got {m!r}")
        out.append({"role": role, "content": content})
        if unused_keys is not None:  # null or empty values (OpenHermes' "weight": null on every message) say nothing
            unused_keys.update(k for k, v in m.items() if k not in MESSAGE_KEYS and v not in (None, "", [], {}))
    if unused_keys is not None:
        unused_keys.update(f"top-level {k}" for k in ("system", "tools") if record.get(k))
    return out


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _placeholder(k: int) -> str:
    return f"EagleCompatReply{k}Placeholder7f3a"


PLACEHOLDER = re.compile(r"EagleCompatReply(\d+)Placeholder7f3a")  # every _placeholder(k), found in one pass


def _replies_in_place(tokenizer: Any, messages: list[dict], text: str,
                      replies: list[int] | None = None) -> list[tuple[int, int]] | None:
    """Where the template put the assistant replies (the messages `replies`, else every one) in `text`, from one more
    rendering with a placeholder in each one's place: `text` must be that rendering with each placeholder replaced
    by its reply (as it is, or trimmed). None where the template renders the rest around them differently."""
    if replies is None:
        replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    number = {i: k for k, i in enumerate(replies)}  # message index -> its placeholder's number
    placed = _render(tokenizer, [{**m, "content": _placeholder(number[i])} if i in number else m
                                 for i, m in enumerate(messages)], False)
    # one pass over the rendering (a search per reply was quadratic): each placeholder once, in the replies' order
    named = {str(k): k for k in range(len(replies))}
    found = [(named[match.group(1)], match.start(), match.end())
             for match in PLACEHOLDER.finditer(placed) if match.group(1) in named]
    if [k for k, _, _ in found] != list(range(len(replies))):
        return None
    cuts, ends = [b for _, b, _ in found], [e for _, _, e in found]
    around = [placed[b:e] for b, e in zip([0, *ends], [*cuts, len(placed)])]  # the template's text between replies
    spans, at = [], 0
    for k, i in enumerate(replies):
        if not text.startswith(around[k], at):
            return None
        at += len(around[k])
        content = messages[i]["content"]
        fits = [c for c in dict.fromkeys((content, content.strip()))
                if text.startswith(c, at) and text.startswith(around[k + 1], at + len(c))]
        if not fits:
            return None
        if fits[0]:
            spans.append((at, at + len(fits[0])))
        at += len(fits[0])
    return spans if len(text) - at == len(around[-1]) and text.startswith(around[-1], at) else None


def assistant_spans(tokenizer: Any, messages: list[dict], text: str,
                    reach: int | None = None) -> list[tuple[int, int]]:
    """Character spans of every assistant message's content in `text`, the templated conversation, in order and
    disjoint.

    Replies are looked for where the template put them: rendered again with a placeholder in each reply's place,
    the conversation must be `text` around the replies. Short replies are so never matched inside the template's
    own header text (R1's "<｜Assistant｜>" holds "A", Qwen3's "<think>" holds "hi"). Where the template renders the
    rest differently around placeholders (it moves reasoning out of earlier replies, say), each reply is looked up in
    order (never inside an earlier message): where a placeholder for it alone renders the rest as `text`, there;
    else after the generation header, where the prefix up to it renders as the text starts. A reply that is not in
    the text (the template rewrites or drops it, e.g. strips reasoning from earlier turns) raises
    UncoveredConversation. Replies that begin at or past `reach` (no token --max-len keeps ends past it) are looked
    up in order only, without those renderings: a rendering per reply made a long conversation quadratic, and their
    tokens are cut away (they count in the report).
    """
    in_place = _replies_in_place(tokenizer, messages, text)
    if in_place is not None:
        return in_place
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        content = m["content"]
        start = cursor
        if m["role"] == "assistant" and (reach is None or cursor < reach):
            alone = _replies_in_place(tokenizer, messages, text, [i])
            if alone is not None and all(begin >= cursor for begin, _ in alone):
                spans += alone
                cursor = alone[0][1] if alone else cursor
                continue
            if i:
                before = _render(tokenizer, messages[:i], True)
                if text.startswith(before):
                    start = max(cursor, len(before))
        pos, found = -1, content
        for candidate in (content, content.strip()):  # templates often trim message content
            if candidate:
                pos, found = text.find(candidate, start), candidate
                if pos >= 0:
                    break
        if pos < 0:
            if m["role"] == "assistant" and content.strip():
                n_assistant = sum(1 for x in messages[: i + 1] if x["role"] == "assistant")
                raise UncoveredConversation(
                    f"assistant message {n_assistant} ({_preview(content)}) is not in the chat-templated text: the "
                    "template renders it differently (rewrites it, or drops part of it from earlier turns), so its "
                    "tokens cannot be located for the loss mask")
            continue  # a system/user text the template rewrites: it only positions the search
        if m["role"] == "assistant":
            spans.append((pos, pos + len(found)))
        cursor = pos + len(found)
    return spans


def _preview(text: str, n: int = 40) -> str:
    return json.dumps(text if len(text) <= n else text[:n] + "...")


def _shown(value: Any, n: int = 40) -> str:
    """A JSON value as the line writes it (1.0, true, "1"), cut to `n` characters."""
    text = json.dumps(value)
    return text if len(text) <= n else text[:n] + "..."


def tokenize_conversation(tokenizer: Any, messages: list[dict], max_len: int, *, check_decoded: bool = False,
                          cut: Cut | None = None,
                          template_tokens: frozenset[int] | None = None) -> tuple[list[int], list[int]]:
    """Token ids of the chat-templated conversation and a mask that is 1 on assistant-content tokens.

    Every assistant message must be located (UncoveredConversation otherwise); spans past `max_len` tokens are
    truncated away, as the text is. `check_decoded` (--validate) also decodes the masked tokens of each reply and
    checks that they spell the reply (as the reply tokenized alone decodes): an independent check of the
    tokenizer's character offsets, and that no special token among them reaches outside the reply (`template_tokens`:
    `special_ids(tokenizer)`, given by a caller that tokenizes many). `cut` is filled with what `max_len` took away
    (tokens, loss tokens, replies). Linear in the conversation: two renderings (the text, the placeholders), one
    tokenization, one pass over the tokens; a template that renders placeholders otherwise adds a rendering per
    reply that --max-len keeps, none for the replies it cuts away.
    """
    text = _render(tokenizer, messages, False)
    try:  # the whole text (what --max-len takes away is reported), then cut: what truncation=True would keep
        enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False, verbose=False)
    except NotImplementedError:
        raise InvalidInput("conversations need a fast tokenizer (character offsets locate the assistant's tokens); "
                           "this model's tokenizer has none. Pre-tokenize into input_ids + loss_mask") from None
    full_offsets = enc["offset_mapping"]
    ids, offsets = list(enc["input_ids"])[:max_len], full_offsets[:max_len]
    reach = max((e_tok for _, e_tok in offsets), default=0)  # a reply beginning past it covers no kept token
    spans = assistant_spans(tokenizer, messages, text, reach)
    full_mask, covering = _tokens_over_spans(full_offsets, spans)
    mask = full_mask[:max_len]
    kept = [cover[:bisect.bisect_left(cover, max_len)] for cover in covering]  # each reply's kept tokens
    if cut is not None:
        cut.tokens, cut.loss_tokens, cut.replies = len(full_offsets) - len(ids), sum(full_mask) - sum(mask), len(spans)
        cut.replies_cut_wholly += sum(1 for whole, left in zip(covering, kept) if whole and not left)
        cut.replies_cut_partly += sum(1 for whole, left in zip(covering, kept) if 0 < len(left) < len(whole))
    kept_end = offsets[-1][1] if offsets else 0
    if check_decoded and template_tokens is None:  # given by read_dataset, once for the file
        template_tokens = special_ids(tokenizer)
    for k, (s, e) in enumerate(spans):
        if s >= kept_end:
            continue  # truncated away by --max-len, with the text
        if not kept[k]:
            raise UncoveredConversation(f"assistant message {k + 1}: no token of the tokenized text covers its "
                                        f"characters {s}..{e}")
        if check_decoded:
            _check_spelled(tokenizer, text, ids, offsets, (s, e), kept[k], k, kept_end, template_tokens)
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
                                    f"{_preview(got)}, not to the reply {_preview(want)}")
    # a reply found inside the template's own header decodes as part of it: a special or added token that
    # reaches outside the reply's characters is the template's (by position: tokens are spelled otherwise)
    outside = [j for j in covering if ids[j] in template_tokens and not s <= offsets[j][0] <= offsets[j][1] <= e]
    if outside:
        token = tokenizer.convert_ids_to_tokens(ids[outside[0]])
        raise UncoveredConversation(f"assistant message {k + 1}: its masked tokens hold {token!r}, a special "
                                    f"token reaching outside the reply {_preview(text[s:e])}")


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


def _conversation_tokens(tokenizer: Any, messages: list[dict], record: dict, where: str, max_len: int, cut: Cut,
                         check_decoded: bool, template_tokens: frozenset[int] | None,
                         tokenizer_error: str) -> tuple[list[int], list[int], frozenset[int] | None]:
    """A conversation line's ids and loss mask, and --validate's special tokens (read at the first conversation,
    given back for the next); UncoveredConversation as raised: the caller may skip the line."""
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
        ids, mask = tokenize_conversation(tokenizer, messages, max_len, check_decoded=check_decoded, cut=cut,
                                          template_tokens=template_tokens)
    except UncoveredConversation:
        raise
    except InvalidInput as exc:
        raise InvalidInput(f"{where}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the template's own error (e.g. roles must alternate)
        raise InvalidInput(f"{where}: the chat template failed on this conversation: "
                           f"{type(exc).__name__}: {exc}") from None
    if "input_ids" in record:  # both forms: used only where they agree, never one chosen silently
        given, given_mask = _token_record(record, where)
        given, given_mask = given[:max_len], given_mask[:max_len]
        if given != ids or ("loss_mask" in record and given_mask != mask):
            raise InvalidInput(
                f"{where}: holds both a conversation and 'input_ids'/'loss_mask', which differ (the conversation "
                f"gives {len(ids)} tokens {ids[:6]}... with {sum(mask)} loss tokens, the line {len(given)} "
                f"{given[:6]}... with {sum(given_mask)}); keep one form in each line: {LINE_FORMS}")
    return ids, mask, template_tokens


def _few_loss_tokens_reason(mask: list[int], cut: Cut, min_loss_tokens: int) -> str:
    if cut.replies_cut_wholly and not sum(mask):
        return "its replies were cut away by --max-len"
    if not sum(mask):
        return "no token of it is in the loss mask"
    return f"{sum(mask)} loss tokens, fewer than --min-loss-tokens {min_loss_tokens}"


def read_dataset(path: str, tokenizer: Any, max_len: int, *, vocab_size: int = 0, skip_uncovered: bool = False,
                 check_decoded: bool = False, min_loss_tokens: int = 0, tokenizer_error: str = "",
                 on_line: Any = None, into: Any = None) -> Dataset:
    """Every line parsed and tokenized, in order (extract runs this on a thread of its own: a large new set's batches
    start before it ends, job.READ_AHEAD_LINES). Samples with fewer than
    `min_loss_tokens` tokens in their loss mask (after --max-len) are left out and listed. `on_line()` after each
    line (the run's progress); `into`: where the samples go (anything with append and len; a list by default).
    `data_sha256` of the result: the SHA-256 of the bytes this reading consumed, taken as they were read (a file
    rewritten between a digest taken before and this reading gives another one)."""
    data = Dataset(into if into is not None else [])
    consumed = hashlib.sha256()
    unused_keys: collections.Counter = collections.Counter()
    without_mask = 0
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
            messages = _messages(record, where, unused_keys)
            cut = Cut()
            if messages is not None:
                try:
                    ids, mask, template_tokens = _conversation_tokens(
                        tokenizer, messages, record, where, max_len, cut, check_decoded, template_tokens,
                        tokenizer_error)
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
            if _messages(record, where) is None:  # (a conversation's own input_ids are read against its tokens)
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
                     + ", ".join(f"{k!r} in {n}" for k, n in keys.items()) + "): only each message's role and "
                     "content are (as in speculators' own preprocessing); put what the model should see (a system "
                     "prompt, reasoning, tool calls) into messages' content")
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
        raise InvalidInput(f"{where}: input_ids must be a list of ints, got {_preview(json.dumps(ids))}")
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
