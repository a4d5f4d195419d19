"""The tool-call parsers (issue #17 item 3) on fixed texts: Hermes/Qwen 2.5 `<tool_call>` blocks,
Llama 3 JSON, and the JSON array that tool_choice required/named constrains to. Streamed in
every split (one character at a time, random chunks) they give the same calls and content as
the whole text parsed at once, and the argument fragments join into the model's own JSON text."""

from __future__ import annotations

import json
import random

import pytest
from workbench.core.function_call.parser import FunctionCallParser

WEATHER = '{"city": "Paris", "unit": "celsius", "note": "a } and a \\" inside"}'
HERMES = (
    "Let me check.\n<tool_call>\n"
    f'{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)
LLAMA3 = f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}; {{"name": "get_time", "parameters": {{}}}}'
ARRAY = f'[{{"name": "get_weather", "parameters": {WEATHER}}}, {{"name": "get_time", "parameters": {{"tz": "CET"}}}}]'


def _stream(parser: str, text: str, cuts: list[int], names=None):
    p = FunctionCallParser(parser, names)
    content, calls = "", {}
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    for piece in pieces:
        c, ds = p.feed(piece)
        content += c
        for d in ds:
            calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id is not None:
                assert calls[d.index]["id"] is None, "a call's header came twice"
                calls[d.index].update(id=d.id, name=d.name)
            calls[d.index]["arguments"] += d.arguments
    c, ds = p.finish()
    content += c
    for d in ds:
        calls.setdefault(d.index, {"id": d.id, "name": d.name, "arguments": ""})
        calls[d.index]["arguments"] += d.arguments
    return content, [calls[i] for i in sorted(calls)], p.calls


def _splits(text: str, seed: int):
    rng = random.Random(seed)
    yield list(range(1, len(text)))  # one character at a time
    for _ in range(20):
        yield sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))


@pytest.mark.parametrize(
    "parser,text,content",
    [
        ("hermes", HERMES, "Let me check.\n\n"),
        ("qwen25", HERMES, "Let me check.\n\n"),
        ("llama3", LLAMA3, ""),
        ("json_array", ARRAY, ""),
    ],
)
def test_streamed_in_any_split_equals_parsed_whole(parser, text, content):
    whole_content, whole = FunctionCallParser(parser).parse(text)
    assert whole_content == content
    assert [c.name for c in whole] == ["get_weather", "get_time"]
    assert json.loads(whole[0].arguments) == json.loads(WEATHER)
    assert whole[0].arguments == WEATHER  # the model's own text, not re-serialised
    assert len({c.id for c in whole}) == 2
    for cuts in _splits(text, seed=len(text)):
        got_content, deltas, calls = _stream(parser, text, cuts)
        assert got_content == content, cuts
        assert [(d["name"], d["arguments"]) for d in deltas] == [(c.name, c.arguments) for c in whole], cuts
        assert [d["id"] for d in deltas] == [c.id for c in calls]


def test_plain_text_stays_content_and_look_alikes_are_not_held_forever():
    for parser in ("hermes", "llama3", "json_array"):
        text = "The weather is nice < today > and {braces} too."
        assert FunctionCallParser(parser).parse(text) == (text, [])
    # a partial marker at the end of a streamed chunk is held back, then released
    p = FunctionCallParser("hermes")
    assert p.feed("a <tool") == ("a ", [])
    assert p.feed("box> b") == ("<toolbox> b", [])
    assert p.finish() == ("", [])


def test_calls_whose_keys_come_in_another_order_or_name_unknown_tools():
    text = '<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>'
    content, calls = FunctionCallParser("hermes").parse(text)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1})]
    # a call to a tool the request did not offer is left as content
    bad = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    assert FunctionCallParser("hermes", {"f"}).parse(bad) == (bad, [])
    # an unparseable block is content too, and an unterminated call is flushed at the end
    junk = "<tool_call>\nnot json\n</tool_call>"
    assert FunctionCallParser("hermes").parse(junk) == (junk, [])
    content, calls = FunctionCallParser("hermes").parse('<tool_call>{"name": "f", "arguments": {"x": 1}}')
    assert content == "" and calls[0].arguments == '{"x": 1}'


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="hermes, qwen25, llama3, json_array"):
        FunctionCallParser("mistral")


def _one_entry_per_index(deltas) -> None:
    """Issue #43 item 3: a streamed chunk carries at most one entry per call index; the first
    entry of a call carries its id and name, later ones only argument text."""
    indexes = [d.index for d in deltas]
    assert len(indexes) == len(set(indexes)), f"one chunk repeats an index: {[d.to_openai() for d in deltas]}"


@pytest.mark.parametrize(
    "parser,text",
    [("hermes", HERMES), ("qwen25", HERMES), ("llama3", LLAMA3), ("json_array", ARRAY)],
)
def test_each_chunk_carries_at_most_one_entry_per_index(parser, text):
    for cuts in _splits(text, seed=7):
        p = FunctionCallParser(parser)
        seen: set[int] = set()
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        for piece in pieces:
            _, ds = p.feed(piece)
            _one_entry_per_index(ds)
            for d in ds:
                entry = d.to_openai()
                if d.index not in seen:  # the call's first entry: id, type and name
                    assert entry["id"].startswith("call_") and entry["type"] == "function", entry
                    assert entry["function"]["name"], entry
                    seen.add(d.index)
                else:  # later entries: argument text only
                    assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}, entry
        _one_entry_per_index(p.finish()[1])
    # the chunk that first names a call and starts its arguments (what instructor's
    # create_partial choked on): one entry holding both
    p = FunctionCallParser("hermes")
    _, ds = p.feed('<tool_call>\n{"name": "get_time", "arguments": {"')
    assert [d.to_openai() for d in ds] == [
        {"index": 0, "id": ds[0].id, "type": "function", "function": {"name": "get_time", "arguments": '{"'}}
    ]


def test_a_forced_call_cut_off_by_max_tokens_is_never_a_call():
    """Issue #43 item 4: tool_choice required/named output (json_array) cut off anywhere. Only
    calls whose arguments are complete JSON are calls, streamed or not (a streamed call goes out
    whole, once complete: it could not be taken back); the cut-off call's text is content."""
    first_end = ARRAY.index("}}, ") + 2  # just after the first call's object
    for cut in range(1, len(ARRAY)):
        text = ARRAY[:cut]
        content, calls = FunctionCallParser("json_array").parse(text)
        for c in calls:
            json.loads(c.arguments)  # never a truncated call
        args_end = ARRAY.index(WEATHER) + len(WEATHER)
        args_end2 = ARRAY.index('{"tz": "CET"}') + len('{"tz": "CET"}')
        assert len(calls) == (0 if cut < args_end else 1 if cut < args_end2 else 2), (cut, calls)
        if cut > args_end and cut < first_end:
            assert content == "", (cut, content)  # only the closing brace was missing
        tail = ARRAY[first_end + 2 : cut] if cut > first_end + 2 else ""
        if calls and tail and not tail.endswith("}"):
            assert content == tail, (cut, content)  # the cut-off second call, as text
        # streamed one character at a time: the same calls, each in one entry, and nothing else
        p = FunctionCallParser("json_array")
        streamed, got = "", []
        for ch in text:
            c, ds = p.feed(ch)
            streamed += c
            got += ds
        c, ds = p.finish()
        streamed, got = streamed + c, got + ds
        assert streamed == content, cut
        assert [(d.id, d.name, d.arguments) for d in got] == [(c.id, c.name, c.arguments) for c in p.calls], cut
