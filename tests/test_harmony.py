"""gpt-oss conversations rendered as vLLM's chat endpoint renders them (harmony), and their loss masks by channel
(eagle_compat.extract.harmony, docs/adr/0052)."""
from __future__ import annotations

import asyncio
import json

import pytest

import helpers
from eagle_compat import tiny_models
from eagle_compat.errors import InvalidInput
from eagle_compat.extract import conversation, harmony, inputs

pytest.importorskip("openai_harmony")
pytestmark = helpers.in_newest_pass_only("vLLM's harmony rendering moved between releases; the newest is checked "
                                         "against its own server")

DATE = "2026-01-01"
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}]
THINKING = {"messages": [
    {"role": "system", "content": "Answer in one line."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "reasoning": "Two and two make four.", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "reasoning": "Three and three make six.", "content": "6"}]}
TOOLS = {"tools": WEATHER, "messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "reasoning": "I should call the tool.", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\":  \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "assistant", "reasoning": "Sunny it is.", "content": "It is sunny in Paris, 21 C."}]}
PLAIN = {"chat_template_kwargs": {"reasoning_effort": "high"}, "messages": [
    {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Indigo."}]}


@pytest.fixture(autouse=True)
def pinned_date(monkeypatch):
    monkeypatch.setenv(harmony.START_DATE_ENV, DATE)


@pytest.fixture(scope="module")
def gpt_oss():
    path, _, _ = tiny_models.build_family("gpt_oss")
    return path


def _server_prompt(model: str, record: dict, upto: int) -> list[int]:
    """What vLLM's OpenAI-compatible chat endpoint renders for the request of the line's first `upto` messages: its
    own OnlineRenderer, built as `vllm serve` builds it, without an engine."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.online_renderer import OnlineRenderer
    from vllm.renderers.registry import renderer_from_config
    config = EngineArgs(model=model, max_model_len=1024).create_engine_config()
    server = OnlineRenderer(config.model_config, renderer_from_config(config), request_logger=None,
                            chat_template=None, chat_template_content_format="auto")
    extra = ({"reasoning_effort": record["chat_template_kwargs"]["reasoning_effort"]}
             if "chat_template_kwargs" in record else {})
    request = ChatCompletionRequest(model=model, messages=record["messages"][:upto], tools=record.get("tools"),
                                    **extra)
    _, engine_inputs = asyncio.run(server.render_chat(request))
    return list(engine_inputs[0]["prompt_token_ids"])


def _sample(record: dict, **kwargs):
    cut, context = inputs.Cut(), set()
    ids, mask = harmony.tokenize_conversation(conversation.chat_of(record, "data.jsonl:1"), 4096, cut=cut,
                                              without_reasoning=context, **kwargs)
    return ids, mask, cut, context


def _masked_pieces(ids: list[int], mask: list[int]) -> list[str]:
    from vllm.entrypoints.openai.parser.harmony_utils import get_encoding
    pieces, run = [], []
    for t, m in zip(ids + [0], mask + [0]):
        if m:
            run.append(t)
        elif run:
            pieces.append(get_encoding().decode(run))
            run = []
    return pieces


def test_a_gpt_oss_model_is_rendered_by_harmony(gpt_oss, tmp_path):
    assert inputs.chat_format_of(gpt_oss) == "harmony"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert inputs.chat_format_of(str(tmp_path)) == "template"


@pytest.mark.parametrize("record", [THINKING, TOOLS, PLAIN], ids=["thinking", "tools", "reasoning-effort"])
def test_the_prompt_is_the_servers_and_the_reply_follows_as_generated(gpt_oss, record):
    """The sample begins with the very ids vLLM's chat endpoint renders as the prompt of the last turn; after it
    come the reply's messages as gpt-oss generates them (`<|return|>` ending the final answer)."""
    from vllm.entrypoints.openai.parser.harmony_utils import get_encoding
    ids, _, _, _ = _sample(record)
    upto = len(record["messages"]) - 1
    prompt = _server_prompt(gpt_oss, record, upto)
    assert ids[:len(prompt)] == prompt
    reply = record["messages"][-1]
    expected = (f"<|channel|>analysis<|message|>{reply['reasoning']}<|end|><|start|>assistant"
                if reply.get("reasoning") else "") + f"<|channel|>final<|message|>{reply['content']}<|return|>"
    assert get_encoding().decode(ids[len(prompt):]) == expected


def test_the_mask_is_each_messages_content_by_channel_and_earlier_dropped_reasoning_is_context():
    ids, mask, cut, context = _sample(THINKING)
    assert _masked_pieces(ids, mask) == ["Three and three make six.", "6"]
    assert context == {2}  # the first reply: the server drops its analysis once a later final answer follows
    assert cut.replies == 1 and cut.reasoning_tokens > 0 and cut.tool_call_tokens == 0


def test_tool_calls_are_in_the_mask_as_their_arguments_and_tool_results_are_not():
    ids, mask, cut, context = _sample(TOOLS)
    # the call turn's analysis is kept (no final answer before it), and its arguments are the line's own text
    assert _masked_pieces(ids, mask) == ["I should call the tool.", "{\"city\":  \"Paris\"}", "Sunny it is.",
                                         "It is sunny in Paris, 21 C."]
    assert context == set() and cut.tool_call_tokens > 0 and cut.replies == 2
    replies, _, _, _ = _sample(TOOLS, loss_mask="replies")
    assert _masked_pieces(replies, _sample(TOOLS, loss_mask="replies")[1]) == ["It is sunny in Paris, 21 C."]


def test_max_len_cuts_the_sample_and_counts_what_it_took():
    full, full_mask, _, _ = _sample(THINKING)
    cut, context = inputs.Cut(), set()
    ids, mask = harmony.tokenize_conversation(conversation.chat_of(THINKING, "data.jsonl:1"), len(full) - 3,
                                              cut=cut, without_reasoning=context)
    assert ids == full[:len(full) - 3] and mask == full_mask[:len(full) - 3]
    assert cut.tokens == 3 and cut.loss_tokens == sum(full_mask[-3:]) and cut.replies_cut_partly == 1


def test_without_a_pinned_date_a_conversation_is_refused_naming_the_setting(monkeypatch):
    monkeypatch.delenv(harmony.START_DATE_ENV)
    with pytest.raises(InvalidInput, match=harmony.START_DATE_ENV + r"=YYYY-MM-DD"):
        _sample(PLAIN)


def test_read_dataset_renders_gpt_oss_lines_by_harmony_and_notes_dropped_reasoning(gpt_oss, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (THINKING, TOOLS)))
    read = inputs.read_dataset(str(data), None, 4096, chat_format="harmony")
    assert [list(s.input_ids) for s in read.samples] == [_sample(THINKING)[0], _sample(TOOLS)[0]]
    assert read.notes["replies_rendered_without_their_reasoning"] == 1


def test_a_conversation_ending_in_a_tool_call_trains_on_the_reasoning_then_the_call():
    """gpt-oss thinks first: the trailing reply's analysis comes before its call (the server lists a calling
    reply's content first when it renders history), and the sample ends at the call's `<|call|>`."""
    from vllm.entrypoints.openai.parser.harmony_utils import get_encoding
    calling = {**TOOLS["messages"][1], "content": "Let me look it up."}  # a preamble to the user beside the call
    record = {"tools": WEATHER, "messages": [TOOLS["messages"][0], calling]}
    ids, mask, cut, _ = _sample(record)
    assert _masked_pieces(ids, mask) == ["I should call the tool.", "Let me look it up.", "{\"city\":  \"Paris\"}"]
    text = get_encoding().decode(ids)
    assert text.endswith("<|call|>")
    assert cut.tool_call_tokens > 0


def test_a_system_message_after_the_first_is_taken_as_the_server_takes_it():
    record = {"messages": [{"role": "user", "content": "Hi."}, {"role": "system", "content": "Be terse."},
                           {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."}]}
    ids, mask, _, _ = _sample(record)
    assert _masked_pieces(ids, mask) == ["Red."]


@pytest.mark.parametrize("record,match", [
    ({"messages": [{"role": "user", "content": "Weather?"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                   {"role": "tool", "content": "rain"}, {"role": "assistant", "content": "Rain."}]},
     r"message 3 \(a tool result\) has no tool_call_id"),
    ({"chat_template_kwargs": {"reasoning_effort": "extreme"}, "messages": PLAIN["messages"]},
     r"vLLM's chat endpoint refuses this conversation: .*extreme"),
])
def test_what_the_server_would_refuse_is_refused_naming_it(record, match):
    with pytest.raises(InvalidInput, match=match):
        _sample(record)


def test_a_vllm_that_renders_harmony_elsewhere_is_refused_with_the_way_out(monkeypatch):
    monkeypatch.setattr(harmony, "SERVER", ("vllm.no_such_module", "OnlineRenderer"))
    with pytest.raises(InvalidInput, match=r"as vLLM 0.32's chat endpoint renders them .* 'input_ids' with "
                                           r"'loss_mask'"):
        _sample(PLAIN)
