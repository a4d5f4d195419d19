"""Tool requests without a server (issue #17 item 3): tool_choice checks, the forced-call grammar,
and how tools and tool history reach the prompt, natively (a template that renders `tools`, in
the style of Qwen 2.5's) or through the system-message fallback (SmolLM2's template)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from workbench.core.entrypoints.errors import APIError
from workbench.core.entrypoints.openai.protocol import ChatCompletionRequest
from workbench.core.entrypoints.openai.serving_chat import chat_messages
from workbench.core.entrypoints.openai.serving_tools import plan_tools, render_tool_messages

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
]
# A tools-aware template in the shape of Qwen 2.5's: tools in the system turn, calls as
# <tool_call> JSON with arguments rendered by `tojson` (a mapping), results as <tool_response>.
QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endif %}{% endfor %}<|im_start|>assistant\n"
)


def _req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=kw.pop("messages", HISTORY), **kw)


def test_choices_and_the_forced_grammar():
    assert plan_tools(_req(), "hermes") is None  # no tools
    assert plan_tools(_req(tools=[TOOL], tool_choice="none"), "hermes") is None
    auto = plan_tools(_req(tools=[TOOL]), "llama3")
    assert (auto.parser, auto.forced_schema) == ("llama3", None)
    forced = plan_tools(_req(tools=[TOOL], tool_choice="required", parallel_tool_calls=False), "hermes")
    schema = json.loads(forced.forced_schema)
    assert forced.parser == "json_array" and schema["maxItems"] == 1
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "other", "parameters": {}}], schema)
    # parallel calls allowed (OpenAI's default): still a bound, one call per tool, so a model that
    # repeats its call stops there instead of at max_tokens (issue #43 item 4)
    for tools in ([TOOL], [TOOL, dict(TOOL, function=dict(TOOL["function"], name="get_time"))]):
        parallel = json.loads(plan_tools(_req(tools=tools, tool_choice="required"), "hermes").forced_schema)
        assert (parallel["minItems"], parallel["maxItems"]) == (1, len(tools))
    for bad, words in (
        ({"tools": [TOOL], "tool_choice": "always"}, "one of none, auto, required"),
        ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "a named tool_choice"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "each tool is"),
        ({"tools": [TOOL], "tool_choice": "required", "regex": "a"}, "constrains the output already"),
    ):
        with pytest.raises(APIError, match=words):
            plan_tools(_req(**bad), "hermes")


def test_a_template_that_renders_tools_gets_them_natively(tokenizer):
    req = _req(tools=[TOOL])
    messages, tools = render_tool_messages(chat_messages(req), plan_tools(req, "qwen25"), True, "qwen25")
    assert tools == [TOOL]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # a mapping for tojson
    text = tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=QWEN_LIKE, tokenize=False, add_generation_prompt=True
    )
    assert '"name": "get_weather"' in text.split("</tools>")[0]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<tool_response>21 C</tool_response>" in text


def test_a_template_without_tools_gets_a_system_message_in_the_parsers_format(tokenizer):
    req = _req(tools=[TOOL])
    for parser, call in (
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
        ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    ):
        messages, tools = render_tool_messages(chat_messages(req), plan_tools(req, parser), False, parser)
        assert tools is None and messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
        assert messages[2] == {"role": "assistant", "content": call}
        assert messages[3] == {"role": "user", "content": "<tool_response>\n21 C\n</tool_response>"}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert "You are a helpful AI assistant named SmolLM" not in text  # our system turn replaced the default
    # tool_choice none: no tool list, but the history still renders
    req = _req(tools=[TOOL], tool_choice="none")
    messages, tools = render_tool_messages(chat_messages(req), plan_tools(req, "hermes"), False, "hermes")
    assert tools is None and messages[0]["role"] == "user" and "<tool_call>" in messages[1]["content"]


def test_tool_parameters_with_refs_keep_their_meaning_and_impossible_ones_are_a_400():
    """Issue #43 item 8: a tool's parameters with local references ($defs, "#") under a forced
    choice, and parameters no arguments satisfy, refused before any decoding."""
    pytest.importorskip("xgrammar", reason="tool_choice required/named needs xgrammar (the test tier installs it)")
    from workbench.core.constrained.grammar_check import check_grammar

    tree = {
        "type": "object",
        "properties": {
            "label": {"type": "string", "maxLength": 5},
            "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
            "at": {"$ref": "#/$defs/point"},
        },
        "required": ["label", "at"],
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
    }
    tools = [TOOL, {"type": "function", "function": {"name": "plant", "parameters": tree}}]
    schema = json.loads(plan_tools(_req(tools=tools, tool_choice="required"), "hermes").forced_schema)
    check_grammar("json_schema", json.dumps(schema))  # xgrammar resolves every reference
    call = {"name": "plant", "parameters": {"label": "a", "at": {"x": 1}, "children": [{"label": "b", "at": {"x": 2}}]}}
    jsonschema.validate([call], schema)
    with pytest.raises(jsonschema.ValidationError):  # "#" still means the parameters, not the array
        jsonschema.validate([dict(call, parameters={"label": "a", "at": {"x": 1}, "children": [[call]]})], schema)
    loop = {"type": "function", "function": {"name": "loop", "strict": True, "parameters": {"$ref": "#"}}}
    for kw in (
        dict(tools=[TOOL, loop], tool_choice="required"),
        dict(tools=[TOOL, loop], tool_choice={"type": "function", "function": {"name": "loop"}}),
        dict(tools=[TOOL, loop]),  # auto: a strict tool is checked too
    ):
        with pytest.raises(APIError, match="admits no finite value") as e:
            plan_tools(_req(**kw), "hermes")
        assert (e.value.status, e.value.param) == (400, "tools.1.function.parameters")
    # a non-strict tool the grammar does not enforce is only text in the prompt: not refused
    lax = {"type": "function", "function": {"name": "loop", "parameters": {"$ref": "#"}}}
    assert plan_tools(_req(tools=[TOOL, lax]), "hermes") is not None
