"""Tool calls on /v1/chat/completions (issue #17 item 3), through the official openai client on
a real server over the default model:

- auto: the Hermes `<tool_call>` format read from the output, streamed and not, the same calls
  either way (the output is steered into that format with an EBNF grammar: SmolLM2-135M was
  never trained to call tools, and the point here is the parser on real generated text);
- required and a named function: the grammar makes the output calls, whose arguments validate
  against the tool's parameters; streamed as OpenAI's deltas;
- none, a history with assistant tool_calls and tool results, and bad tools as 400s;
- the Llama 3 JSON format with `--tool-call-parser llama3`."""

from __future__ import annotations

import json

import pytest
from pipeline_helpers import assert_no_kv_leak, served_engine

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar", reason="tool_choice required/named needs xgrammar (the test tier installs it)")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Steers the output into one Hermes tool call with text before it (auto mode's input).
HERMES_EBNF = (
    'root ::= "Checking.\\n<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": '
    '{\\"city\\": \\"" [A-Za-z]{1,8} "\\", \\"unit\\": \\"celsius\\"}}\\n</tool_call>"'
)
LLAMA3_EBNF = 'root ::= "{\\"name\\": \\"get_time\\", \\"parameters\\": {\\"tz\\": \\"" ("UTC" | "CET") "\\"}}"'


@pytest.fixture(scope="module")
def served(served_16k):
    return served_16k  # tests/conftest.py: the same engine serves tests/e2e/test_structured_outputs.py


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _streamed(client, **kw):
    """(content, [(id, name, arguments)], finish_reason) from a stream, joined as clients do.
    Checks the streaming contract on the way (issue #43 item 3): a chunk carries at most one
    entry per call index; a call's first entry carries its id, type and name, later ones only
    argument text."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(model="smollm2-135m", stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        entries = ch.delta.tool_calls or []
        assert len({d.index for d in entries}) == len(entries), f"a chunk repeats an index: {entries}"
        for d in entries:
            slot = calls.get(d.index)
            if slot is None:
                assert d.id and d.type == "function" and d.function.name, f"a call's first entry lacks its header: {d}"
                slot = calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and d.type is None and d.function.name is None, (
                    f"a later entry repeats the header: {d}"
                )
            slot["arguments"] += d.function.arguments or ""
        reason = ch.finish_reason or reason
    return content, [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())], reason


def test_auto_reads_hermes_calls_streamed_and_not(served):
    engine, url = served
    client = _client(url)
    kw = dict(messages=ASK, tools=TOOLS, temperature=0, max_tokens=60, extra_body={"ebnf": HERMES_EBNF})
    out = client.chat.completions.create(model="smollm2-135m", **kw)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Checking.\n"
    (call,) = msg.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    content, calls, reason = _streamed(client, **kw)
    assert (content, reason) == ("Checking.\n", "tool_calls")
    assert [(n, a) for _, n, a in calls] == [("get_weather", call.function.arguments)]
    assert_no_kv_leak(engine)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_choice_are_enforced_by_the_grammar(served, choice):
    engine, url = served
    client = _client(url)
    kw = dict(messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=120, parallel_tool_calls=False)
    for seed in (1, 2, 3):
        out = client.chat.completions.create(model="smollm2-135m", temperature=0.8, seed=seed, **kw)
        c = out.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        assert c.message.tool_calls, c
        assert len(c.message.tool_calls) == 1
        if isinstance(choice, dict):
            assert c.message.tool_calls[0].function.name == "get_time"
        for t in c.message.tool_calls:
            tool = {x["function"]["name"]: x for x in TOOLS}[t.function.name]
            jsonschema.validate(json.loads(t.function.arguments), tool["function"]["parameters"])
    content, calls, reason = _streamed(client, temperature=0, **kw)
    assert content == "" and reason == "tool_calls" and len(calls) == 1
    # parallel calls allowed (OpenAI's default): the grammar allows one call per tool (issue #43
    # item 4), so even a model that keeps repeating its call stops there, well before max_tokens
    kw["parallel_tool_calls"] = True
    kw["max_tokens"] = 400
    for seed in (1, 2):
        out = client.chat.completions.create(model="smollm2-135m", temperature=0.8, seed=seed, **kw)
        c = out.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        assert 1 <= len(c.message.tool_calls) <= (len(TOOLS) if choice == "required" else 1), c
        for t in c.message.tool_calls:
            tool = {x["function"]["name"]: x for x in TOOLS}[t.function.name]
            jsonschema.validate(json.loads(t.function.arguments), tool["function"]["parameters"])
    assert_no_kv_leak(engine)


def test_a_forced_call_cut_off_by_max_tokens_is_content_not_a_call(served):
    """Issue #43 item 4: max_tokens ends the output inside a call's arguments. That call is not
    returned as a call (LangChain made `multiply({})` of one): finish_reason stays "length" and
    its text is the content, streamed or not; calls that were complete before it still count."""
    engine, url = served
    client = _client(url)
    kw = dict(messages=ASK, tools=TOOLS, tool_choice="required", temperature=0)
    for max_tokens in (10, 14):  # inside the first call's arguments
        out = client.chat.completions.create(model="smollm2-135m", max_tokens=max_tokens, **kw)
        c = out.choices[0]
        assert c.finish_reason == "length", c
        assert not c.message.tool_calls, c
        assert c.message.content and c.message.content.lstrip().startswith('{"name"'), c
        with pytest.raises(ValueError):
            json.loads(c.message.content)
        content, calls, reason = _streamed(client, max_tokens=max_tokens, **kw)
        assert (content, calls, reason) == (c.message.content, [], "length")
    # the whole range of cut-off points: whatever is returned as a call has complete arguments
    for max_tokens in range(16, 60, 6):
        out = client.chat.completions.create(model="smollm2-135m", max_tokens=max_tokens, **kw)
        c = out.choices[0]
        for t in c.message.tool_calls or []:
            tool = {x["function"]["name"]: x for x in TOOLS}[t.function.name]
            jsonschema.validate(json.loads(t.function.arguments), tool["function"]["parameters"])
        if c.finish_reason == "tool_calls":
            assert c.message.content is None and c.message.tool_calls
    assert_no_kv_leak(engine)


def test_none_history_and_bad_tools(served):
    engine, url = served
    client = _client(url)
    plain = client.chat.completions.create(
        model="smollm2-135m", messages=ASK, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8
    )
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    after = client.chat.completions.create(
        model="smollm2-135m", messages=history, tools=TOOLS, temperature=0, max_tokens=8
    )
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")
    for bad, words in (
        (dict(tools=[{"type": "function", "function": {}}]), "each tool is"),
        (dict(tools=TOOLS, tool_choice="sometimes"), "one of none, auto, required"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "not in tools"),
        (dict(tool_choice="required"), "tool_choice needs tools"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "constrains"),
    ):
        with pytest.raises(openai.BadRequestError, match=words):
            client.chat.completions.create(model="smollm2-135m", messages=ASK, max_tokens=4, **bad)
    assert_no_kv_leak(engine)


def test_llama3_parser_reads_json_calls():
    with served_engine(max_total_tokens=8192, tool_call_parser="llama3") as (engine, url):
        client = _client(url)
        kw = dict(messages=ASK, tools=TOOLS, temperature=0, max_tokens=40, extra_body={"ebnf": LLAMA3_EBNF})
        out = client.chat.completions.create(model="smollm2-135m", **kw)
        c = out.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.function.name == "get_time" and json.loads(call.function.arguments)["tz"] in ("UTC", "CET")
        content, calls, reason = _streamed(client, **kw)
        assert (content, reason) == ("", "tool_calls")
        assert [(n, a) for _, n, a in calls] == [("get_time", call.function.arguments)]
        assert_no_kv_leak(engine)
