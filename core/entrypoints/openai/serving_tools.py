"""Tool calls on /v1/chat/completions: checking `tools` and `tool_choice`, rendering the tool
list and earlier calls into the prompt, and reading calls back out of the output.

  tool_choice  none      the tools are left out of the prompt; the output is plain content.
               auto      (the default with tools) the tools go into the prompt and the output is
                         read with the server's `--tool-call-parser` (hermes / qwen25 / llama3).
               required  the output is constrained by a grammar (core/function_call/schema.py) to a
               {named}   JSON array of one or more calls (named, or parallel_tool_calls false:
                         exactly one), read with the json_array parser. The model cannot answer
                         otherwise.

A chat template that renders `tools` (Qwen 2.5, Llama 3.1, Hermes) gets them, and earlier calls
and tool results, natively. One that does not (the default SmolLM2) gets the tool list as a
system message in the parser's own format, earlier calls written in that format, and tool results
as `<tool_response>` user turns, so any chat model can be offered tools.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from workbench.core.constrained.grammar_check import check_grammar
from workbench.core.entrypoints.errors import bad_request
from workbench.core.entrypoints.openai.protocol import ChatCompletionRequest
from workbench.core.function_call.parser import FunctionCallParser
from workbench.core.function_call.schema import (
    forced_call_schema,
    hermes_system_prompt,
    llama3_system_prompt,
    tool_names,
)


@dataclass
class ToolPlan:
    """What a request's tools mean for this request."""

    tools: list[dict]
    parser: str  # the parser that reads the output: --tool-call-parser, or json_array when forced
    forced_schema: str | None = None  # required / named: the grammar of the output

    def new_parser(self) -> FunctionCallParser:
        return FunctionCallParser(self.parser, set(tool_names(self.tools)))


def plan_tools(req: ChatCompletionRequest, default_parser: str) -> ToolPlan | None:
    """Check `tools` and `tool_choice` (400s naming what is wrong); None when the request has no
    tools to offer (none given, or tool_choice none)."""
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise bad_request(f"tool_choice {choice!r}: one of none, auto, required, or a named function", "tool_choice")
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request('a named tool_choice is {"type": "function", "function": {"name": ...}}', "tool_choice")
    if not req.tools:
        if choice not in ("none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    for i, t in enumerate(req.tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(
                'each tool is {"type": "function", "function": {"name", "description", "parameters"}}',
                f"tools.{i}",
            )
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request("a function's parameters are a JSON Schema object", f"tools.{i}.function.parameters")
    if choice == "none":
        return None
    names = tool_names(req.tools)
    _check_parameters(req.tools, choice)
    if isinstance(choice, dict) and choice["function"]["name"] not in names:
        raise bad_request(
            f"tool_choice names {choice['function']['name']!r}, which is not in tools ({', '.join(names)})",
            "tool_choice",
        )
    forced = forced_call_schema(req.tools, choice, parallel=req.parallel_tool_calls is not False)
    if forced is not None and (req.response_format or req.json_schema or req.regex or req.ebnf):
        raise bad_request(
            "tool_choice required or named constrains the output already: drop response_format/json_schema/regex/ebnf",
            "tool_choice",
        )
    return ToolPlan(tools=list(req.tools), parser="json_array" if forced else default_parser, forced_schema=forced)


def _check_parameters(tools: list[dict], choice: Any) -> None:
    """A 400 for a tool whose parameters no arguments can satisfy ({"$ref": "#"}, a $ref cycle) or
    xgrammar cannot read, before any decoding: the tools the grammar enforces (required: all of
    them; named: that one) and every tool marked `strict`."""
    forced = None if choice == "auto" else "*" if choice == "required" else choice["function"]["name"]
    for i, t in enumerate(tools):
        fn = t["function"]
        if fn.get("parameters") is None or not (forced in ("*", fn["name"]) or fn.get("strict") is True):
            continue
        try:
            check_grammar("json_schema", json.dumps(fn["parameters"]))
        except ValueError as e:
            raise bad_request(
                f"tool {fn['name']!r}: its parameters are not a usable JSON Schema: {e}",
                f"tools.{i}.function.parameters",
            ) from None


def render_tool_messages(
    messages: list[dict], plan: ToolPlan | None, native: bool, parser: str
) -> tuple[list[dict], list[dict] | None]:
    """Chat messages (with `tool_calls` / tool turns) -> (messages for the template, `tools` for
    a template that renders them). `native`: the template renders tools itself."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m["role"] == "assistant" and calls:
            if native:  # templates read arguments as a mapping (`| tojson`)
                m = dict(m, tool_calls=[_native_call(c) for c in calls])
            else:
                m = {"role": "assistant", "content": _written_calls(m.get("content") or "", calls, parser)}
        elif m["role"] == "tool" and not native:
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if plan is None:
        return out, None
    if native:
        return out, plan.tools
    prompt = llama3_system_prompt(plan.tools) if parser == "llama3" else hermes_system_prompt(plan.tools)
    if out and out[0]["role"] == "system":
        out[0] = dict(out[0], content=out[0]["content"] + "\n\n" + prompt)
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _native_call(call: dict) -> dict:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass  # left as the text the client sent
    return {"type": "function", "id": call.get("id"), "function": {"name": fn.get("name"), "arguments": args}}


def _written_calls(content: str, calls: list[dict], parser: str) -> str:
    """Earlier calls written as the model would have written them (for templates without tools)."""
    parts = [content] if content else []
    objs = []
    for c in calls:
        fn = c.get("function") or {}
        args: Any = fn.get("arguments") or "{}"
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        objs.append((fn.get("name"), args))
    if parser == "llama3":
        parts.append("; ".join(json.dumps({"name": n, "parameters": a}) for n, a in objs))
    else:
        parts += [f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in objs]
    return "\n".join(parts)
