"""Disaggregated serving in the trace picture (issue #38 item 4): a prefill server's and a decode
server's traces joined by bootstrap room; the decode side's TTFT split along the journey (decode
queue, prefill queue, prefill, handover, transfer, first token), summing exactly to the TTFT; the
journey in order; the same parts in the Dashboard's data layer."""

from __future__ import annotations

from workbench.core.trace import events as ev
from workbench.core.trace.pd import journey, journey_line
from workbench.core.trace.state import TraceState
from workbench.widgets.data import gantt_data, request_details

MS = 1_000_000
P, D = "scheduler.dp0", "scheduler.dp1"  # as MultiAttachController names the two servers
ROOM = 4242


def _pair(reserve_at: int = 3, prefill_start: int = 10, chunk_ms: tuple[int, ...] = (20,), first_token_at=None):
    """Events of one request through a 1P1D pair (ms since 0): the prefill side 'r1.p', the decode
    side 'r1' (the client's). `reserve_at` after the prefill is done shows a full decode server."""
    out: list[ev.Event] = []
    add = out.append
    # both tokenizers get the request at once (the router sends it to both)
    for rid, proc, tok in (("r1.p", P, "tokenizer.w0"), ("r1", D, "tokenizer.w1")):
        add(ev.ReqArrived(ts=0, proc=tok, rid=rid, prompt_preview="hello"))
        add(ev.ReqTokenized(ts=1 * MS, proc=tok, rid=rid, prompt_tokens=40, max_new_tokens=8))
        add(ev.PDBootstrap(ts=2 * MS, proc=proc, rid=rid, room=ROOM, role="prefill" if proc == P else "decode"))
        add(ev.ReqQueued(ts=2 * MS, proc=proc, rid=rid, prompt_tokens=40, queue_len=1))
    # the prefill server: an unrelated decode step while r1.p waits, then its chunks
    add(
        ev.BatchStep(
            ts=9 * MS,
            proc=P,
            step=1,
            mode="decode",
            reqs=[ev.StepReq("other", decode=1)],
            batch_size=1,
            padded_size=1,
            schedule_ms=0.5,
            forward_ms=4.0,
        )
    )
    t, n = prefill_start, len(chunk_ms)
    for k, dur in enumerate(chunk_ms):
        step = 2 + k
        add(
            ev.ReqScheduled(
                ts=t * MS, proc=P, step=step, rid="r1.p", prefix_hit=0, extend_len=40 // n, chunk_index=k, num_chunks=n
            )
        )
        t += dur
        add(
            ev.BatchStep(
                ts=t * MS,
                proc=P,
                step=step,
                mode="extend",
                reqs=[ev.StepReq("r1.p", computed=40 // n, chunk_index=k, num_chunks=n)],
                batch_size=1,
                padded_size=1,
                schedule_ms=0.0,
                forward_ms=float(dur),
            )
        )
    prefill_done = t
    add(ev.ReqFirstToken(ts=(t + 1) * MS, proc="tokenizer.w0", rid="r1.p"))
    # the decode server: reservation, the pull (waits for the prefill, then 3 ms of bytes), install
    add(ev.PDReserved(ts=reserve_at * MS, proc=D, rid="r1", room=ROOM, tokens=40))
    pulled = max(prefill_done + 2, reserve_at + 1) + 3
    xfer = dict(room=ROOM, tokens=40, nbytes=40 * 30 * 1024, ms=3.0, wait_ms=float(pulled - 3 - reserve_at))
    add(ev.PDTransfer(ts=pulled * MS, proc=D, rid="r1", role="decode", **xfer))
    add(ev.PDTransfer(ts=(pulled + 1) * MS, proc=P, rid="r1.p", role="prefill", **xfer))
    add(ev.ReqScheduled(ts=(pulled + 1) * MS, proc=D, rid="r1", prefix_hit=0, extend_len=0))
    ft = first_token_at if first_token_at is not None else pulled + 4
    add(ev.ReqFirstToken(ts=ft * MS, proc="tokenizer.w1", rid="r1"))
    for k in range(3):
        add(
            ev.BatchStep(
                ts=(ft + 5 + 5 * k) * MS,
                proc=D,
                step=10 + k,
                mode="decode",
                reqs=[ev.StepReq("r1", decode=1)],
                batch_size=1,
                padded_size=1,
                forward_ms=4.0,
            )
        )
    return sorted(out, key=lambda e: e.ts)


def _state(events) -> TraceState:
    st = TraceState()
    st.apply_many(events)
    return st


def test_parts_sum_exactly_and_follow_the_journey():
    st = _state(_pair())
    assert st.pd.peer("r1") == "r1.p" and st.pd.peer("r1.p") == "r1"
    assert st.pd.role("r1") == "decode" and st.pd.role_label(P) == "prefill" and st.pd.role_label(D) == "decode"
    b = st.ttft_parts("r1")
    r = st.requests["r1"]
    assert not b.partial
    assert sum(p.ns for p in b.parts) == b.ttft_ns == r.first_token_ts - r.arrival_ts
    assert [p.label for p in b.parts] == [
        "arrived → queued",
        "decode queue",
        "prefill queue",
        "prefill",
        "handover",
        "transfer",
        "first token",
    ]
    for a, c in zip(b.parts, b.parts[1:]):  # contiguous, none negative
        assert a.end_ts == c.start_ts and a.ns >= 0
    dq = b.parts[1]  # the reservation ran in parallel with the prefill, which was the critical path
    assert dq.ns == 0 and dq.detail.startswith("1.0 ms in parallel")
    q = next(p for p in b.parts if p.kind == "prefill_queue")
    assert "prefill server" in q.detail and "passed over by 1 step" in q.detail and q.steps == (1,)
    t = next(p for p in b.parts if p.label == "transfer")
    assert t.ns == 3 * MS and "40 tokens" in t.detail and "1.2 MB" in t.detail
    stages = [s for s, *_ in journey(st, "r1")]
    assert stages == ["decode queue", "prefill queue", "prefill", "transfer", "decode"]
    assert journey(st, "r1.p") == journey(st, "r1")  # either side's rid finds the same journey
    assert "transfer 5.0 ms (40 tokens" in journey_line(st, "r1")  # handover 2 ms + 3 ms on the wire
    # the reservation and both ends of the transfer are on the timelines
    assert [e.kind for e in r.timeline if e.kind in ("reserved", "transfer")] == ["reserved", "transfer"]
    assert any(e.kind == "transfer" and "sent" in e.detail for e in st.requests["r1.p"].timeline)
    # the prefill side keeps its own (one server's) breakdown
    assert [p.kind for p in st.ttft_parts("r1.p").parts] == ["arrived", "queued", "prefill", "first_token"]


def test_a_full_decode_server_reserves_after_the_prefill():
    """The critical path: slots reserved after the prefill was done put the decode queue on it, and
    the prefill off it (a part of no time that says how long it ran in parallel)."""
    st = _state(_pair(reserve_at=45, chunk_ms=(10, 12)))
    b = st.ttft_parts("r1")
    assert sum(p.ns for p in b.parts) == b.ttft_ns
    assert [p.label for p in b.parts] == [
        "arrived → queued",
        "prefill (in parallel)",
        "decode queue",
        "handover",
        "transfer",
        "first token",
    ]
    par = b.parts[1]
    assert par.ns == 0 and "30 ms from its queue to its last chunk" in par.detail
    dq = b.parts[2]
    assert dq.ns == 43 * MS and "ready 13 ms before" in dq.detail
    # the journey keeps each stage's real length, by start
    j = journey(st, "r1")
    assert [s for s, *_ in j] == ["decode queue", "prefill queue", "prefill", "transfer", "decode"]
    assert j[0][2] - j[0][1] == 43 * MS and j[2][2] - j[2][1] == 22 * MS


def test_in_flight_and_clamped_parts_still_sum():
    events = _pair()
    # still pulling: no decode-side transfer, install or first token yet
    cut = [e for e in events if not (e.proc == D and isinstance(e, (ev.PDTransfer, ev.ReqScheduled, ev.BatchStep)))]
    cut = [e for e in cut if not (isinstance(e, (ev.ReqFirstToken, ev.PDTransfer)) and e.rid.startswith("r1"))]
    st = _state([*cut, ev.ReqArrived(ts=40 * MS, proc="tokenizer.w1", rid="r2")])  # the trace goes on
    b = st.ttft_parts("r1")
    assert b.partial and sum(p.ns for p in b.parts) == b.ttft_ns
    assert b.parts[-1].label == "so far" and "pulling" in b.parts[-1].detail
    # a first token stamped before the transfer's moment (another clock): clamped, still exact
    st = _state(_pair(first_token_at=20))
    b = st.ttft_parts("r1")
    assert sum(p.ns for p in b.parts) == b.ttft_ns == 20 * MS
    assert all(p.ns >= 0 for p in b.parts)


def test_the_dashboard_shows_the_journey():
    """The widgets' data layer (what the Gantt tooltips and a click on a request show)."""
    st = _state(_pair())
    d = request_details(st, "r1")
    assert d["ttft_parts"][0].startswith("TTFT ")
    assert any(ln.split(" ", 2)[2].startswith("decode queue") for ln in d["ttft_parts"][1:])
    assert any("transfer: 40 tokens" in ln for ln in d["ttft_parts"])
    assert d["pd"]["role"] == "decode" and d["pd"]["peer"] == "r1.p"
    assert d["pd"]["journey"].startswith("decode queue")
    g = gantt_data(st, 0)
    assert any("prefill queue" in ln for ln in g.ttft["r1"])
