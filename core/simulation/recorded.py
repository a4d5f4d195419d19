"""A recorded run as a simulation workload (issue #19):

    workbench serve --record run.jsonl ...            # a real engine, a real workload
    workbench sim run --workload run.jsonl --simulate h100 --model llama-3.1-8b

Each request the recording saw finish becomes a `SimRequest`: it arrives when the tokenizer manager
stamped it (`req.arrived`, else when the scheduler queued it), with the prompt's length
(`req.tokenized` / `req.queued`) and the output length it had (`req.finished`), so the same stream of
arrivals and lengths meets the simulated deployment. A run recorded with `--trace-token-ids` also
carries the token ids: the prompts are then the recorded ones (so shared prefixes and multi-turn
histories hit the simulated radix cache as they hit the real one) and the simulated worker returns
the recorded output tokens in turn. Without them the prompts are drawn and share nothing. Requests
that did not finish (aborted, or cut off by the end of the recording) are left out.

A run with speculative decoding also left each verify step's drafts in the trace (`spec.verify`,
with the output length they followed): replayed token for token with speculative decoding on, each
request proposes the drafts its real drafter proposed (NGRAM's or a draft model's), and they stand
exactly as far as they did in the real run (`recorded_speculation` gives the run's algorithm, drafts
per step and how many stood, the simulator's defaults for it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from workbench.core.simulation.simulator import SimRequest
from workbench.core.trace.events import ReqArrived, ReqFinished, ReqQueued, ReqTokenized, SpecVerify
from workbench.core.trace.recorder import read_trace


def is_recording(path) -> bool:
    """Whether `path` is a workbench trace recording (its first line is a trace.header)."""
    try:
        with open(path, "rb") as f:
            head = f.read(2)
        if head == b"\x1f\x8b":  # gzip: only the recorder writes those
            return True
        with open(path, encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "")
        return json.loads(first).get("kind") == "trace.header"
    except (OSError, ValueError, AttributeError):
        return False


def workload_from_trace(path, cached: dict[int, int] | None = None) -> list[SimRequest]:
    """The finished requests of a recording, by arrival (seconds from the first). `cached`, if given,
    is filled with how many prompt tokens each (by index) found in the real radix cache."""
    _, events = read_trace(path)
    arrival: dict[str, int] = {}
    prompt: dict[str, int] = {}
    output: dict[str, int] = {}
    hits: dict[str, int] = {}
    prompt_ids: dict[str, list[int]] = {}
    output_ids: dict[str, list[int]] = {}
    drafts: dict[str, dict[int, list[int]]] = {}
    for e in events:
        if isinstance(e, SpecVerify) and not e.snapshot:
            for v in e.reqs:
                if v.drafts and v.at >= 0:  # older recordings did not say where drafts went
                    drafts.setdefault(v.rid, {})[v.at] = list(v.drafts)
        if isinstance(e, (ReqArrived, ReqQueued)):
            arrival[e.rid] = min(e.ts, arrival.get(e.rid, e.ts))
        if isinstance(e, (ReqTokenized, ReqQueued)):
            prompt.setdefault(e.rid, e.prompt_tokens)
            if isinstance(e, ReqTokenized) and e.input_ids:
                prompt_ids[e.rid] = e.input_ids
        elif isinstance(e, ReqFinished) and e.reason != "abort":
            output[e.rid] = e.completion_tokens
            hits[e.rid] = e.cached_tokens
            if e.output_ids:
                output_ids[e.rid] = e.output_ids
    rids = [r for r in arrival if prompt.get(r, 0) > 0 and output.get(r, 0) > 0]
    if not rids:
        raise ValueError(
            f"{Path(path).name}: no finished requests in this recording; record a real engine's run "
            "(`workbench serve --record FILE`, `workbench tui --record FILE`) while it serves a workload"
        )
    rids.sort(key=lambda r: arrival[r])
    t0 = arrival[rids[0]]
    if cached is not None:
        cached.update((i, hits.get(r, 0)) for i, r in enumerate(rids))
    return [
        SimRequest(
            (arrival[r] - t0) / 1e9,
            prompt[r],
            output[r],
            prompt_ids=prompt_ids.get(r),
            output_ids=output_ids.get(r)[: output[r]] if r in output_ids else None,
            drafts=drafts.get(r) if r in output_ids else None,  # drafts stand or fall by the recorded tokens
        )
        for r in rids
    ]


@dataclass
class RecordedSpeculation:
    """A recording's speculative decoding, from its `spec.verify` events."""

    algorithm: str  # "NGRAM" or "STANDALONE"
    num_draft_tokens: int  # the most drafts a request proposed in one step
    proposed: int  # drafts proposed ...
    accepted: int  # ... and kept

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


def recorded_speculation(path) -> RecordedSpeculation | None:
    """What speculative decoding did in a recording (None: it was off)."""
    _, events = read_trace(path)
    verifies = [e for e in events if isinstance(e, SpecVerify) and not e.snapshot]
    if not verifies:
        return None
    reqs = [v for e in verifies for v in e.reqs]
    return RecordedSpeculation(
        verifies[-1].algorithm,
        max((len(v.drafts) for v in reqs), default=0),
        sum(len(v.drafts) for v in reqs),
        sum(v.accepted for v in reqs),
    )
