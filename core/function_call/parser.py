"""Tool calls in generated text: one incremental parser per choice, named like SGLang's
`--tool-call-parser` values.

Formats (what the model writes):
  hermes, qwen25  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, any number of
                  blocks; text outside the blocks is the message's content.
  llama3          `{"name": "f", "parameters": {...}}` as the whole message (optionally after
                  `<|python_tag|>`), several separated by `;`. A message that does not start with
                  `{` is plain content.
  json_array      `[{"name": "f", "parameters": {...}}, ...]`: what `tool_choice` required or a
                  named function constrains the output to (core/function_call/schema.py).

The parser is fed the decoded text as it grows (`feed(delta)`) and answers the content delta and
the tool-call deltas in OpenAI's streaming shape, at most one entry per call index in each answer
(`merge_deltas`): a call's first entry carries its index, id and name, and the start of its
arguments' JSON text when that is there already; later ones carry further fragments, which join
into exactly the text the model wrote. `finish()` flushes what is left. A non-streamed answer is
the same parser fed all at once, so the two always agree.

Forced calls (json_array: tool_choice required or named) are held back until their arguments are
complete JSON, then go out as one entry each: the output can be cut off by max_tokens inside a
call, and a call already streamed could not be taken back. A call cut off that way is never a
call: its text is returned as content (finish_reason stays "length").

A call is recognised when its object starts with the `name` key; one whose keys come in another
order is parsed whole at its end. A block that does not parse as a call is returned as content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

TOOL_CALL_PARSERS = ("hermes", "qwen25", "llama3", "json_array")
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCallDelta:
    """One streamed piece of a tool call (OpenAI's `delta.tool_calls[i]`)."""

    index: int
    id: str | None = None  # the first delta of a call only
    name: str | None = None  # the first delta of a call only
    arguments: str = ""

    def to_openai(self) -> dict:
        out: dict = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})
        else:
            out["function"] = {"arguments": self.arguments}
        return out


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def merge_deltas(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """One entry per call index (in the order the indexes first appear): a streamed chunk must not
    repeat an index, as clients that read `tool_calls[i]` as a whole entry (instructor's partial
    extraction) otherwise see the header and the first argument fragment as two calls."""
    merged: dict[int, ToolCallDelta] = {}
    for d in deltas:
        got = merged.get(d.index)
        if got is None:
            merged[d.index] = ToolCallDelta(d.index, d.id, d.name, d.arguments)
            continue
        if got.id is None and d.id is not None:
            got.id, got.name = d.id, d.name
        got.arguments += d.arguments
    return list(merged.values())


def _value_end(text: str) -> int | None:
    """Where the JSON value at the start of `text` ends (index after it), or None while it is
    still open. Only objects and arrays are tracked (arguments are objects)."""
    depth, in_str, esc = 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and not ch.isspace():
            return None  # not an object: wait for the whole call
    return None


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class _Call:
    index: int
    text: str = ""  # the call's JSON text so far
    id: str = field(default_factory=_new_id)
    name: str | None = None  # set once its first delta went out
    args_start: int = -1  # where the arguments value starts in `text`
    args_sent: int = 0  # characters of the arguments already streamed
    args_done: bool = False
    held: list[ToolCallDelta] = field(default_factory=list)  # forced calls: out once complete


class FunctionCallParser:
    """Incremental tool-call parser for one choice (see the module docstring)."""

    def __init__(self, parser: str, tool_names: set[str] | None = None):
        if parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown tool call parser {parser!r}; one of {', '.join(TOOL_CALL_PARSERS)}")
        self.parser = parser
        self.tool_names = tool_names
        self._whole = parser in ("llama3", "json_array")  # calls fill the whole message
        self._hold = parser == "json_array"  # forced calls go out only once their arguments are complete
        self._start, self._end = ("<tool_call>", "</tool_call>") if not self._whole else ("", "")
        self._buf = ""  # text not yet classified
        self._mode = "start" if self._whole else "text"  # start | text | call | between
        self._call: _Call | None = None
        self._calls: list[ToolCall] = []
        self._count = 0

    # ---- public -------------------------------------------------------------------------------
    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """Text generated since the last call -> (content delta, tool-call deltas)."""
        self._buf += delta
        return self._step(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The output is complete: flush what was held back."""
        return self._step(final=True)

    @property
    def calls(self) -> list[ToolCall]:
        """The calls found so far (complete ones; all of them after `finish`)."""
        return list(self._calls)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole output -> (content, calls): the non-streamed answer."""
        content, _ = self.feed(text)
        rest, _ = self.finish()
        return content + rest, self.calls

    # ---- the machine --------------------------------------------------------------------------
    def _step(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = "", []
        while True:
            before = (self._mode, len(self._buf))
            if self._mode == "start":  # llama3 / json_array: decide from the first characters
                stripped = self._buf.lstrip()
                if not stripped and not final:
                    break
                if self.parser == "llama3" and stripped.startswith(_PYTHON_TAG):
                    stripped = stripped[len(_PYTHON_TAG) :]
                elif self.parser == "llama3" and _PYTHON_TAG.startswith(stripped) and not final:
                    break
                if self.parser == "json_array" and stripped.startswith("["):
                    stripped = stripped[1:]
                if not stripped.strip() and not final:
                    break  # only the opener so far: the next characters decide
                if stripped.lstrip().startswith("{"):
                    self._buf, self._mode = stripped, "between"
                else:
                    self._mode = "text"
                    content += self._buf
                    self._buf = ""
            elif self._mode == "text":
                if not self._start:  # a whole-message format that turned out to be plain text
                    content += self._buf
                    self._buf = ""
                    break
                at = self._buf.find(self._start)
                if at >= 0:
                    content += self._buf[:at]
                    self._buf = self._buf[at + len(self._start) :]
                    self._open_call()
                else:
                    keep = 0 if final else _partial_suffix(self._buf, self._start)
                    content += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
            elif self._mode == "between":  # whole-message formats: separators, then the next call
                stripped = self._buf.lstrip().lstrip(";,").lstrip()
                if stripped.startswith("{"):
                    self._buf = stripped
                    self._open_call()
                elif stripped.startswith("]") or (final and not stripped):
                    self._buf = ""
                    break
                elif stripped:  # something else after the calls: keep it as content
                    content += stripped
                    self._buf = ""
                    self._mode = "text"
                else:
                    self._buf = ""
                    break
            elif self._mode == "call":
                got = self._advance_call(final)
                content += got[0]
                deltas += got[1]
            if (self._mode, len(self._buf)) == before:
                break
        return content, merge_deltas(deltas)

    def _open_call(self) -> None:
        self._call = _Call(index=self._count)
        self._mode = "call"

    def _advance_call(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        """Move text from the buffer into the open call; stream its name and arguments."""
        c = self._call
        deltas: list[ToolCallDelta] = []
        if self._end:
            at = self._buf.find(self._end)
            if at >= 0:  # the block is complete
                c.text += self._buf[:at]
                self._buf = self._buf[at + len(self._end) :]
                closed = True
            elif final:  # the output ended inside the block
                c.text += self._buf
                self._buf = ""
                closed = True
            else:  # hold back what may be the start of the end marker
                keep = _partial_suffix(self._buf, self._end)
                c.text += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                closed = False
        else:
            c.text += self._buf
            self._buf = ""
            closed = final
        # the name, once the head of the object is there
        if c.name is None:
            m = _HEAD.match(c.text)
            # (only once the value has begun: the whitespace before it is not the arguments')
            if m is not None and m.end() < len(c.text) and self._name_ok(json.loads(f'"{m.group(1)}"')):
                c.name = json.loads(f'"{m.group(1)}"')
                c.args_start = m.end()
                deltas.append(ToolCallDelta(index=c.index, id=c.id, name=c.name))
        if c.name is not None and not c.args_done:
            args = c.text[c.args_start :]
            end = _value_end(args)
            upto = len(args) if end is None else end
            if upto > c.args_sent:
                deltas.append(ToolCallDelta(index=c.index, arguments=args[c.args_sent : upto]))
                c.args_sent = upto
            c.args_done = end is not None
        if self._hold:
            c.held += deltas
            deltas = []
            if c.args_done:
                deltas, c.held = merge_deltas(c.held), []
        if not self._end and c.args_done:
            # whole-message formats: the call ends with its object's closing brace
            rest = c.text[c.args_start + c.args_sent :]
            close = rest.find("}")
            if close >= 0:
                self._buf = rest[close + 1 :] + self._buf
                c.text = c.text[: c.args_start + c.args_sent + close + 1]
                closed = True
        if not closed:
            return "", deltas
        return self._close_call(deltas)

    def _close_call(self, deltas: list[ToolCallDelta]) -> tuple[str, list[ToolCallDelta]]:
        c = self._call
        self._call = None
        self._mode = "between" if self._whole else "text"
        if self._hold and c.name is not None and not c.args_done:
            # cut off (max_tokens) before its arguments were complete: not a call; its text is content
            self._mode = "text"
            return c.text, deltas
        if c.name is not None:
            self._calls.append(ToolCall(c.id, c.name, c.text[c.args_start : c.args_start + c.args_sent]))
            self._count += 1
            return "", deltas
        # not recognised while streaming: parse the whole object (keys in another order)
        try:
            obj = json.loads(c.text)
            name = obj["name"]
            args = obj.get("arguments", obj.get("parameters", {}))
            if not isinstance(name, str) or not self._name_ok(name):
                raise ValueError(name)
        except (ValueError, KeyError, TypeError, AttributeError):
            self._mode = "text"
            raw = (self._start + c.text + self._end) if self._start else c.text
            return raw, deltas
        text = args if isinstance(args, str) else json.dumps(args)
        self._calls.append(ToolCall(c.id, name, text))
        self._count += 1
        return "", deltas + [ToolCallDelta(index=c.index, id=c.id, name=name, arguments=text)]

    def _name_ok(self, name: str) -> bool:
        return self.tool_names is None or name in self.tool_names


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (held back:
    it may be the start of the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
