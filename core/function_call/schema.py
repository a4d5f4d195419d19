"""What a chat request with `tools` asks of the model: the grammar that enforces `tool_choice`
required or a named function, and the prompt that tells a model about its tools when its chat
template has no place for them."""

from __future__ import annotations

import json
from typing import Any


def tool_names(tools: list[dict]) -> list[str]:
    return [t["function"]["name"] for t in tools]


# Keys whose values are data, not schemas: a {"$ref": ...} there is a value to match, not a reference.
_DATA_KEYS = frozenset(("enum", "const", "default", "examples"))


def _has_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return any(
            (k == "$ref" and isinstance(v, str)) or (k not in _DATA_KEYS and _has_ref(v)) for k, v in node.items()
        )
    return isinstance(node, list) and any(_has_ref(v) for v in node)


def _rebase_refs(node: Any, base: str) -> Any:
    """A copy of a schema whose local references ("#", "#/$defs/x") point into `base` (a JSON
    pointer such as "#/$defs/tool_0_parameters") instead of the document's root."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str) and v.startswith("#"):
                out[k] = base + v[1:]
            elif k in _DATA_KEYS:
                out[k] = v
            else:
                out[k] = _rebase_refs(v, base)
        return out
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    return node


def _call_schema(tool: dict, index: int, defs: dict) -> dict:
    """One call's schema. Parameters with local references ("#" is the parameters' own root,
    "#/$defs/x" their own $defs) move into the array schema's `$defs`, their references rebased,
    so they mean there what they meant in the tool."""
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    if _has_ref(params):
        key = f"tool_{index}_parameters"
        defs[key] = _rebase_refs(params, f"#/$defs/{key}")
        params = {"$ref": f"#/$defs/{key}"}
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
    defs: dict = {}
    calls = [_call_schema(t, i, defs) for i, t in enumerate(chosen)]
    schema: dict = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    if most is not None:
        schema["maxItems"] = most
    if defs:
        schema["$defs"] = defs
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
