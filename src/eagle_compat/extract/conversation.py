"""A conversation line as vLLM's OpenAI-compatible chat endpoint hands it to the chat template: each message's role
and content, an assistant's reasoning (`reasoning`, and `reasoning_content` with the same text, as vLLM passes both)
and tool calls (arguments as objects), a tool message's `tool_call_id`, any message's `name`; the line's `tools` and
`chat_template_kwargs` (e.g. `enable_thinking`). vLLM's own rendering of the same request gives the same token ids
(tests/test_chat_rendering.py, against `LLM.chat` on the CPU engine).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidInput

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


@dataclass
class Chat:
    """A conversation as the template gets it: `messages` (dicts of the keys above), the line's `tools` (None: none)
    and `template_kwargs` (the line's chat_template_kwargs)."""
    messages: list[dict]
    tools: list[dict] | None = None
    template_kwargs: dict = field(default_factory=dict)

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
            except ValueError as exc:
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
    content = one_spelling(m, "content", "value", where, "a message")
    calls = m.get("tool_calls") or None
    if content is None and role == "assistant" and calls:
        content = ""  # a reply that only calls tools (vLLM renders its missing content as "")
    if role is None or not isinstance(content, str):
        raise InvalidInput(f"{where}: message needs a role in {sorted(set(ROLE_ALIASES))} and string content "
                           f"(both JSON strings; an assistant's content may be null where it has tool_calls), got "
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
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


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
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise InvalidInput(f"{where}: tools must be a list of tool objects (OpenAI's form), got {shown(tools)}")
    kwargs = record.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise InvalidInput(f"{where}: chat_template_kwargs must be an object, got {shown(kwargs)}")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise InvalidInput(f"{where}: chat_template_kwargs cannot set {', '.join(reserved)} (the chat template's "
                           "own parameters); the line's messages and tools are given as they are")
    return Chat(messages, tools, dict(kwargs))
