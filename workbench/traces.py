"""Workloads from production traces (issue #37): `workbench sim run --workload FILE`.

The file's format is detected from its first line (`--workload-format` overrides it):

- **workbench**: the project's own JSONL, one `{"arrival", "prompt_tokens", "output_tokens",
  optional "group", "prefix_tokens", "priority"}` per line; arrivals in seconds, taken as they are.
- **recording**: a real engine's `--record` file (a `trace.header` first line, or gzip): its
  finished requests (core/simulation/recorded.py). Without recorded token ids, a request that found
  k tokens in the real radix cache starts with k tokens of an earlier prompt (`SharedPrompt`), so
  what was shared in the real run is shared where it replays.
- **mooncake**: Mooncake's trace JSONL (github.com/kvcache-ai/Mooncake, `mooncake_trace.jsonl`;
  the format as NVIDIA Dynamo's benchmarks/data_generator README describes it): per line
  `{"timestamp": ms since the trace began, "input_length", "output_length", "hash_ids": [...]}`, where
  each hash id names one 512-token block of the prompt and two requests with the same id at the same
  position share that block and everything before it. Each id becomes the same 512 token ids
  wherever it appears (`BlockPrompt`), so shared ids are real shared prefixes the radix cache hits.
- **azure**: Azure's LLM inference trace CSV (github.com/Azure/AzurePublicDataset,
  AzureLLMInferenceDataset2023.md / 2024.md, e.g. `AzureLLMInferenceTrace_conv.csv`): columns
  `TIMESTAMP` (a date and time, e.g. `2023-11-16 18:15:46.6805900`), `ContextTokens`, `GeneratedTokens`.
- **burstgpt**: BurstGPT's CSV (github.com/HPMLL/BurstGPT, `BurstGPT_1.csv`): columns `Timestamp`
  (seconds), `Model`, `Request tokens`, `Response tokens`, `Total tokens`, `Log Type` (v2 adds
  `Session ID` and `Elapsed time`). Rows with 0 response tokens are failed requests: skipped and counted.

A trace's timestamps become arrivals in seconds from its first row (the project's formats are
already relative and kept as they are). Then `TraceCut` picks the requests: the window `--start S`
`--duration D` (seconds of the trace; the window's start becomes 0), a seeded `--sample F`, the first
`--max-requests N`, and `--time-scale X` multiplies the arrivals (0.5 plays the trace twice as fast).
Any row in any format that asks for no prompt or no output tokens is skipped and counted as failed.
The three public traces are in time order: a cut stops reading at the window's end or the N-th
request, so the first minutes of a week-long trace load in a moment. A file found out of order is
read to its end instead.
"""

from __future__ import annotations

import csv
import functools
import json
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

from workbench.core.simulation.recorded import is_recording, workload_from_trace
from workbench.core.simulation.simulator import FIRST_TOKEN, SimRequest

FORMATS = ("auto", "workbench", "recording", "mooncake", "azure", "burstgpt")
MOONCAKE_BLOCK = 512  # tokens per hash id in Mooncake's traces
# Block tokens are drawn from [FIRST_TOKEN, TOKEN_SPACE): within nearly every model's vocabulary;
# `fit_vocab` redraws them for a smaller one (the live engine's stand-in tokenizer, a tiny config).
TOKEN_SPACE = 32000

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
HINT = "--workload-format {workbench,recording,mooncake,azure,burstgpt} names it"


class WorkloadError(ValueError):
    """A workload file that cannot be read as asked; the message says what to do (one line)."""


@dataclass
class TraceCut:
    """Which requests of a trace to keep, and how fast they come (see the module docstring)."""

    start: float = 0.0  # seconds of the trace where the window begins
    duration: float | None = None  # the window's length (None: to the end)
    sample: float | None = None  # keep this fraction, drawn by `seed` (None: all)
    max_requests: int | None = None  # then the first N
    time_scale: float = 1.0  # arrivals multiplied by this
    seed: int = 0

    def describe(self) -> str:
        parts = []
        if self.start:
            parts.append(f"--start {self.start:g}")
        if self.duration is not None:
            parts.append(f"--duration {self.duration:g}")
        if self.sample is not None:
            parts.append(f"--sample {self.sample:g}")
        if self.max_requests is not None:
            parts.append(f"--max-requests {self.max_requests}")
        return " ".join(parts)


@dataclass
class TraceWorkload:
    """The requests read from a workload file, and what was left out on the way."""

    requests: list[SimRequest]
    format: str
    rows: int = 0  # request rows read (kept or not)
    failed: int = 0  # rows inside the window skipped as failed requests
    span_s: float = 0.0  # seconds of the trace the rows read covered
    notes: list[str] = field(default_factory=list)

    def summary(self, path) -> str:
        failed = f", {self.failed} failed requests skipped" if self.failed else ""
        last = self.requests[-1].arrival if self.requests else 0.0
        return (
            f"{self.format} workload {Path(path).name}: {len(self.requests)} requests over {last:.1f} s "
            f"(of {self.rows} rows read, {self.span_s:.1f} s of trace{failed})"
        )


# --- Mooncake's shared blocks as token ids ---------------------------------------------------------


@functools.lru_cache(maxsize=8192)
def block_tokens(hash_id: int, seed: int = 0, vocab: int = TOKEN_SPACE) -> tuple[int, ...]:
    """The 512 token ids of Mooncake block `hash_id`: the same wherever the id appears."""
    rng = np.random.default_rng([seed, 0x6D6F6F6E, hash_id])  # "moon": apart from request_prompt's draws
    return tuple(rng.integers(FIRST_TOKEN, vocab, MOONCAKE_BLOCK).tolist())


class BlockPrompt(Sequence[int]):
    """A prompt made of Mooncake blocks: `length` tokens, block k being `block_tokens(hash_ids[k])`
    (the last one cut short), then ids of its own where the blocks do not cover `length`. Built
    lazily (`Simulator` takes `list(prompt)` when the request arrives), so a trace of thousands of
    long prompts costs its hash ids, not its tokens, until it runs."""

    def __init__(self, hash_ids: Sequence[int], length: int, salt: int, seed: int = 0, vocab: int = TOKEN_SPACE):
        self.hash_ids = hash_ids if isinstance(hash_ids, tuple) else tuple(map(int, hash_ids))
        self.length, self.salt, self.seed, self.vocab = int(length), int(salt), int(seed), int(vocab)

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        left = self.length
        for h in self.hash_ids:
            if left <= 0:
                return
            block = block_tokens(h, self.seed, self.vocab)
            yield from block[:left]
            left -= MOONCAKE_BLOCK
        if left > 0:  # more prompt than blocks: this request's own tokens
            rng = np.random.default_rng([self.seed, 0x6F776E, self.salt])
            yield from rng.integers(FIRST_TOKEN, self.vocab, left).tolist()

    def __getitem__(self, index):
        return list(self)[index]

    def with_vocab(self, vocab: int) -> BlockPrompt:
        return BlockPrompt(self.hash_ids, self.length, self.salt, self.seed, vocab)


@functools.lru_cache(maxsize=4096)
def _segment_tokens(key: int, length: int, seed: int, vocab: int) -> tuple[int, ...]:
    rng = np.random.default_rng([seed, 0x726563, key])  # "rec": apart from the other draws
    return tuple(rng.integers(FIRST_TOKEN, vocab, length).tolist())


class SharedPrompt(Sequence[int]):
    """A prompt made of drawn segments `(key, drawn, used)`: the first `used` of the `drawn` ids that
    `key` draws. A recording's request that found k tokens in the real radix cache takes the first
    k tokens of an earlier prompt (its segments, cut at k) and a segment of its own: so the same
    requests share the same prefixes in the simulator (see `share_recorded_prefixes`)."""

    def __init__(self, segments: Sequence[tuple[int, int, int]], seed: int = 0, vocab: int = TOKEN_SPACE):
        self.segments, self.seed, self.vocab = tuple(segments), int(seed), int(vocab)
        self.length = sum(used for _, _, used in self.segments)

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        for key, drawn, used in self.segments:
            yield from _segment_tokens(key, drawn, self.seed, self.vocab)[:used]

    def __getitem__(self, index):
        return list(self)[index]

    def head(self, k: int) -> list[tuple[int, int, int]]:
        """The segments of the first `k` tokens."""
        out, left = [], k
        for key, drawn, used in self.segments:
            if left <= 0:
                break
            out.append((key, drawn, min(used, left)))
            left -= used
        return out

    def with_vocab(self, vocab: int) -> SharedPrompt:
        return SharedPrompt(self.segments, self.seed, vocab)


def share_recorded_prefixes(requests: list[SimRequest], cached: dict[int, int], seed: int = 0) -> int:
    """Give a recording's requests without recorded token ids prompts that share what the real radix
    cache shared: request i, which found `cached[i]` tokens cached, starts with the first that many
    tokens of the latest earlier prompt at least that long (else the longest earlier one, as far as
    it goes). A hit on an earlier request's generated tokens (a chat's next turn) is counted on its
    prompt only. Returns how many requests share a prefix."""
    made: list[SharedPrompt | None] = []
    shared = 0
    for i, r in enumerate(requests):
        if r.prompt_ids is not None:
            made.append(None)
            continue
        k = min(cached.get(i, 0), r.prompt_len - 1)
        head: list[tuple[int, int, int]] = []
        if k > 0:
            earlier = [p for p in made if p is not None]
            parent = next((p for p in reversed(earlier) if len(p) >= k), None)
            if parent is None and earlier:
                parent = max(earlier, key=len)
            if parent is not None:
                head = parent.head(k)
                shared += 1
        own = r.prompt_len - sum(used for _, _, used in head)
        prompt = SharedPrompt([*head, (i, own, own)], seed)
        r.prompt_ids = prompt  # type: ignore[assignment]  # a lazy Sequence, as BlockPrompt
        made.append(prompt)
    return shared


def fit_vocab(requests: list[SimRequest], vocab: int) -> None:
    """Redraw drawn prompts (Mooncake's blocks, a recording's shared segments) whose ids would not fit
    a `vocab`-token vocabulary (the same sharing)."""
    for r in requests:
        p = r.prompt_ids
        if isinstance(p, (BlockPrompt, SharedPrompt)) and p.vocab > vocab:
            r.prompt_ids = p.with_vocab(vocab)


def drawn_prompts(requests: list[SimRequest]) -> bool:
    """Whether any prompt is drawn here (so `fit_vocab` matters)."""
    return any(isinstance(r.prompt_ids, (BlockPrompt, SharedPrompt)) for r in requests)


# --- detection -------------------------------------------------------------------------------------


def _first_line(path) -> str:
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        return next((line for line in f if line.strip()), "").strip()


def detect_format(path) -> str:
    """The format of a workload file, from its first line (a header, or a JSON object)."""
    if is_recording(path):
        return "recording"
    line = _first_line(path)
    if not line:
        raise WorkloadError(f"{path}: the file is empty; a workload has one request per line")
    if line.startswith("{"):
        try:
            keys = set(json.loads(line))
        except ValueError:
            raise WorkloadError(f"{path}: the first line is not a JSON object; {HINT}") from None
        if "hash_ids" in keys or {"timestamp", "input_length"} <= keys:
            return "mooncake"
        if "arrival" in keys:
            return "workbench"
        raise WorkloadError(
            f"{path}: a JSON line with keys {', '.join(sorted(keys))} is no known workload (workbench: arrival, "
            f"prompt_tokens, output_tokens; mooncake: timestamp, input_length, output_length, hash_ids); {HINT}"
        )
    columns = {c.strip() for c in next(csv.reader([line]))}
    if {"ContextTokens", "GeneratedTokens"} <= columns:
        return "azure"
    if {"Request tokens", "Response tokens"} <= columns:
        return "burstgpt"
    raise WorkloadError(
        f"{path}: a first line of {', '.join(sorted(columns))[:200]} is no known workload (azure CSV: "
        f"{', '.join(AZURE_COLUMNS)}; burstgpt CSV: {', '.join(BURSTGPT_COLUMNS)}); {HINT}"
    )


# --- readers: (seconds of the trace, request or None for a failed row) per row ----------------------

Row = tuple[float, SimRequest | None]


def _request(t: float, prompt: int, output: int, **kw) -> Row:
    if prompt <= 0 or output <= 0:
        return t, None  # a failed request (BurstGPT's 0 response tokens): nothing to simulate
    return t, SimRequest(t, prompt, output, **kw)


def _read_workbench(path, seed: int) -> Iterator[Row]:
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                t = float(d["arrival"])
                yield (
                    t,
                    SimRequest(
                        t,
                        int(d["prompt_tokens"]),
                        int(d["output_tokens"]),
                        d.get("group"),
                        int(d.get("prefix_tokens", 0)),
                        priority=None if d.get("priority") is None else int(d["priority"]),
                    ),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise WorkloadError(
                    f"{path}:{n}: {exc!r}; each line is a JSON object with arrival, prompt_tokens, "
                    "output_tokens (and optionally group, prefix_tokens, priority)"
                ) from None


def _read_recording(path, seed: int) -> Iterator[Row]:
    cached: dict[int, int] = {}
    try:
        requests = workload_from_trace(path, cached)
    except (ValueError, OSError) as exc:
        raise WorkloadError(f"--workload {path}: {exc}") from None
    share_recorded_prefixes(requests, cached, seed)
    for r in requests:
        yield r.arrival, r


def _read_mooncake(path, seed: int) -> Iterator[Row]:
    with open(path, encoding="utf-8-sig") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                t, prompt, output = float(d["timestamp"]) / 1000, int(d["input_length"]), int(d["output_length"])
                hash_ids = tuple(map(int, d.get("hash_ids") or ()))
            except (ValueError, KeyError, TypeError) as exc:
                raise WorkloadError(
                    f"{path}:{n}: {exc!r}; a Mooncake trace line is a JSON object with timestamp (ms), "
                    "input_length, output_length and hash_ids (or name another --workload-format)"
                ) from None
            ids = BlockPrompt(hash_ids, prompt, salt=n, seed=seed) if hash_ids and prompt > 0 else None
            yield _request(t, prompt, output, prompt_ids=ids)


def _csv_rows(path, needed: Sequence[str], what: str) -> Iterator[tuple[int, dict[str, str]]]:
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f, skipinitialspace=True)
        columns = [c.strip() for c in reader.fieldnames or ()]
        missing = [c for c in needed if c not in columns]
        if missing:
            raise WorkloadError(
                f"{path}: missing column {', '.join(repr(c) for c in missing)} (it has {', '.join(columns)[:200]}); "
                f"{what} has {', '.join(needed)} (or name another --workload-format)"
            )
        reader.fieldnames = columns
        yield from enumerate(reader, 2)


_DATETIME = re.compile(r"(\d{4}-\d\d-\d\d)[ T](\d\d:\d\d:\d\d)(?:\.(\d+))?\s*(Z|[+-]\d\d:?\d\d)?$")


def parse_datetime(text: str) -> float:
    """Seconds since the epoch of Azure's TIMESTAMP (`2023-11-16 18:15:46.6805900`: 100 ns ticks,
    more digits than `datetime` takes; a zone offset, if any, respected)."""
    m = _DATETIME.match(text.strip())
    if not m:
        raise ValueError(f"{text!r} is not a date and time like 2023-11-16 18:15:46.68")
    day, clock, frac, zone = m.groups()
    stamp = datetime.fromisoformat(f"{day}T{clock}{'+00:00' if zone in (None, 'Z') else zone}")
    return stamp.timestamp() + (float(f"0.{frac}") if frac else 0.0)


def _read_azure(path, seed: int) -> Iterator[Row]:
    for n, row in _csv_rows(path, AZURE_COLUMNS, "Azure's LLM inference trace"):
        try:
            t = parse_datetime(row["TIMESTAMP"])
            yield _request(t, int(row["ContextTokens"]), int(row["GeneratedTokens"]))
        except (ValueError, TypeError) as exc:
            raise WorkloadError(
                f"{path}:{n}: {exc}; Azure's rows are TIMESTAMP, ContextTokens, GeneratedTokens"
            ) from None


def _read_burstgpt(path, seed: int) -> Iterator[Row]:
    for n, row in _csv_rows(path, BURSTGPT_COLUMNS, "BurstGPT's trace"):
        try:
            t = float(row["Timestamp"])
            yield _request(t, int(float(row["Request tokens"])), int(float(row["Response tokens"])))
        except (ValueError, TypeError) as exc:
            raise WorkloadError(
                f"{path}:{n}: {exc}; BurstGPT's rows have Timestamp (s), Request tokens, Response tokens"
            ) from None


READERS = {
    "workbench": _read_workbench,
    "recording": _read_recording,
    "mooncake": _read_mooncake,
    "azure": _read_azure,
    "burstgpt": _read_burstgpt,
}
# The project's own formats carry relative seconds already: kept as they are (a workbench file's first
# arrival need not be 0). A public trace's clock starts at its first row.
RELATIVE = ("workbench", "recording")


def read_workload(path, fmt: str = "auto", cut: TraceCut | None = None, seed: int = 0) -> TraceWorkload:
    """The requests of a workload file in `fmt` ("auto": `detect_format`), cut by `cut`; `seed` draws
    Mooncake's block tokens. Raises `WorkloadError` with a one-line fix for what a user can get wrong."""
    cut = cut or TraceCut(seed=seed)
    if fmt not in FORMATS:
        raise WorkloadError(f"--workload-format {fmt!r}: one of {', '.join(FORMATS)}")
    if fmt == "auto":
        fmt = detect_format(path)
    end = cut.start + cut.duration if cut.duration is not None else float("inf")
    rng = random.Random(cut.seed)
    kept: list[tuple[float, SimRequest]] = []
    out = TraceWorkload([], fmt)
    origin: float | None = 0.0 if fmt in RELATIVE else None
    latest, ordered = float("-inf"), True
    for t, req in READERS[fmt](path, seed):
        if origin is None:
            origin = t
        rel = t - origin
        out.rows += 1
        ordered = ordered and rel >= latest
        latest = max(latest, rel)
        if rel < cut.start or rel >= end:
            if rel >= end and ordered:
                break  # in time order: nothing later is inside the window
            continue
        if req is None:
            out.failed += 1
            continue
        if cut.sample is not None and rng.random() >= cut.sample:
            continue
        kept.append((rel, req))
        if cut.max_requests is not None and len(kept) >= cut.max_requests and ordered:
            break
    out.span_s = max(latest, 0.0) if out.rows else 0.0
    if cut.max_requests is not None and len(kept) > cut.max_requests:  # out of order: the N earliest
        first = sorted(range(len(kept)), key=lambda i: kept[i][0])[: cut.max_requests]
        kept = [kept[i] for i in sorted(first)]
    if not kept:
        if not out.rows:
            raise WorkloadError(f"{path}: no requests in this {fmt} file")
        why = f" ({out.failed} failed)" if out.failed else ""
        raise WorkloadError(
            f"{path}: no requests left after {cut.describe() or 'reading'}{why}: the trace's {out.rows} rows span "
            f"{out.span_s:.1f} s; pick a window inside it (--start, --duration) or a larger --sample"
        )
    # Arrivals: seconds since the window's start (a trace's first row when no --start), scaled.
    for rel, req in kept:
        req.arrival = (rel - cut.start) * cut.time_scale
        out.requests.append(req)
    return out
