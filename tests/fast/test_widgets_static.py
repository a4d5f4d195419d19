"""Static pictures (widgets/static.py), the KV axis and the queue chart's waiting line, on synthetic traces.

A snapshot must draw what TraceState says (every Gantt span, every batch segment, every
tree node with its state and locks) as well-formed SVG that a notebook keeps in its
outputs; the KV chart's axis is the pool's capacity; the waiting line counts requests
the scheduler has queued (or the tokenizer has) before a queue.state lists them.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
from synthetic import synthetic_trace
from workbench.core.trace import events as ev
from workbench.core.trace.palette import PALETTE
from workbench.core.trace.state import TraceState
from workbench.widgets import data as D
from workbench.widgets.static import STATIC_VIEWS, snapshot

SVG = "{http://www.w3.org/2000/svg}"


def fold(events) -> TraceState:
    st = TraceState()
    for e in events:
        st.apply(e)
    return st


def parse(snap) -> ET.Element:
    """The snapshot's HTML must be well-formed XML (it is inline SVG in a div): parse it whole."""
    return ET.fromstring(snap.html())


def elems(root: ET.Element, view: str, tag: str, cls: str) -> list[ET.Element]:
    svg = next(e for e in root.iter(f"{SVG}svg") if e.get("data-view") == view)
    return [e for e in svg.iter(f"{SVG}{tag}") if e.get("class") == cls]


# ---- the KV axis ---------------------------------------------------------------------------------


def test_kv_axis_is_the_pool_capacity():
    """126 of 4096 used must look like 3 %, not like a full pool: the axis is the capacity."""
    pytest.importorskip("plotly")
    pytest.importorskip("ipywidgets")
    from workbench.widgets import KVPoolView

    events = synthetic_trace(n_requests=6, seed=1, kv_total=4096)
    st = fold(events)
    k = D.kv_data(st, D.time_origin(st))
    assert max(u + e for u, e in zip(k.used, k.evictable)) < 4096 * 0.2  # a mostly free pool
    assert D.kv_axis_range(k) == (0, 4096)
    view = KVPoolView(events)
    try:
        assert tuple(view.figure.layout.yaxis.range) == (0, 4096)
    finally:
        view.close()
    assert D.kv_axis_range(D.KVData()) == (0, 1)  # nothing yet: still a range
    root = parse(snapshot(st, ("kv",)))
    svg = next(root.iter(f"{SVG}svg"))
    assert svg.get("data-capacity") == "4096"
    labels = [t.text for t in svg.iter(f"{SVG}text")]
    assert "4096" in labels  # the top of the axis says it


# ---- the waiting line ------------------------------------------------------------------------------


def test_waiting_line_counts_requests_before_a_queue_state_lists_them():
    """Each step admits everything, so every queue.state lists nobody waiting; the line must
    still rise while a request is new (arrived) and then queued, and fall when it is admitted."""
    st = fold(
        [
            ev.QueueState(ts=10, proc="scheduler", waiting=[], running=[], chunked=[]),
            ev.ReqArrived(ts=20, proc="tokenizer", rid="a"),
            ev.ReqArrived(ts=21, proc="tokenizer", rid="b"),
            ev.ReqQueued(ts=30, proc="scheduler", rid="a", prompt_tokens=5, queue_len=1),
            ev.ReqScheduled(ts=40, proc="scheduler", rid="a", prefix_hit=0, extend_len=5),
            ev.QueueState(ts=41, proc="scheduler", waiting=[], running=["a"], chunked=[]),
            ev.ReqAborted(ts=50, proc="tokenizer", rid="b"),
        ]
    )
    q = D.queue_data(st, 0)
    assert list(zip(q.waiting, q.new, q.running)) == [
        (0, 0, 0),
        (0, 1, 0),
        (0, 2, 0),
        (1, 1, 0),  # arrived, arrived, a queued
        (0, 1, 1),  # a admitted; b still only at the tokenizer
        (0, 0, 1),
    ]  # b aborted before the scheduler saw it
    assert q.t == sorted(q.t)


def test_waiting_line_on_a_synthetic_run_is_never_stuck_at_zero():
    """On the simulated run, at every request's queued moment the line shows it waiting."""
    events = synthetic_trace(n_requests=8, seed=3, chunk_size=24, max_running=3, kv_total=300)
    st = fold(events)
    q = D.queue_data(st, 0)
    for e in events:
        if isinstance(e, ev.ReqQueued):
            i = max(j for j, t in enumerate(q.t) if t <= e.ts / 1e9)
            assert q.waiting[i] >= 1, e.rid
    assert max(q.new) >= 1  # arrivals show before the scheduler queues them
    assert q.waiting[-1] == 0 and q.new[-1] == 0  # and all drained at the end


# ---- the pictures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run():
    events = synthetic_trace(n_requests=8, seed=3, chunk_size=24, max_running=3, kv_total=300)
    return events, fold(events)


def test_snapshot_draws_every_gantt_span_and_mark(run):
    _, st = run
    t0 = D.time_origin(st)
    g = D.gantt_data(st, t0)
    root = parse(snapshot(st, ("gantt",), t0=t0))
    spans = elems(root, "gantt", "rect", "span")
    assert [(s.get("data-rid"), s.get("data-kind")) for s in spans] == [(s.rid, s.kind) for s in g.spans]
    assert all(float(s.get("width")) >= 1.5 for s in spans)
    for s in spans:
        assert (
            s.get("fill")
            == {"queued": PALETTE["waiting"], "prefill": PALETTE["computed"], "decode": PALETTE["decode"]}[
                s.get("data-kind")
            ]
        )
    marks = [e for e in root.iter() if e.get("class") == "mark"]
    assert sorted((m.get("data-rid"), m.get("data-mark")) for m in marks) == sorted((r, k) for r, _, k in g.marks)
    # later spans start further right: x follows time
    first_q = {s.get("data-rid"): float(s.get("x")) for s in spans if s.get("data-kind") == "queued"}
    arrivals = sorted(st.requests.values(), key=lambda r: r.arrival_ts)
    xs = [first_q[r.rid] for r in arrivals]
    assert xs == sorted(xs) and xs[0] < xs[-1]


def test_snapshot_batch_segments_are_the_step_tokens(run):
    _, st = run
    b = D.batch_data(st)
    segs = elems(parse(snapshot(st, ("batch",))), "batch", "rect", "seg")
    got: dict[tuple[int, str], int] = {
        (int(s.get("data-step")), s.get("data-kind")): int(s.get("data-tokens")) for s in segs
    }
    want = {
        (step, kind): v
        for i, step in enumerate(b.steps)
        for kind, v in (("cached", b.cached[i]), ("computed", b.computed[i]), ("decode", b.decode[i]))
        if v
    }
    assert got == want and want
    # the tallest stack fills the axis up to a round top, never past the plot
    assert min(float(s.get("y")) for s in segs) >= 40 - 0.01


def test_snapshot_tree_nodes_states_and_locks():
    """Every node with its state; a node locked by a running request shows its lock count."""
    nodes = [
        ev.TreeNode(0, -1, 0, "", 1, 0, 1),
        ev.TreeNode(1, 0, 20, "System: be brief", 2, 3, 2),
        ev.TreeNode(2, 1, 7, "What is a cache?", 0, 1, 3),
        ev.TreeNode(3, 1, 9, "What is a page?", 1, 0, 4),
        ev.TreeNode(4, 0, 30, "Rivers rivers fact", 0, 0, 5),
    ]
    st = fold(
        [
            ev.CacheTree(ts=10, proc="scheduler", nodes=nodes, evictable_size=37, protected_size=29),
            ev.CacheEvict(ts=11, proc="scheduler", node_ids=[4], tokens=30),
        ]
    )
    root = parse(snapshot(st, ("radix",), name="locked"))
    assert root.get("data-name") == "locked" and root.get("data-evicted") == "30"
    rects = {r.get("data-node"): r for r in elems(root, "radix", "rect", "node")}
    assert set(rects) == {"0", "1", "2", "3", "4"}
    states = {n: r.get("data-state") for n, r in rects.items()}
    assert states == {"0": "root", "1": "locked", "2": "hit", "3": "locked", "4": "evicted"}
    assert {n: r.get("data-parent") for n, r in rects.items() if n != "0"} == {"1": "0", "2": "1", "3": "1", "4": "0"}
    assert rects["1"].get("fill") == PALETTE["locked"] and rects["4"].get("fill") == PALETTE["evicted"]
    texts = [t.text or "" for t in root.iter(f"{SVG}text")]
    assert any("[lock 2]" in t for t in texts)
    # width follows the tokens under a node: node 1 (20 + 7 + 9) is wider than node 4 (30)
    assert float(rects["1"].get("width")) > float(rects["4"].get("width"))
    assert float(rects["2"].get("width")) + float(rects["3"].get("width")) < float(rects["1"].get("width"))


def test_snapshot_caption_is_the_header_and_the_narrated_step(run):
    _, st = run
    snap = snapshot(st, STATIC_VIEWS, name="end")
    root = parse(snap)
    assert [e.get("data-view") for e in root.iter(f"{SVG}svg")] == list(STATIC_VIEWS)
    caption = " ".join(snap.caption)
    assert f"finished {len(st.requests)}" in caption
    assert st.last_step_line and st.last_step_line in caption
    assert "workbench-snapshot" in snap._repr_html_() and "end" in repr(snap)
    with pytest.raises(ValueError, match="static views"):
        snapshot(st, ("latency",))
    empty = parse(snapshot(TraceState(), STATIC_VIEWS))  # nothing yet: still pictures, no error
    assert len(list(empty.iter(f"{SVG}svg"))) == len(STATIC_VIEWS)


def test_dashboard_snapshot_and_stop_keep_the_picture(run, tmp_path):
    pytest.importorskip("plotly")
    pytest.importorskip("ipywidgets")
    from workbench.widgets import Dashboard

    events, st = run
    dash = Dashboard(events)
    try:
        snap = dash.snapshot(name="all")
        assert list(snap.svgs) == ["gantt", "batch", "radix", "kv", "queues"]  # its views that have one
        spans = elems(parse(snap), "gantt", "rect", "span")
        assert len(spans) == len(D.gantt_data(st, D.time_origin(st)).spans)
        tree = dash["radix"].snapshot()
        assert list(tree.svgs) == ["radix"]
        dash.stop()
        assert dash.comm is not None and dash["gantt"].figure.data[0].x  # still on the page, with data
        snap.save(tmp_path / "all.html")
        assert "workbench-snapshot-gantt" in (tmp_path / "all.html").read_text()
    finally:
        dash.close()
    assert dash.comm is None
