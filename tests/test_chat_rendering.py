"""Conversations as vLLM's chat endpoint renders them: reasoning, tool calls, tool results, tools and
chat_template_kwargs reach the chat template, the token ids equal vLLM's own rendering of the same request
(`LLM.chat` on the CPU engine), and the loss mask covers what the model generated: each reply's reasoning (where the
template renders it), content and tool calls; headers, markup, user, system and tool turns stay out.

The thinking and tool-calling template is the Qwen3 one vLLM ships (for MiniCPM-V 4.5, a Qwen3 model:
vllm/transformers_utils/chat_templates/template_minicpmv45.jinja): reasoning rendered in <think> blocks for the turns
after the last user message only, tool calls as <tool_call> JSON blocks, tool results folded into a user turn.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

import helpers
from eagle_compat import tiny_models
from eagle_compat.errors import InvalidInput
from eagle_compat.extract import inputs

MARKUP = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
          "</tool_response>"]
# Mistral-like: tool calls after the content, as one JSON list, in the same turn
CALLS_AFTER_CONTENT = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|> {{ m['content'] }}"
    "{% if m['tool_calls'] %} [TOOL_CALLS] {{ m['tool_calls'] | map(attribute='function') | list | tojson }}"
    "{% endif %} </s> {% elif m['role'] == 'tool' %}<|user|> [TOOL_RESULTS] {{ m['content'] }} [/TOOL_RESULTS] </s> "
    "{% else %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}")
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "w40 w41",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}


def _qwen3_template() -> str:
    import vllm
    path = os.path.join(os.path.dirname(vllm.__file__), "transformers_utils", "chat_templates",
                        "template_minicpmv45.jinja")
    if not os.path.exists(path):
        pytest.skip(f"this vLLM ({vllm.__version__}) ships no Qwen3-style template")
    return open(path).read()


def _model_with(tmp_path_factory, name: str, template: str) -> str:
    from transformers import AutoTokenizer
    path = tmp_path_factory.mktemp(name) / "model"
    shutil.copytree(tiny_models.build_tiny_model("llama"), path)
    for extra in ("chat_template.jinja", "chat_template.json"):
        if os.path.exists(path / extra):
            os.unlink(path / extra)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": MARKUP + ["[TOOL_CALLS]", "[TOOL_RESULTS]",
                                                                   "[/TOOL_RESULTS]"]})
    tok.chat_template = template
    tok.save_pretrained(path)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path)
    model.resize_token_embeddings(len(tok))  # the markup tokens get embeddings: the engine runs the prompts
    model.save_pretrained(path)
    config = json.load(open(path / "tokenizer_config.json"))
    config["chat_template"] = template
    json.dump(config, open(path / "tokenizer_config.json", "w"))
    return str(path)


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory):
    return _model_with(tmp_path_factory, "qwen3-template", _qwen3_template())


@pytest.fixture(scope="module")
def calls_after_content_model(tmp_path_factory):
    return _model_with(tmp_path_factory, "calls-after-content", CALLS_AFTER_CONTENT)


THINKING_TRACE = {"conversations": [
    {"role": "system", "content": "w1 w2"},
    {"role": "user", "content": "w3 w4"},
    {"role": "assistant", "reasoning_content": "w5 w6 w7", "content": "w8 w9"},
    {"role": "user", "content": "w10"},
    {"role": "assistant", "reasoning_content": "w11 w12", "content": "w13 w14 w15"}]}
# the tool's keys out of the server's order, and one it drops: the rendering must still be the server's (the tiny
# vocabulary reads JSON as <unk> words, so the dropped key's value is long enough to change their count)
TOOL_TRACE = {"tools": [{"function": {"parameters": WEATHER_TOOL["function"]["parameters"], "name": "get_weather",
                                      "x-owner": "w42 w43 w44 w45 w46"}, "type": "function"}], "conversations": [
    {"role": "user", "content": "w3 w4"},
    {"role": "assistant", "reasoning": "w20 w21", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"w22\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "w23 w24"},
    {"role": "assistant", "reasoning": "w25", "content": "w26 w27"}]}


def _tokens(model: str, record: dict, **kwargs):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    context: set = set()
    chat = inputs.chat_of(record, "line 1")
    ids, mask = inputs.tokenize_conversation(tok, chat, 4096, without_reasoning=context, **kwargs)
    return tok, ids, mask, context


def _masked(tok, ids, mask) -> list[str]:
    return tok.convert_ids_to_tokens([i for i, m in zip(ids, mask) if m])


def test_a_thinking_trace_trains_on_the_last_turn_as_generated_and_keeps_earlier_ones_as_context(qwen3_model):
    """Qwen3's template drops the reasoning of turns before the last user message: those replies are not what the
    model generated (it thought first), so they stay context; the last reply's reasoning and content are masked,
    the <think> markup is not. Before, reasoning never reached the template: no reasoning token was in the mask."""
    tok, ids, mask, context = _tokens(qwen3_model, THINKING_TRACE, check_decoded=True)
    assert _masked(tok, ids, mask) == ["w11", "w12", "w13", "w14", "w15"]
    assert context == {2}
    text = tok.decode(ids)
    assert "<think>" in text and "w5" not in text  # rendered as the server renders the next request


def test_tool_calls_and_their_reasoning_are_in_the_mask_tool_results_are_not(qwen3_model):
    """A call's name and arguments (and what the template puts between them) are in the mask; the <tool_call> markup
    around them stays out, like <think>, as do the tool's result and the headers."""
    tok, ids, mask, context = _tokens(qwen3_model, TOOL_TRACE)
    chat = inputs.chat_of(TOOL_TRACE, "line 1")
    text = chat.render(tok)
    pieces = [(i, kind, text[b:e]) for b, e, i, kind in inputs.assistant_pieces(tok, chat, text)]
    assert pieces == [(1, "reasoning", "w20 w21"), (1, "tool_calls", 'get_weather", "arguments": {"city": "w22"'),
                      (3, "reasoning", "w25"), (3, "content", "w26 w27")]
    # the arguments, parsed from their JSON string, rendered by the template as an object
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "w22"}}\n</tool_call>' in text
    masked = _masked(tok, ids, mask)  # (the JSON's words are unknown to the tiny vocabulary: <unk>)
    assert masked[:2] == ["w20", "w21"] and masked[-3:] == ["w25", "w26", "w27"] and not context
    assert not {"w23", "w24", "<tool_response>", "<tool_call>", "</tool_call>", "<|im_start|>", "<|im_end|>"} & set(
        masked)


def test_a_template_that_renders_the_next_message_by_the_calls_before_it_keeps_that_header_out(tmp_path_factory):
    """DeepSeek-R1's template opens a tool result with another header when the reply before it called tools: a
    rendering without the calls (how their place was found first) differed there too, and the next message's header
    was masked. Calls with other names and arguments keep the template's path."""
    template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|> {{ m['content'] }}"
                "{% for c in m['tool_calls'] or [] %} <tool_call> {{ c['function']['name'] }} "
                "{{ c['function']['arguments'] | tojson }} </tool_call>{% endfor %} </s> "
                "{% set ns_called = m['tool_calls'] %}{% elif m['role'] == 'tool' %}"
                "{% if loop.previtem and loop.previtem['tool_calls'] %}<tool_response> {% else %}<|user|> {% endif %}"
                "{{ m['content'] }} </s> {% else %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endif %}{% endfor %}")
    model = _model_with(tmp_path_factory, "next-header", template)
    record = {"conversations": [{"role": "user", "content": "w1"},
                                {"role": "assistant", "content": "w2", "tool_calls": [
                                    {"type": "function", "function": {"name": "w3", "arguments": {"w4": 5}}}]},
                                {"role": "tool", "content": "w6"}, {"role": "assistant", "content": "w7"}]}
    tok, ids, mask, _ = _tokens(model, record)
    masked = _masked(tok, ids, mask)
    assert masked[:2] == ["w2", "w3"] and masked[-1] == "w7"
    assert not {"<tool_response>", "<tool_call>", "</tool_call>", "</s>", "w6"} & set(masked)


def test_tool_calls_rendered_after_the_content_are_located_too(calls_after_content_model):
    record = {"conversations": [
        {"role": "user", "content": "w3"},
        {"role": "assistant", "content": "w4 w5", "tool_calls": [
            {"type": "function", "function": {"name": "w6", "arguments": {"w7": 1}}}]},
        {"role": "tool", "content": "w8"},
        {"role": "assistant", "content": "w9"}]}
    tok, ids, mask, _ = _tokens(calls_after_content_model, record)
    masked = _masked(tok, ids, mask)
    assert masked[:2] == ["w4", "w5"] and masked[-1] == "w9" and "[TOOL_CALLS]" not in masked
    assert "w8" not in masked and "[TOOL_RESULTS]" not in masked and "<|assistant|>" not in masked


def test_whitespace_pieces_a_conversation_ending_with_a_user_turn_and_list_content_are_taken(qwen3_model):
    """Reasoning of newlines alone (the template trims it to nothing) raised a bare ValueError; a conversation that
    ends with a user turn had its last reply's dropped reasoning taken for a template without reasoning; content as
    a list of text parts (agent traces' tool results) or null is what vLLM's endpoint takes."""
    whitespace = {"conversations": [{"role": "user", "content": "w1"},
                                    {"role": "assistant", "reasoning": "\n\n", "content": "w2"}]}
    tok, ids, mask, _ = _tokens(qwen3_model, whitespace)
    assert _masked(tok, ids, mask) == ["w2"]
    ends_with_user = {"conversations": [{"role": "user", "content": "w1"},
                                        {"role": "assistant", "reasoning": "w2", "content": "w3"},
                                        {"role": "user", "content": "w4"}]}
    tok, ids, mask, context = _tokens(qwen3_model, ends_with_user)
    assert _masked(tok, ids, mask) == [] and context == {1}
    parts = {"conversations": [{"role": "user", "content": [{"type": "text", "text": "w1"},
                                                            {"type": "text", "text": "w5"}]},
                               {"role": "assistant", "content": None, "tool_calls": [
                                   {"type": "function", "function": {"name": "f", "arguments": ""}}]},
                               {"role": "tool", "content": [{"type": "text", "text": "w6"}]},
                               {"role": "assistant", "content": "w7"}]}
    chat = inputs.chat_of(parts, "d:1")
    assert [m["content"] for m in chat.messages] == ["w1\nw5", "", "w6", "w7"]
    assert chat.messages[1]["tool_calls"][0]["function"]["arguments"] == {}


def test_tools_are_given_to_the_template_as_vllms_server_gives_them():
    """The server dumps its request model: name, description, parameters in that order, null where not given,
    other keys dropped (a template rendering `tool | tojson` shows the model that text)."""
    chat = inputs.chat_of({"tools": [{"function": {"parameters": {}, "name": "f", "x": 1}}],
                           "conversations": [{"role": "user", "content": "w1"}]}, "d:1")
    assert json.dumps(chat.tools) == json.dumps(
        [{"type": "function", "function": {"name": "f", "description": None, "parameters": {}}}])


def test_a_template_that_refuses_other_call_names_says_so_with_its_own_error(tmp_path_factory):
    template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}{% for c in m['tool_calls'] or [] %}"
                "{% if c['function']['name'] not in ['w3'] %}{{ raise_exception('unknown tool ' + "
                "c['function']['name']) }}{% endif %} <tool_call> {{ c['function']['name'] }} </tool_call>{% endfor %}"
                " </s> {% endfor %}")
    model = _model_with(tmp_path_factory, "checks-names", template)
    record = {"conversations": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2",
                                                                   "tool_calls": [{"type": "function", "function": {
                                                                       "name": "w3", "arguments": {}}}]}]}
    with pytest.raises(inputs.UncoveredConversation, match=r"assistant message 1: its tool calls cannot be located: "
                                                           r"the chat template refused .*unknown tool QQ"):
        _tokens(model, record)


def test_reasoning_a_template_cannot_render_is_refused_as_uncovered(tmp_path):
    """The tiny model's template renders content only: reasoning would never be shown to such a model."""
    model = tiny_models.build_tiny_model("llama")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    chat = inputs.chat_of({"conversations": [{"role": "user", "content": "w1"},
                                             {"role": "assistant", "content": "w2", "reasoning": "w3"}]}, "d:1")
    with pytest.raises(inputs.UncoveredConversation, match=r"has reasoning \(\"w3\"\), which this model's chat "
                                                          r"template does not render"):
        inputs.tokenize_conversation(tok, chat, 512)


def test_the_data_report_counts_reasoning_tool_call_and_reply_tokens_apart(qwen3_model, tmp_path):
    from transformers import AutoTokenizer

    from eagle_compat.extract import report
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (THINKING_TRACE, TOOL_TRACE, {"input_ids": [5, 6, 7]})))
    tok = AutoTokenizer.from_pretrained(qwen3_model)
    read = inputs.read_dataset(str(data), tok, 4096, check_decoded=True)  # --validate spells every masked piece
    kinds = report.of_samples(read.samples, 4096)["loss_tokens_by_kind"]
    tool_trace_masked = _masked(*_tokens(qwen3_model, TOOL_TRACE)[:3])
    tool_block = len(tool_trace_masked) - 5  # the call's tokens: the masked ones but w20 w21, w25, w26 w27
    assert tool_block > 2
    assert kinds == {"reasoning": 2 + 3, "tool_calls": tool_block, "replies": 3 + 2, "given_as_token_ids": 3}
    assert read.notes["replies_rendered_without_their_reasoning"] == 1
    assert "loss tokens: 5 reasoning, " in report.text(report.of_samples(read.samples, 4096))
    assert any("1 assistant replies carry reasoning that the chat template drops" in line
               for line in inputs.describe_notes(read.notes))


def test_loss_mask_replies_trains_on_the_replies_content_only(qwen3_model):
    tok, ids, mask, _ = _tokens(qwen3_model, TOOL_TRACE, loss_mask="replies")
    assert _masked(tok, ids, mask) == ["w26", "w27"]
    assert _tokens(qwen3_model, TOOL_TRACE)[1] == ids  # the same tokens, another mask


def test_loss_mask_is_an_option_of_extract_recorded_with_the_set():
    from eagle_compat import cli
    from eagle_compat.extract import conversation, writer
    args = cli.build_parser().parse_args(["extract", "--model", "m", "--data", "d", "--out", "o",
                                          "--loss-mask", "replies"])
    assert args.loss_mask == "replies"
    with pytest.raises(InvalidInput, match=r"--loss-mask 'all'; must be one of generated, replies"):
        conversation.check_loss_mask("all", "--loss-mask")
    # a set begun before the option existed was made with today's default; another mask is another set
    assert writer.settings_differences({"max_len": 8}, {"max_len": 8, "loss_mask": "generated"}) == []
    assert writer.settings_differences({"max_len": 8}, {"max_len": 8, "loss_mask": "replies"}) == [
        "loss_mask: was 'generated', now 'replies'"]


@pytest.mark.parametrize("record,match", [
    ({"conversations": [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{city: 1}"}}]}]},
     r"d:1: tool_calls\[0\] \(f\) has arguments that are not JSON"),
    ({"conversations": [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     r"tool_calls\[0\] \(f\) has arguments \[1\]; must be a JSON object"),
    ({"conversations": [{"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}]},
     r"tool_calls\[0\] must be \{\"type\": \"function\""),
    ({"conversations": [{"role": "user", "content": "w1", "reasoning": "w2"}]},
     r"reasoning is an assistant message's string"),
    ({"conversations": [{"role": "user", "content": "w1", "tool_calls": []}, {"role": "assistant", "content": "x",
                                                                             "reasoning": "a",
                                                                             "reasoning_content": "b"}]},
     r"gives both 'reasoning' \(\"a\"\) and 'reasoning_content' \(\"b\"\), which differ"),
    ({"conversations": [{"role": "user", "content": "w1"}], "chat_template_kwargs": {"tokenize": True}},
     r"chat_template_kwargs cannot set tokenize"),
    ({"conversations": [{"role": "user", "content": "w1"}], "tools": {"name": "f"}},
     r"tools must be a list of tool objects"),
    ({"conversations": [{"role": "user", "content": "w1"}], "tools": [{"name": "f"}]},
     r"each of tools must be \{\"type\": \"function\""),
    ({"conversations": [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[" * 100000}}]}]},
     r"tool_calls\[0\] \(f\) has arguments that are not JSON"),
    ({"conversations": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     r"text content \(a JSON string, null, or a list of"),
])
def test_bad_reasoning_tool_calls_and_template_keywords_are_refused_naming_the_line(record, match):
    with pytest.raises(InvalidInput, match=match):
        inputs.chat_of(record, "d:1")


def _as_the_server_gives(tools):
    """The tools of a request as vLLM's chat server hands them to its renderer: its own request model, dumped."""
    if tools is None:
        return None
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam
    return [ChatCompletionToolsParam(**t).model_dump() for t in tools]


@pytest.mark.engine
@helpers.in_newest_pass_only("vLLM's own chat rendering, compared once on the newest release")
def test_token_ids_equal_vllms_own_chat_rendering(qwen3_model, calls_after_content_model):
    """The same request through vLLM's `LLM.chat` (the chat endpoint's renderer): the same prompt token ids, for a
    thinking trace, a tool-calling trace with its tools, chat_template_kwargs, and tool calls after the content."""
    from vllm import LLM, SamplingParams
    from transformers import AutoTokenizer

    kwargs_trace = {**THINKING_TRACE, "chat_template_kwargs": {"enable_thinking": False}}
    calls_after = {"conversations": [{"role": "user", "content": "w3"},
                                     {"role": "assistant", "content": "w4", "tool_calls": [
                                         {"type": "function", "function": {"name": "w6", "arguments": "{\"w7\": 1}"}}]},
                                     {"role": "tool", "content": "w8"}, {"role": "assistant", "content": "w9"}]}
    # one engine (both folders hold the same vocabulary and markup tokens): the second template given per request
    llm = LLM(qwen3_model, max_model_len=512, enforce_eager=True, dtype="float32", seed=0)
    cases = [(qwen3_model, THINKING_TRACE), (qwen3_model, TOOL_TRACE), (qwen3_model, kwargs_trace),
             (calls_after_content_model, calls_after)]
    for model, record in cases:
        tok = AutoTokenizer.from_pretrained(model)
        chat = inputs.chat_of(record, "line 1")
        ids, _ = inputs.tokenize_conversation(tok, chat, 4096)
        # the request as a client sends it to vLLM 0.32: `reasoning` (its endpoint no longer reads a request's
        # `reasoning_content`; a line may spell it either way)
        raw = [{("reasoning" if k == "reasoning_content" else k): v for k, v in m.items()}
               for m in record["conversations"]]
        out = llm.chat(raw, SamplingParams(max_tokens=1), tools=_as_the_server_gives(record.get("tools")),
                       chat_template=None if model == qwen3_model else tok.chat_template,
                       chat_template_kwargs=record.get("chat_template_kwargs"), add_generation_prompt=False,
                       use_tqdm=False)[0]
        assert list(out.prompt_token_ids) == ids, tok.decode(ids)
