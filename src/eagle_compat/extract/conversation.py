"""A conversation line as vLLM's OpenAI-compatible chat endpoint hands it to the chat template: each message's role
and content, an assistant's reasoning (`reasoning`, and `reasoning_content` with the same text, as vLLM passes both)
and tool calls (arguments as objects), a tool message's `tool_call_id`, any message's `name`; the line's `tools` and
`chat_template_kwargs` (e.g. `enable_thinking`). vLLM's own rendering of the same request gives the same token ids
(tests/test_chat_rendering.py, against `LLM.chat` on the CPU engine).

Then where the template put what the assistant generated (`assistant_pieces`): each reply's reasoning, content and
tool calls, located by renderings with placeholders, never by searching for their words in the template's text.
"""
from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidInput

# what the loss mask covers in each reply: all the model generated (reasoning, content, tool calls), or the content
LOSS_MASKS = ("generated", "replies")
ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "bot": "assistant",
                "model": "assistant", "system": "system", "tool": "tool"}
# what a message passes to the chat template (both spellings of role/content, ShareGPT's and OpenAI's)
MESSAGE_KEYS = {"role", "content", "from", "value", "reasoning", "reasoning_content", "tool_calls", "tool_call_id",
                "name"}
# apply_chat_template's own parameters: a line's chat_template_kwargs cannot set them (vLLM refuses them too)
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                      "add_generation_prompt", "continue_final_message", "padding", "truncation",
                                      "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                                      "tokenizer_kwargs"})


class UncoveredConversation(InvalidInput):
    """An assistant message whose tokens cannot be located in the chat-templated text (no loss mask for it)."""


@dataclass
class Chat:
    """A conversation as the template gets it: `messages` (dicts of the keys above), the line's `tools` (None: none)
    and `template_kwargs` (the line's chat_template_kwargs)."""
    messages: list[dict]
    tools: list[dict] | None = None
    template_kwargs: dict = field(default_factory=dict)
    # each tool call's arguments as the line wrote them, by (message, call): harmony takes the text as it is
    call_arguments: dict[tuple[int, int], str] = field(default_factory=dict)

    def render(self, tokenizer: Any, messages: list[dict] | None = None, generation_prompt: bool = False) -> str:
        """The template's text of `messages` (default: this chat's), with this chat's tools and keywords."""
        return tokenizer.apply_chat_template(self.messages if messages is None else messages, tools=self.tools,
                                             tokenize=False, add_generation_prompt=generation_prompt,
                                             **self.template_kwargs)

    def reasoning(self, i: int) -> str:
        return self.messages[i].get("reasoning") or ""


def as_chat(messages: "Chat | list[dict]") -> Chat:
    return messages if isinstance(messages, Chat) else Chat(list(messages))


def one_spelling(obj: dict, first: str, second: str, where: str, what: str, meaning: Any = None) -> Any:
    """The value of `first`, else of `second` (ShareGPT's spelling). Both given (not null) with different meanings
    (`meaning` of each value; the values themselves by default): refused, never one of them chosen silently."""
    if obj.get(first) is not None and obj.get(second) is not None:
        one, other = (obj[first], obj[second]) if meaning is None else (meaning(obj[first]), meaning(obj[second]))
        if one != other:
            raise InvalidInput(f"{where}: {what} gives both {first!r} ({shown(obj[first])}) and {second!r} "
                               f"({shown(obj[second])}), which differ; give one of them")
    return obj[first] if first in obj else obj.get(second)


def shown(value: Any, n: int = 40) -> str:
    """A JSON value as the line writes it (1.0, true, "1"), cut to `n` characters."""
    text = json.dumps(value)
    return text if len(text) <= n else text[:n] + "..."


def role_of(given: Any) -> str | None:
    """The role a message's role/from names (None: none): exactly a JSON string, one of ROLE_ALIASES."""
    return ROLE_ALIASES.get(given.lower()) if isinstance(given, str) else None


def _tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant's tool calls as vLLM hands them to the template: OpenAI's {"id", "type": "function", "function":
    {"name", "arguments"}}, the arguments parsed from their JSON string into an object. vLLM coerces arguments that
    are not a JSON object to {} with a warning; training data that would teach the drafter calls the model never
    made is refused instead, naming the call."""
    if not isinstance(calls, list):
        raise InvalidInput(f"{where}: tool_calls must be a list of calls, got {shown(calls)}")
    out = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function" or not isinstance(
                function.get("name"), str):
            raise InvalidInput(f"{where}: tool_calls[{k}] must be {{\"type\": \"function\", \"function\": {{\"name\": "
                               f"..., \"arguments\": ...}}}} (OpenAI's form), got {shown(call, 80)}")
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments.strip():
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError) as exc:
                raise InvalidInput(f"{where}: tool_calls[{k}] ({function['name']}) has arguments that are not JSON "
                                   f"({exc}): {shown(function['arguments'])}") from None
        elif arguments in (None, ""):
            arguments = {}
        if not isinstance(arguments, dict):
            raise InvalidInput(f"{where}: tool_calls[{k}] ({function['name']}) has arguments {shown(arguments)}; "
                               "must be a JSON object (or a string holding one)")
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def _message(m: Any, where: str) -> dict:
    if not isinstance(m, dict):
        raise InvalidInput(f"{where}: message {m!r} is not an object")
    role = role_of(one_spelling(m, "role", "from", where, "a message", meaning=role_of))
    given = "content" in m or "value" in m  # a message without content at all is a broken line, not an empty one
    content = _text_of(one_spelling(m, "content", "value", where, "a message")) if given else None
    calls = m.get("tool_calls") or None
    if role is None or not isinstance(content, str):
        raise InvalidInput(f"{where}: message needs a role in {sorted(set(ROLE_ALIASES))} and text content (a JSON "
                           "string, null, or a list of {\"type\": \"text\", \"text\": ...} parts), got "
                           f"{shown(m, 120)}")
    out: dict = {"role": role, "content": content}
    reasoning = one_spelling(m, "reasoning", "reasoning_content", where, "a message")
    if reasoning is not None:
        if role != "assistant" or not isinstance(reasoning, str):
            raise InvalidInput(f"{where}: reasoning is an assistant message's string, got {shown(reasoning)} in a "
                               f"{role} message")
        out["reasoning"] = out["reasoning_content"] = reasoning  # vLLM passes both names
    if calls is not None:
        if role != "assistant":
            raise InvalidInput(f"{where}: tool_calls belong to an assistant message, not a {role} one")
        out["tool_calls"] = _tool_calls(calls, where)
    if role == "tool" and isinstance(m.get("tool_call_id"), str):  # vLLM keeps it on tool messages only
        out["tool_call_id"] = m["tool_call_id"]
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def _text_of(content: Any) -> Any:
    """A message's content as vLLM's chat endpoint gives it to a template that takes strings: null as "", a list of
    text parts joined by newlines; anything else as it is (refused by the caller unless a string)."""
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(
            p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    return content


def _tool(tool: Any, where: str) -> dict:
    """A tool as vLLM's server hands it to the template (its request model dumped): {"type": "function", "function":
    {"name", "description", "parameters"}} in that order, description and parameters null where not given, `strict`
    and `defer_loading` only where given, other keys dropped. A template that renders `tool | tojson` then shows the
    model the server's text."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or tool.get("type", "function") != "function" or not isinstance(
            function.get("name"), str):
        raise InvalidInput(f"{where}: each of tools must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                           f"\"parameters\": ...}}}} (OpenAI's form), got {shown(tool, 80)}")
    out = {"name": function["name"], "description": function.get("description"),
           "parameters": function.get("parameters")}
    out.update({k: function[k] for k in ("strict", "defer_loading") if function.get(k) is not None})
    return {"type": "function", "function": out,
            **({"defer_loading": tool["defer_loading"]} if tool.get("defer_loading") is not None else {})}


def chat_of(record: dict, where: str, unused_keys: Any = None) -> Chat | None:
    """The line's conversation (None: the line has none), checked: roles, string contents, both spellings agreeing,
    reasoning and tool calls where they belong, tools a list, chat_template_kwargs an object of allowed names.
    `unused_keys` (a Counter) counts what the template is not given."""
    conv = one_spelling(record, "conversations", "messages", where, "the line")
    if conv is None:
        return None
    if not isinstance(conv, list) or not conv:
        raise InvalidInput(f"{where}: 'conversations' must be a non-empty list of messages")
    messages = [_message(m, where) for m in conv]
    if unused_keys is not None:  # null or empty values (OpenHermes' "weight": null on every message) say nothing
        for m in conv:
            unused_keys.update(k for k, v in m.items() if k not in MESSAGE_KEYS and v not in (None, "", [], {}))
        if record.get("system"):
            unused_keys.update(["top-level system"])
    tools = record.get("tools") or None
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidInput(f"{where}: tools must be a list of tool objects (OpenAI's form), got {shown(tools)}")
        tools = [_tool(t, where) for t in tools]
    kwargs = record.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise InvalidInput(f"{where}: chat_template_kwargs must be an object, got {shown(kwargs)}")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise InvalidInput(f"{where}: chat_template_kwargs cannot set {', '.join(reserved)} (the chat template's "
                           "own parameters); the line's messages and tools are given as they are")
    arguments = {(i, k): _arguments_text(call) for i, m in enumerate(conv) if messages[i].get("tool_calls")
                 for k, call in enumerate(m["tool_calls"])}
    return Chat(messages, tools, dict(kwargs), arguments)


def _arguments_text(call: dict) -> str:
    arguments = call["function"].get("arguments")
    return arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {})


# ---- where the template put what the assistant generated ------------------------------------------------------

def _placeholder(k: int) -> str:
    return f"EagleCompatReply{k}Placeholder7f3a"


PLACEHOLDER = re.compile(r"EagleCompatReply(\d+)Placeholder7f3a")  # every _placeholder(k), found in one pass
PIECE_FIELDS = ("reasoning", "content")  # what of a reply a placeholder stands in for, where the reply has it


def _fits(value: str) -> list[str]:
    """How a template may render a piece: as it is, or trimmed (Qwen3's reasoning.strip('\\n'), content.lstrip)."""
    return list(dict.fromkeys((value, value.strip("\n"), value.lstrip("\n"), value.rstrip("\n"), value.strip())))


def _with_pieces(chat: Chat, pieces: dict[tuple[int, str], int], other_calls: int | None = None) -> list[dict]:
    out = []
    for i, m in enumerate(chat.messages):
        m = {**m}
        for name in PIECE_FIELDS:
            if (i, name) in pieces:
                m[name] = _placeholder(pieces[(i, name)])
                if name == "reasoning":
                    m["reasoning_content"] = m[name]
        if i == other_calls:
            m["tool_calls"] = _other_calls(m["tool_calls"])
        out.append(m)
    return out


def _other_calls(calls: list[dict]) -> list[dict]:
    """The same calls, each with another name (differing at its first character) and other arguments: the template
    takes the same path (as many calls, each a call, the ids kept), and only the calls' own text differs."""
    out = []
    for call in calls:
        function = call["function"]
        name = function["name"]
        other = ("Q" if not name.startswith("Q") else "Z") * max(1, len(name))
        out.append({**call, "function": {**function, "name": other,
                                         "arguments": {} if function["arguments"] else {"q": 0}}})
    return out


@dataclass
class _Located:
    spans: dict  # (message index, "reasoning" | "content" | "tool_calls") -> (start, end) in the text
    without_reasoning: set  # replies whose reasoning the template does not render (Qwen3: earlier turns)


def _pieces_in_place(tokenizer: Any, chat: Chat, text: str, replies: list[int] | None = None) -> _Located | None:
    """Where the template put the replies' pieces (the messages `replies`, else every assistant message): their
    reasoning and content, from one more rendering with a placeholder in each one's place (`text` must be that
    rendering with each placeholder replaced by its piece, as it is or trimmed), and their tool calls (_calls_in_place).
    A reply's reasoning may be missing (the template drops it); its content may not. None where the template renders
    the rest around them differently."""
    if replies is None:
        replies = [i for i, m in enumerate(chat.messages) if m["role"] == "assistant"]
    # an empty piece gets no placeholder (it may change the template's path), nor one of whitespace alone (a
    # template that trims it renders nothing of it)
    values = {(i, name): chat.messages[i].get(name) for i in replies for name in PIECE_FIELDS
              if (chat.messages[i].get(name) or "").strip()}
    pieces = {piece: k for k, piece in enumerate(values)}
    placed = chat.render(tokenizer, _with_pieces(chat, pieces))
    by_number = {str(k): piece for piece, k in pieces.items()}
    found = [(by_number[m.group(1)], m.start(), m.end()) for m in PLACEHOLDER.finditer(placed)
             if m.group(1) in by_number]
    seen = {piece for piece, _, _ in found}
    if len(seen) != len(found) or any(name == "content" and (i, name) not in seen for i, name in values):
        return None
    # each placeholder's place in `placed` and its piece's in `text`: text = placed with each replaced by a fit
    spans, anchors, at, last = {}, [], 0, 0  # anchors: (end in placed, end in text)
    for j, (piece, begin, end) in enumerate(found):
        between = placed[last:begin]
        if not text.startswith(between, at):
            return None
        at += len(between)
        following = placed[end:found[j + 1][1]] if j + 1 < len(found) else placed[end:]
        fits = [c for c in _fits(values[piece]) if text.startswith(c, at) and text.startswith(following, at + len(c))]
        if not fits:
            return None
        spans[piece] = (at, at + len(fits[0]))
        at, last = at + len(fits[0]), end
        anchors.append((end, at))
    if text[at:] != placed[last:]:
        return None
    without_reasoning = {i for (i, name) in values if name == "reasoning" and (i, name) not in spans}
    for i in replies:
        if chat.messages[i].get("tool_calls") and i not in without_reasoning:
            calls = _calls_in_place(tokenizer, chat, pieces, placed, anchors, i)
            if calls is None:
                return None
            spans[(i, "tool_calls")] = calls
    return _Located(spans, without_reasoning)


def _calls_in_place(tokenizer: Any, chat: Chat, pieces: dict, placed: str, anchors: list[tuple[int, int]],
                    i: int) -> tuple[int, int] | None:
    """Reply i's tool calls in the text: from where the placeholder rendering first differs when that reply's calls
    have other names and arguments to where it last does (the calls' names and arguments and what the template puts
    between them; the markup around the calls, such as <tool_call>, stays out like any template markup), mapped into
    the text. None where that part holds a placeholder; UncoveredConversation, with the template's own error, where
    it refuses the other calls (one that checks names against the tools, say). Leaving the calls out instead changed
    what the template renders for the next message (DeepSeek-R1's tool-output header) and failed templates that check
    the turns' structure (Mistral's, gpt-oss's)."""
    try:
        other = chat.render(tokenizer, _with_pieces(chat, pieces, other_calls=i))
    except Exception as exc:  # noqa: BLE001 - the template's own error, said
        raise UncoveredConversation(
            f"assistant message {reply_number(chat, i)}: its tool calls cannot be located: the chat template refused "
            f"the same calls with other names and arguments ({type(exc).__name__}: {exc})") from None
    head = 0
    limit = min(len(placed), len(other))
    while head < limit and placed[head] == other[head]:
        head += 1
    tail = 0
    while tail < limit - head and placed[-1 - tail] == other[-1 - tail]:
        tail += 1
    begin, end = head, len(placed) - tail
    while begin < end and placed[begin].isspace():
        begin += 1
    while end > begin and placed[end - 1].isspace():
        end -= 1
    if begin >= end or PLACEHOLDER.search(placed, begin, end):
        return None
    k = bisect.bisect_right([a for a, _ in anchors], begin)  # the placeholders before it shift it into the text
    shift = anchors[k - 1][1] - anchors[k - 1][0] if k else 0
    return begin + shift, end + shift


def assistant_spans(tokenizer: Any, messages: "Chat | list[dict]", text: str, reach: int | None = None,
                    without_reasoning: set | None = None) -> list[tuple[int, int]]:
    """assistant_pieces' spans, without the replies they belong to."""
    return [(b, e) for b, e, _, _ in assistant_pieces(tokenizer, messages, text, reach, without_reasoning)]


def assistant_pieces(tokenizer: Any, messages: "Chat | list[dict]", text: str, reach: int | None = None,
                     without_reasoning: set | None = None) -> list[tuple[int, int, int, str]]:
    """(start, end, message index, "reasoning" | "content" | "tool_calls"): character spans of what the assistant
    generated in `text`, the templated conversation, in order and disjoint: each reply's reasoning (where the template
    renders it), its content and its tool calls. A reply whose reasoning the template does not render (Qwen3's drops it
    from turns before the last user message) is not what the model generated at that turn: it stays as context, out of
    the mask, and is added to `without_reasoning`.

    Replies are looked for where the template put them: rendered again with a placeholder in each piece's place,
    the conversation must be `text` around the pieces. Short replies are so never matched inside the template's
    own header text (R1's "<｜Assistant｜>" holds "A", Qwen3's "<think>" holds "hi"). Where the template renders the
    rest differently around placeholders (it moves reasoning out of earlier replies, say), each reply is looked up in
    order (never inside an earlier message): where a placeholder for it alone renders the rest as `text`, there;
    else after the generation header, where the prefix up to it renders as the text starts. A reply that is not in
    the text (the template rewrites or drops it) raises UncoveredConversation, as does reasoning the template renders
    in no turn (it has no place for it) and tool calls found only by that search. Replies that begin at or past
    `reach` (no token --max-len keeps ends past it) are looked up in order only, without those renderings: a
    rendering per reply made a long conversation quadratic, and their tokens are cut away (they count in the report).
    """
    chat = as_chat(messages)
    in_place = _pieces_in_place(tokenizer, chat, text)
    if in_place is not None:
        return _generated(chat, in_place, without_reasoning)
    found: dict = {}  # (message index, piece) -> span, as _Located keeps them
    dropped: set = set()  # replies whose reasoning is not in the text
    cursor = 0
    for i, m in enumerate(chat.messages):
        content = m["content"]
        start = cursor
        if m["role"] == "assistant" and (reach is None or cursor < reach):
            alone = _pieces_in_place(tokenizer, chat, text, [i])
            if alone is not None and all(begin >= cursor for begin, _ in alone.spans.values()):
                found.update(alone.spans)
                dropped |= alone.without_reasoning
                cursor = max([cursor] + [end for _, end in alone.spans.values()])
                continue
            if m.get("tool_calls"):
                raise UncoveredConversation(f"assistant message {reply_number(chat, i)} has tool calls, and the "
                                            "template renders its conversation so that they cannot be located")
            if i:
                before = chat.render(tokenizer, chat.messages[:i], True)
                if text.startswith(before):
                    start = max(cursor, len(before))
        pieces = [("reasoning", chat.reasoning(i)), ("content", content)] if m["role"] == "assistant" else [
            ("content", content)]
        for name, value in pieces:
            if not value.strip():
                continue
            pos, fit = -1, value
            for candidate in _fits(value):  # templates often trim message content
                if candidate:
                    pos, fit = text.find(candidate, start), candidate
                    if pos >= 0:
                        break
            if pos < 0:
                if m["role"] == "assistant" and name == "reasoning":
                    dropped.add(i)
                elif m["role"] == "assistant":
                    raise UncoveredConversation(
                        f"assistant message {reply_number(chat, i)} ({preview(value)}) is not in the chat-templated "
                        "text: the template renders it differently (rewrites it, or drops part of it from earlier "
                        "turns), so its tokens cannot be located for the loss mask")
                continue  # a system/user text the template rewrites: it only positions the search
            if m["role"] == "assistant":
                found[(i, name)] = (pos, pos + len(fit))
            start = cursor = pos + len(fit)
    return _generated(chat, _Located(found, dropped), without_reasoning)


def reply_number(chat: Chat, i: int) -> int:
    return sum(1 for x in chat.messages[: i + 1] if x["role"] == "assistant")


def replies_only(pieces: list[tuple[int, int, int, str]]) -> list[tuple[int, int, int, str]]:
    """--loss-mask replies: the replies' content alone (reasoning and tool calls out of the mask)."""
    return [p for p in pieces if p[3] == "content"]


def count_cut(cut: Any, pieces: list[tuple[int, int, int, str]], covering: list[list[int]],
              kept: list[list[int]], tokens_cut: int, loss_tokens_cut: int) -> None:
    """Fill `cut` (inputs.Cut) for one sample: the kept loss tokens by kind, and the replies --max-len cut wholly or in
    part. `covering`: each piece's token positions; `kept`: those --max-len keeps (the chat template's and harmony's
    renderings alike)."""
    whole: dict[int, list[int]] = {}
    left: dict[int, list[int]] = {}
    of_kind: dict[str, set[int]] = {"reasoning": set(), "tool_calls": set()}
    for (_, _, i, kind), cover, still in zip(pieces, covering, kept):
        whole.setdefault(i, []).extend(cover)
        left.setdefault(i, []).extend(still)
        of_kind.get(kind, set()).update(still)
    cut.reasoning_tokens, cut.tool_call_tokens = len(of_kind["reasoning"]), len(of_kind["tool_calls"])
    cut.tokens, cut.loss_tokens, cut.replies = tokens_cut, loss_tokens_cut, len(whole)
    cut.replies_cut_wholly += sum(1 for i in whole if whole[i] and not left[i])
    cut.replies_cut_partly += sum(1 for i in whole if 0 < len(left[i]) < len(whole[i]))


def check_loss_mask(value: Any, option: str = "loss_mask") -> str:
    if value not in LOSS_MASKS:
        raise InvalidInput(f"{option} {value!r}; must be one of {', '.join(LOSS_MASKS)} (generated: each reply's "
                           "reasoning, content and tool calls; replies: its content only)")
    return value


def _generated(chat: Chat, located: _Located, without_reasoning: set | None) -> list[tuple[int, int, int, str]]:
    """The located pieces of the replies the template renders as generated, in text order."""
    dropped = located.without_reasoning
    if dropped:
        last = len(chat.messages) - 1
        if last in dropped:  # not even a reply that ends the conversation: this template has no place for reasoning
            raise UncoveredConversation(
                f"assistant message {reply_number(chat, last)} has reasoning ({preview(chat.reasoning(last))}), "
                "which this model's chat template does not render: the server never shows this model reasoning "
                "that way. Put it into the content as the model writes it (e.g. <think>...</think>), or leave the "
                "field out")
        if without_reasoning is not None:
            without_reasoning.update(dropped)
    return sorted((*span, i, kind) for (i, kind), span in located.spans.items() if i not in dropped)


def preview(text: str, n: int = 40) -> str:
    return json.dumps(text if len(text) <= n else text[:n] + "...")
