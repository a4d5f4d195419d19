"""End-to-end part of tests/fast/test_moe_trace.py (what starts processes, engines or servers, or loads the
reference model).

A mixture of experts in the trace: each step's `moe.routing` event against the step it belongs to,
the reducer's expert load against the events, and the tokens' routing against the model's router."""

from __future__ import annotations

import pytest
from pipeline_helpers import assert_no_kv_leak, assert_routing_counts_real_tokens, expert_totals, generate_traced
from tiny_models import make_tiny_family
from workbench.core.trace import events as ev
from workbench.core.trace.state import TraceState

from workbench import Engine

PROMPTS = [[5, 6, 7, 8, 9, 60, 61], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory):
    model_dir = make_tiny_family(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe", seed=7)
    with Engine(model_path=str(model_dir), dtype="float32", max_total_tokens=2048, show_progress=False) as engine:
        yield engine


@pytest.fixture(scope="module")
def moe_run(moe_engine):
    """The trace of three requests on the tiny MoE model, and their outputs."""
    outs, events = generate_traced(moe_engine, PROMPTS, GREEDY)
    return events, outs


def test_every_step_of_a_moe_model_says_where_its_tokens_went(moe_engine, moe_run):
    events, outs = moe_run
    steps = {(e.proc, e.step): e for e in events if isinstance(e, ev.BatchStep)}
    routes = [e for e in events if isinstance(e, ev.MoeRouting)]
    assert routes and len(routes) == len(steps)
    for r in routes:
        assert r.num_experts == 8 and r.top_k == 2 and r.layers == [0, 2]  # layer 1 is dense
        step = steps[(r.proc, r.step)]
        tokens = {s.rid: s.decode or s.computed for s in step.reqs}
        for row in r.counts:  # every token went to top_k experts in every sparse layer
            assert len(row) == 8 and sum(row) == 2 * sum(tokens.values())
        assert {x.rid for x in r.reqs} == set(tokens)
        for x in r.reqs:
            assert len(x.pairs) == 2
            for pairs in x.pairs:
                assert sum(pairs[1::2]) == 2 * tokens[x.rid] and all(0 <= e < 8 for e in pairs[0::2])
        for i in range(2):  # the requests' shares add up to the step's counts
            per_expert = [0] * 8
            for x in r.reqs:
                for e, n in zip(x.pairs[i][0::2], x.pairs[i][1::2]):
                    per_expert[e] += n
            assert per_expert == r.counts[i]
    # The reducer: totals over the steps, each request's own routing, and a snapshot that rebuilds them.
    state = TraceState()
    state.apply_many(events)
    load = state.experts
    assert load.present and load.steps == len(routes) and load.layers == [0, 2]
    assert load.total == [[sum(r.counts[i][e] for r in routes) for e in range(8)] for i in range(2)]
    assert load.last == routes[-1].counts
    rid = outs[2]["meta_info"]["id"]
    mine = load.request(rid)
    assert [sum(row) for row in mine] == [2 * (len(PROMPTS[2]) + GREEDY["max_new_tokens"] - 1)] * 2
    fresh = TraceState()
    fresh.apply_many(state.snapshot_events())
    assert fresh.experts.total == load.total and fresh.experts.request(rid) == mine
    assert_no_kv_leak(moe_engine)


def test_routing_under_graph_replay_is_the_real_rows_routing(moe_run, tmp_path_factory):
    """Decode steps replayed from graphs (the CPU stand-in of CUDA graphs, padded to a bucket of 4):
    the routing the trace gets is the graph's static copy, cut to the real rows: each event counts
    its step's tokens, the experts' totals equal the eager run's, and so do the tokens."""
    eager_events, eager_outs = moe_run
    model_dir = make_tiny_family(tmp_path_factory.mktemp("moe_g") / "qwen3_moe", "qwen3_moe", seed=7)
    with Engine(
        model_path=str(model_dir),
        dtype="float32",
        max_total_tokens=2048,
        show_progress=False,
        cuda_graph_stand_in=True,
        cuda_graph_bs=[4],
    ) as engine:
        outs, events = generate_traced(engine, PROMPTS, GREEDY)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in eager_outs]
    graphed = {e.step for e in events if isinstance(e, ev.BatchStep) and e.cuda_graph}
    assert graphed  # decode steps of 1-3 requests padded to 4

    assert_routing_counts_real_tokens(events, top_k=2)
    # per expert over the run: the steps may batch differently (arrival timing)
    assert expert_totals(events) == expert_totals(eager_events)


async def test_the_experts_panel_appears_and_shades_exactly_the_routed_experts(moe_run, tmp_path):
    """A Pilot run over the recording: the panel joins the layout with the first routing event, and
    its last-step map has a shaded cell exactly where that step's event counted tokens."""
    from tui_helpers import replay_app, wait_for
    from workbench.core.trace.recorder import Recorder
    from workbench.tui.panels.experts import SHADES

    events, outs = moe_run
    path = tmp_path / "moe.jsonl"
    with Recorder(path, model="tiny-qwen3-moe") as rec:
        rec.write_batch(events)
    app, replay = replay_app(str(path), layout="grid")
    async with app.run_test(size=(200, 50)) as pilot:
        await wait_for(app.ready.is_set)
        assert "experts" not in app.panels  # nothing routed yet: a dense-looking screen
        # events come from several processes: the last drained need not be the latest
        replay.advance_to(max(x.ts for x in events))
        app._tick()
        await wait_for(lambda: "experts" in app.panels and app.panels["experts"].panel_ready)
        app.model.selected = outs[1]["meta_info"]["id"]
        app.refresh_panels(force=True)
        await pilot.pause()
        body = str(app.query_one("#experts-body").render())
        last = [e for e in events if isinstance(e, ev.MoeRouting)][-1]
        lines = body.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("last step"))
        for layer, counts, line in zip(last.layers, last.counts, lines[start + 1 : start + 3]):
            cells = line[len(f"L{layer:<3}") :][: len(counts)]
            assert [c != SHADES[0] for c in cells] == [n > 0 for n in counts], (line, counts)
        assert f"{outs[1]['meta_info']['id']}'s tokens" in body


def test_the_experts_widget_draws_every_map_of_the_trace(moe_run):
    from workbench.widgets import ExpertsView

    events, outs = moe_run
    view = ExpertsView(events)
    state = view.feed.state
    hm = view.figure.data[0]
    assert [list(r) for r in hm.z] == state.experts.total and list(hm.y) == ["L0", "L2"]
    rid = outs[0]["meta_info"]["id"]
    assert rid in view.which.options and "all steps" in view.which.options
    view.which.value = rid  # a user picks one request: the map becomes its tokens
    assert [list(r) for r in view.figure.data[0].z] == state.experts.request(rid)
    assert "request" in view.figure.layout.title.text
    view.which.value = "last step"
    assert [list(r) for r in view.figure.data[0].z] == state.experts.last
