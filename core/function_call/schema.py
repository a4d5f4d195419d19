"""What a chat request with `tools` asks of the model: the grammar that enforces `tool_choice`
required or a named function, and the prompt that tells a model about its tools when its chat
template has no place for them."""

from __future__ import annotations

import json
from typing import Any


def tool_names(tools: list[dict]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def _call_schema(tool: dict) -> dict:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [fn["name"]]}, "parameters": params},
        "required": ["name", "parameters"],
    }


def forced_call_schema(tools: list[dict], tool_choice: Any, parallel: bool = True) -> str | None:
    """The JSON Schema (as text) that makes the output a JSON array of calls, for `required` (one
    or more calls to any of the tools: with `parallel`, at most as many as there are tools, else
    exactly one) or a named function (exactly one call to it); None for `auto`, `none` or no
    choice. The output is then read by the `json_array` parser.

    The bound on parallel calls is what ends the array: without one, a model that keeps repeating
    its call (small ones do) runs into max_tokens with a call cut off in the middle."""
    if tool_choice == "required":
        chosen, most = tools, len(tools) if parallel else 1
    elif isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        chosen, most = [t for t in tools if t["function"]["name"] == name], 1
    else:
        return None
    items = _call_schema(chosen[0]) if len(chosen) == 1 else {"anyOf": [_call_schema(t) for t in chosen]}
    schema: dict = {"type": "array", "items": items, "minItems": 1}
    if most is not None:
        schema["maxItems"] = most
    return json.dumps(schema)


def hermes_system_prompt(tools: list[dict]) -> str:
    """The tool list in the Hermes / Qwen 2.5 style, for a chat template that ignores `tools`:
    the model is told the functions and the `<tool_call>` format the hermes parser reads."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def llama3_system_prompt(tools: list[dict]) -> str:
    """The tool list in the Llama 3 JSON style, for a chat template that ignores `tools`."""
    lines = "\n\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You have access to the following functions. To call a function, respond with only a JSON "
        'object of the form {"name": function name, "parameters": dictionary of argument name and '
        "its value}. Do not use variables.\n\n" + lines
    )
