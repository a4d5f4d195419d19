"""Recorder: trace events to a JSONL file, and loading such a file back.

Format: one JSON object per line (events.encode_json); the first line is a
`trace.header` with the schema version and the model. A path ending in `.gz`
is gzip-compressed. Loading checks the header: a file that is not a trace, or
one written by a newer schema, is refused with a clear message.
"""

from __future__ import annotations

import gzip
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Union

import msgspec
from workbench.core.trace import clock as trace_clock
from workbench.core.trace.events import (
    SCHEMA_VERSION,
    Event,
    TraceHeader,
    decode_json,
    encode_json,
)

PathLike = Union[str, "os.PathLike[str]"]


class TraceFormatError(ValueError):
    """The file is not a readable workbench trace."""


def _open(path: PathLike, mode: str) -> IO[bytes]:
    if str(path).endswith(".gz"):
        return gzip.open(path, mode)  # type: ignore[return-value]
    return open(path, mode)


class Recorder:
    """Writes events as JSONL. Usable directly as a bus callback::

        rec = Recorder("run.jsonl", model="SmolLM2-135M")
        handle = bus.subscribe_callback(rec)
        ...
        handle.close(); rec.close()

    Thread-safe. Buffered writes reach the disk at least every `flush_interval_s`
    (checked when events arrive) and on `close()`.
    """

    def __init__(self, path: PathLike, model: str = "", flush_interval_s: float = 0.5):
        self.path = Path(path)
        self.events_written = 0
        self._f = _open(self.path, "wb")
        self._lock = threading.Lock()
        self._flush_interval = flush_interval_s
        self._last_flush = time.monotonic()
        self._closed = False
        self._f.write(
            encode_json(
                TraceHeader(ts=trace_clock.now_ns(), proc="recorder", schema_version=SCHEMA_VERSION, model=model)
            )
            + b"\n"
        )

    def __call__(self, batch: list[Event]) -> None:
        self.write_batch(batch)

    def write(self, event: Event) -> None:
        self.write_batch([event])

    def write_batch(self, batch: Iterable[Event]) -> None:
        data = b"".join(encode_json(e) + b"\n" for e in batch)
        with self._lock:
            if self._closed:
                return
            self._f.write(data)
            self.events_written += data.count(b"\n")
            now = time.monotonic()
            if now - self._last_flush >= self._flush_interval:
                self._f.flush()
                self._last_flush = now

    def flush(self) -> None:
        with self._lock:
            if not self._closed:
                self._f.flush()

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._f.close()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_trace(path: PathLike) -> tuple[TraceHeader, list[Event]]:
    """The header and the events of a recording.

    A truncated last line (the recorder was killed mid-write) is ignored; any
    other undecodable line is an error naming its line number.
    """
    try:
        with _open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except (OSError, EOFError) as e:
        raise TraceFormatError(f"{path}: cannot read: {e}") from e
    first = next((i for i, ln in enumerate(lines) if ln.strip()), None)
    if first is None:
        raise TraceFormatError(f"{path}: empty file, not a workbench trace")
    header = _decode_header(path, lines[first])
    events: list[Event] = []
    last = max((i for i, ln in enumerate(lines) if ln.strip()), default=first)
    for i in range(first + 1, len(lines)):
        ln = lines[i]
        if not ln.strip():
            continue
        try:
            events.append(decode_json(ln))
        except Exception as e:
            if i == last and not lines[i].endswith(b"}"):
                break  # partial final record
            raise TraceFormatError(f"{path}:{i + 1}: not a valid trace event: {e}") from None
    return header, events


def load_trace(path: PathLike) -> list[Event]:
    """The events of a recording (header checked, not included)."""
    return read_trace(path)[1]


def _decode_header(path: PathLike, line: bytes) -> TraceHeader:
    try:
        raw = msgspec.json.decode(line)
    except Exception:
        raise TraceFormatError(f"{path}: not a workbench trace (first line is not JSON)") from None
    if not isinstance(raw, dict) or raw.get("kind") != "trace.header":
        raise TraceFormatError(f"{path}: not a workbench trace (no trace.header first line)")
    version = raw.get("schema_version")
    if not isinstance(version, int):
        raise TraceFormatError(f"{path}: trace header has no schema_version")
    if version > SCHEMA_VERSION:
        raise TraceFormatError(
            f"{path}: recorded with trace schema v{version}, but this workbench reads up to "
            f"v{SCHEMA_VERSION}; upgrade serving-workbench to replay it"
        )
    try:
        header = decode_json(line)
    except Exception as e:
        raise TraceFormatError(f"{path}: bad trace header: {e}") from None
    assert isinstance(header, TraceHeader)  # its kind was checked above
    return header
