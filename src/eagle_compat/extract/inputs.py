"""Read the input JSONL: conversations (chat template applied, loss mask on assistant tokens, as speculators 0.3.0's
preprocessing does) or pre-tokenized ids."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidInput

ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "bot": "assistant",
                "model": "assistant", "system": "system"}


@dataclass
class Sample:
    index: int
    input_ids: list[int]
    loss_mask: list[int]


def _messages(record: dict, where: str) -> list[dict] | None:
    conv = record.get("conversations", record.get("messages"))
    if conv is None:
        return None
    if not isinstance(conv, list) or not conv:
        raise InvalidInput(f"{where}: 'conversations' must be a non-empty list of messages")
    out = []
    for m in conv:
        if not isinstance(m, dict):
            raise InvalidInput(f"{where}: message {m!r} is not an object")
        role = ROLE_ALIASES.get(str(m.get("role", m.get("from", ""))).lower())
        content = m.get("content", m.get("value"))
        if role is None or not isinstance(content, str):
            raise InvalidInput(f"{where}: message needs a role in {sorted(set(ROLE_ALIASES))} and string content, "
                               f"got {m!r}")
        out.append({"role": role, "content": content})
    return out


def tokenize_conversation(tokenizer: Any, messages: list[dict], max_len: int) -> tuple[list[int], list[int]]:
    """Token ids of the chat-templated conversation and a mask that is 1 on assistant-content tokens.

    The assistant spans are found by rendering the conversation prefix by prefix (the text an assistant message
    adds to the template), then mapped to tokens through the tokenizer's character offsets.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False, add_generation_prompt=False)
        if not text.startswith(through) or not through.startswith(before[: len(through)]):
            continue
        start = through.find(m["content"], len(before) - len(m["content"]) if len(before) > len(m["content"]) else 0)
        if start >= 0:
            spans.append((start, start + len(m["content"])))
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False, truncation=True, max_length=max_len)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [1 if any(s < e_tok and b_tok < e for s, e in spans) else 0 for b_tok, e_tok in offsets]
    return list(ids), mask


def read_samples(path: str, tokenizer: Any, max_len: int) -> list[Sample]:
    samples = []
    with open(path) as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            where = f"{path}:{n + 1}"
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise InvalidInput(f"{where}: not JSON ({exc})") from None
            if not isinstance(record, dict):
                raise InvalidInput(f"{where}: each line must be a JSON object")
            messages = _messages(record, where)
            if messages is not None:
                if tokenizer is None:
                    raise InvalidInput(f"{where}: conversations need the model's tokenizer, which did not load")
                ids, mask = tokenize_conversation(tokenizer, messages, max_len)
            elif "input_ids" in record:
                ids = record["input_ids"]
                if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise InvalidInput(f"{where}: input_ids must be a list of ints")
                mask = record.get("loss_mask", [1] * len(ids))
                if len(mask) != len(ids) or any(v not in (0, 1) for v in mask):
                    raise InvalidInput(f"{where}: loss_mask must be 0/1 values, one per input id")
                ids, mask = ids[:max_len], mask[:max_len]
            else:
                raise InvalidInput(f"{where}: a line needs 'conversations' (or 'messages') or 'input_ids'")
            if not ids:
                raise InvalidInput(f"{where}: the sample tokenizes to nothing")
            samples.append(Sample(len(samples), list(ids), list(mask)))
    if not samples:
        raise InvalidInput(f"{path}: no samples")
    return samples
