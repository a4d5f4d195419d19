"""Disaggregated serving (PD) in the trace picture: a prefill server's and a decode server's traces
joined by bootstrap room, and the decode side's TTFT split along the request's journey.

A PD router sends each request to both servers with the same `bootstrap_room`; each server names it
with its own rid. Three events carry the room (core/trace/events.py): `pd.bootstrap` (admitted, on
either side), `pd.reserved` (the decode side reserved a row and slots; its prealloc queue ends) and
`pd.transfer` (each side's end of the handover: bytes, ms, the wait before them). `PDJoin` folds them
into rooms, so a view can go from the decode-side request the client sees to its prefill-side peer.

The decode side's TTFT (`pd_ttft_breakdown`) runs from its arrival to its first token along the
critical path. Two branches run at once after the router: the decode server queues the request
and reserves its slots ("decode queue"), while the prefill server queues and computes it; the pull
completes once both are done, so the TTFT is explained by whichever finished later:

    arrived → queued      the tokenizer of the server on the critical path hands the request over
    decode queue          the prealloc queue: waiting for a request row and one KV slot per prompt token
    prefill queue         on the prefill server, until the step that ran its first chunk began
    prefill / chunk k/n   the prefill server's steps that computed the prompt
    handover              the first token sampled, the KV copied out and offered on the bootstrap port
    transfer              the bytes on the wire (tokens, bytes, ms)
    first token           the KV installed in the reserved slots and the first token streamed back

The branch off the critical path still gets its part, of no time, saying how long it took in
parallel. Every moment is clamped as in ttft.py, so the parts always sum to the TTFT exactly.
`journey` gives each stage as long as it really was (the two branches overlap there).
Both traces must be on one clock: on one machine both servers stamp the
host's monotonic clock; `workbench tui --attach` across two machines anchors each publisher on its
first event, so cross-server parts are then only as good as that anchoring (docs/disaggregation.md).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from workbench.core.trace import events as ev
from workbench.core.trace.ttft import StepIndex, TtftBreakdown, TtftPart, fmt_dur, ttft_breakdown

#: The extra TTFT part kinds of a PD request (ttft.PART_KINDS has the rest).
PD_PART_KINDS = ("decode_queue", "prefill_queue", "transfer")
#: The journey's stages, in their usual order.
JOURNEY_STAGES = ("decode queue", "prefill queue", "prefill", "transfer", "decode")


@dataclass
class PDRoom:
    """One bootstrap room: the same request on the prefill and the decode server."""

    room: int
    prefill_rid: str | None = None
    decode_rid: str | None = None
    reserved_ts: int | None = None  # decode: row and slots reserved, the pull started
    reserved_tokens: int = 0
    transfers: dict[str, ev.PDTransfer] = field(default_factory=dict)  # role -> its end of the handover


def fmt_bytes(n: int) -> str:
    """Bytes for people: 1.2 MB, 340 KB, 12 B."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


class PDJoin:
    """The rooms seen in a trace (TraceState.pd). Read-only for views: `rooms`, `role_of_proc`
    (scheduler process -> "prefill" | "decode"), `room_of(rid)`, `peer(rid)`, `role(rid)`."""

    def __init__(self, max_rooms: int = 20000):
        self.rooms: OrderedDict[int, PDRoom] = OrderedDict()
        self.role_of_proc: dict[str, str] = {}
        self._room_of: dict[str, int] = {}
        self._max_rooms = max_rooms

    def __bool__(self) -> bool:
        return bool(self.rooms)

    def _room(self, room: int) -> PDRoom:
        r = self.rooms.get(room)
        if r is None:
            r = self.rooms[room] = PDRoom(room)
            while len(self.rooms) > self._max_rooms:  # bounded: the oldest rooms go first
                old = self.rooms.popitem(last=False)[1]
                for rid in (old.prefill_rid, old.decode_rid):
                    if rid is not None:
                        self._room_of.pop(rid, None)
        return r

    def _bind(self, rid: str, room: int, role: str, proc: str) -> PDRoom:
        r = self._room(room)
        if rid:
            setattr(r, f"{role}_rid", rid)
            self._room_of[rid] = room
        if proc:
            self.role_of_proc[proc] = role
        return r

    def apply(self, e: ev.Event) -> None:
        """Fold one pd.* event in."""
        if isinstance(e, ev.PDBootstrap):
            self._bind(e.rid, e.room, e.role, e.proc)
        elif isinstance(e, ev.PDReserved):
            r = self._bind(e.rid, e.room, "decode", e.proc)
            r.reserved_ts, r.reserved_tokens = e.ts, e.tokens
        elif isinstance(e, ev.PDTransfer):
            r = self._bind(e.rid, e.room, e.role, e.proc)
            r.transfers[e.role] = e

    def room_of(self, rid: str) -> PDRoom | None:
        room = self._room_of.get(rid)
        return self.rooms.get(room) if room is not None else None

    def role(self, rid: str) -> str | None:
        r = self.room_of(rid)
        if r is None:
            return None
        return "decode" if r.decode_rid == rid else "prefill"

    def peer(self, rid: str) -> str | None:
        """The same request on the other server (None while its events have not come)."""
        r = self.room_of(rid)
        if r is None:
            return None
        return r.prefill_rid if r.decode_rid == rid else r.decode_rid

    def role_label(self, proc: str) -> str:
        """A scheduler's role ("prefill", "decode") or "" when it is not a PD server."""
        return self.role_of_proc.get(proc, "")


def transfer_detail(t: ev.PDTransfer) -> str:
    """One pd.transfer in words: '24 tokens, 1.2 MB in 3.1 ms (387 MB/s), after 40 ms waiting'."""
    if not t.ok:
        return f"failed: {t.error}"
    rate = f" ({t.nbytes / (t.ms / 1e3) / 1e6:.0f} MB/s)" if t.ms > 0 else ""
    return f"{t.tokens} tokens, {fmt_bytes(t.nbytes)} in {t.ms:.1f} ms{rate}, after {t.wait_ms:.1f} ms waiting"


def pd_ttft_breakdown(state, rid: str, index: StepIndex | None = None) -> TtftBreakdown | None:
    """The decode-side request `rid`'s TTFT along its critical path (module docstring), or None when
    `rid` is not the decode side of a room whose prefill side is in the trace (TraceState.ttft_parts
    then explains it as one server's request). `state` is a TraceState."""
    pd: PDJoin | None = getattr(state, "pd", None)
    room = pd.room_of(rid) if pd else None
    if room is None or room.decode_rid != rid or room.prefill_rid is None:
        return None
    r = state.requests.get(rid)
    if r is None or r.arrival_ts is None:
        return None
    idx = index if index is not None else StepIndex(state)
    pre = ttft_breakdown(state, room.prefill_rid, idx)  # the prefill server's own view
    partial = r.first_token_ts is None
    t0: int = r.arrival_ts
    if r.first_token_ts is not None:
        end = r.first_token_ts
    elif r.done:
        end = r.finish_ts if r.finish_ts is not None else state.last_ts
    else:
        end = state.last_ts
    end = max(end, t0)
    pre_parts = list(pre.parts) if pre is not None else []
    chunks = [p for p in pre_parts if p.kind == "prefill" and p.steps]
    p_done = chunks[-1].end_ts if chunks else None
    res = room.reserved_ts
    q_d = r.queued_ts
    # Which branch the pull waited for: the decode side's slots, or the prefill side's KV.
    decode_critical = p_done is not None and (res is None or res > p_done)
    # (moment, kind, label, detail, steps, others): the stretch that ends at the moment.
    moments: list[tuple[int | None, str, str, str, tuple, tuple]] = []
    if p_done is not None and decode_critical:
        p_start = next((p.start_ts for p in pre_parts if p.kind == "queued"), None)
        ran = f" ({fmt_dur(p_done - p_start)} from its queue to its last chunk)" if p_start is not None else ""
        moments.append((q_d, "arrived", "arrived → queued", "the decode server's tokenizer", (), ()))
        moments.append((None, "prefill", "prefill (in parallel)", f"the prefill server was done first{ran}", (), ()))
        detail = f"prealloc queue: waiting for a request row and {room.reserved_tokens} KV slots"
        if res is not None:
            detail += f"; the prefill's KV was ready {fmt_dur(max(0, res - p_done))} before"
        moments.append((res, "decode_queue", "decode queue", detail, (), ()))
        handover = "the pull started once the slots were reserved; the KV was waiting on the bootstrap port"
    else:
        where = "prefill server: "
        if pre_parts:
            first = pre_parts[0]
            moments.append((first.end_ts, "arrived", "arrived → queued", where + (first.detail or "tokenized"), (), ()))
        elif q_d is not None:
            moments.append((q_d, "arrived", "arrived → queued", "the decode server's tokenizer", (), ()))
        if res is not None and q_d is not None:
            detail = f"{fmt_dur(max(0, res - q_d))} in parallel: a request row and {room.reserved_tokens} KV slots"
            moments.append((None, "decode_queue", "decode queue", detail, (), ()))
        for p in pre_parts:
            if p.kind == "queued":
                moments.append((p.end_ts, "prefill_queue", "prefill queue", where + p.detail, p.steps, p.others))
            elif p in chunks:
                moments.append((p.end_ts, "prefill", p.label, where + p.detail, p.steps, p.others))
        handover = "first token sampled, KV copied out and offered on the bootstrap port, the pull answered"
    td = room.transfers.get("decode")
    if td is not None:
        moments.append((td.ts - int(td.ms * 1e6), "transfer", "handover", handover, (), ()))
        moments.append((td.ts, "transfer", "transfer", transfer_detail(td), (), ()))
    parts: list[TtftPart] = []
    prev = t0
    for ts, kind, label, detail, steps, others in moments:
        if partial and ts is not None and ts > end:
            break
        stop = prev if ts is None else min(max(ts, prev), end)  # None: off the critical path, no time of its own
        parts.append(TtftPart(kind, label, prev, stop, detail, steps, others))
        prev = stop
    if not partial:
        detail = "KV written into the reserved slots, the prefill's first token streamed back through the tokenizer"
        parts.append(TtftPart("first_token", "first token", prev, end, detail))
    elif prev < end:
        parts.append(TtftPart(_waiting_kind(room, r), "so far", prev, end, _waiting_for(room, r)))
    return TtftBreakdown(rid, t0, end, tuple(parts), partial)


def _waiting_kind(room: PDRoom, r) -> str:
    if r.queued_ts is None:
        return "arrived"
    if room.reserved_ts is None:
        return "decode_queue"
    return "transfer"


def _waiting_for(room: PDRoom, r) -> str:
    if r.queued_ts is None:
        return "not queued on the decode server yet"
    if room.reserved_ts is None:
        return "in the decode server's prealloc queue (waiting for KV slots)"
    if "decode" not in room.transfers:
        return "slots reserved; pulling its KV from the prefill server"
    return "KV received; installing"


def journey(state, rid: str) -> list[tuple[str, int, int, str]]:
    """A PD request's journey as (stage, start_ts, end_ts, detail), each stage as long as it really
    was (the decode queue and the prefill overlap in time: the TTFT parts count only the critical
    path), by start: decode queue, prefill queue, prefill, transfer (handover and wire), decode.
    `rid` may be either side's; [] when it is no PD request or its peer is not in the trace."""
    pd: PDJoin | None = getattr(state, "pd", None)
    room = pd.room_of(rid) if pd else None
    if room is None or room.decode_rid is None or room.prefill_rid is None:
        return []
    d, p = state.requests.get(room.decode_rid), state.requests.get(room.prefill_rid)
    if d is None or p is None:
        return []
    out: list[tuple[str, int, int, str]] = []
    if d.queued_ts is not None and room.reserved_ts is not None:
        out.append(("decode queue", d.queued_ts, room.reserved_ts, f"{room.reserved_tokens} KV slots reserved"))
    pre = state.ttft_parts(room.prefill_rid)
    chunks = [x for x in pre.parts if x.kind == "prefill" and x.steps] if pre is not None else []
    if pre is not None and chunks:
        q = next((x for x in pre.parts if x.kind == "queued"), None)
        if q is not None:
            out.append(("prefill queue", q.start_ts, q.end_ts, ""))
        out.append(("prefill", chunks[0].start_ts, chunks[-1].end_ts, f"{len(chunks)} chunk(s)"))
    td = room.transfers.get("decode")
    if td is not None:
        start = chunks[-1].end_ts if chunks else td.ts - int(td.ms * 1e6)
        if room.reserved_ts is not None:
            start = max(start, room.reserved_ts)
        out.append(("transfer", start, td.ts, transfer_detail(td)))
    runs = [e for e in d.timeline if e.kind == "decode"]
    if runs:
        steps = sum(e.count for e in runs)
        out.append(("decode", runs[0].ts, runs[-1].end_ts or runs[-1].ts, f"{steps} decode steps"))
    order = {s: i for i, s in enumerate(JOURNEY_STAGES)}
    out.sort(key=lambda x: (x[1], order[x[0]]))
    return out


def journey_line(state, rid: str) -> str:
    """The journey in one line: 'decode queue 0.4 ms → prefill queue 2 ms → prefill 40 ms → transfer
    1.2 ms (…) → decode 14 decode steps' ('' for no PD request)."""
    parts = []
    for stage, s, e, detail in journey(state, rid):
        text = f"{stage} {fmt_dur(max(0, e - s))}"
        if stage in ("transfer", "decode") and detail:
            text += f" ({detail})"
        parts.append(text)
    return " → ".join(parts)
