"""The wire of every peer driver (vllm_peer.py, llamacpp_peer.py): line-delimited JSON over a pipe.

A driver runs as a script in the peer's own venv, where `workbench` is not installed, so this module
imports nothing but the standard library: the drivers import it as a sibling file (`import peer_wire`,
their folder is sys.path[0]); the bench imports it as `workbench.bench.peer_wire`. One JSON object a
line: requests on the driver's stdin, one reply a request on its stdout; every reply carries a boolean
"ok", a failed request answers {"ok": false, "error", "traceback"}. The driver's stdout carries nothing
but replies: whatever a library prints there goes to stderr (which the bench keeps in a log file).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, Protocol

FIRST_IDS = 16  # how many output ids of each prompt a `run` reply carries (the equality check)
OPS = ("load", "run", "quit")


class ProtocolError(ValueError):
    """A line that is not a well-formed request or reply."""


def encode_message(msg: dict) -> str:
    """One JSON object on one line, newline-terminated (the wire form of every request and reply)."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"a message is a JSON object, not {type(msg).__name__}")
    return json.dumps(msg, separators=(",", ":")) + "\n"


def decode_message(line: str) -> dict:
    """Parse one line into a JSON object; ProtocolError says what is wrong with it."""
    text = line.strip()
    if not text:
        raise ProtocolError("empty line")
    try:
        msg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"not JSON ({exc.msg} at column {exc.colno}): {text[:80]!r}") from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"a message is a JSON object, not {type(msg).__name__}: {text[:80]!r}")
    return msg


def quit_request() -> dict:
    """The `quit` request: the driver answers {"ok": true} and exits."""
    return {"op": "quit"}


def check_op(msg: dict) -> str:
    """The request's op, when it is one of OPS; ProtocolError otherwise."""
    op = msg.get("op")
    if op not in OPS:
        raise ProtocolError(f"unknown op {op!r} (expected one of {', '.join(OPS)})")
    return op


def is_int(x: Any) -> bool:
    """An int that is not a bool (JSON's true would pass isinstance(x, int))."""
    return isinstance(x, int) and not isinstance(x, bool)


def error_reply(exc: BaseException) -> dict:
    """A failed request's reply: the error in one line, and the traceback."""
    return {
        "ok": False,
        "error": f"{type(exc).__name__}: {exc}",
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    }


def parse_reply(line: str) -> dict:
    """A reply line as a dict; ProtocolError when it is not one (no boolean "ok" field)."""
    msg = decode_message(line)
    if not isinstance(msg.get("ok"), bool):
        raise ProtocolError(f"a reply carries a boolean 'ok': {line.strip()[:80]!r}")
    return msg


class Driver(Protocol):
    """What a driver script holds: one peer engine, loaded once, run many times."""

    def load(self, msg: dict) -> dict: ...

    def run(self, msg: dict) -> dict: ...


def _protocol_stdout():
    """Keep the real stdout for replies only; everything else written to fd 1 goes to stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def serve(
    driver: Driver,
    check_request: Callable[[dict], dict],
    check_import: Callable[[], dict],
    argv: list[str] | None = None,
) -> int:
    """A driver's main: serve requests from stdin until `quit` or end of input.

    `--check` only calls `check_import` (which imports the peer's package and returns the reply's
    fields) and prints one reply: exit status 0, or 1 with the error reply when the import fails."""
    argv = sys.argv[1:] if argv is None else argv
    out = _protocol_stdout()
    if "--check" in argv:
        try:
            out.write(encode_message({"ok": True, **check_import(), "python": sys.executable}))
            return 0
        except BaseException as exc:  # ImportError, or anything a package raises while importing
            out.write(encode_message(error_reply(exc)))
            return 1
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            msg = check_request(decode_message(line))
            op = msg["op"]
            reply = {"ok": True} if op == "quit" else driver.load(msg) if op == "load" else driver.run(msg)
        except Exception as exc:
            msg, reply = {}, error_reply(exc)
        out.write(encode_message(reply))
        out.flush()
        if msg.get("op") == "quit":
            break
    return 0
