"""The guided tour's logic and its pauses in the app, on a recording of the `tour` scenario on the
default model (tests/data/tour_trace.jsonl: `record_run` of get_scenario("tour") until an eviction
and a retraction were seen). The live run on the real model is tests/e2e/test_tour_e2e.py."""

from __future__ import annotations

import os

from tui_helpers import wait_for
from workbench.core.trace import events as ev
from workbench.core.trace.recorder import load_trace
from workbench.core.trace.replay import Replay
from workbench.tui.tour import STOPS, TourGuide

TOUR_TRACE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "tour_trace.jsonl")


def _happened(name: str, step: int, events: list) -> bool:
    at = [e for e in events if e.step == step]
    if name == "waiting":
        return any(isinstance(e, ev.StepDecision) and e.waiting > 0 for e in at)
    if name == "admission":
        return any(isinstance(e, ev.StepDecision) and e.admitted for e in at)
    if name == "chunk":
        return any(isinstance(e, ev.ReqScheduled) and e.num_chunks > 1 for e in at)
    if name == "hit":
        return any(isinstance(e, ev.ReqScheduled) and e.prefix_hit > 0 for e in at)
    if name == "evict":
        return any(isinstance(e, ev.CacheEvict) and e.tokens > 0 for e in at)
    return any(isinstance(e, ev.ReqRetracted) for e in at)


def test_the_guide_finds_six_stops_in_order_each_at_its_event():
    events = load_trace(TOUR_TRACE)
    guide = TourGuide()
    stops = []
    for i in range(0, len(events), 37):  # fed in arbitrary slices, as the app drains them
        stops += guide.feed(events[i : i + 37])
    assert [s.name for s in stops] == [n for n, _ in STOPS] and guide.done
    assert [s.step for s in stops] == sorted(s.step for s in stops)
    for s in stops:
        assert _happened(s.name, s.step, events), s
        assert s.banner().startswith(f"tour {s.index}/6 · {s.title} (step {s.step}): ")
    assert guide.feed(events) == []  # done: nothing more


def test_a_stop_is_only_looked_for_after_the_previous_one():
    events = load_trace(TOUR_TRACE)
    first_evict = next(e.step for e in events if isinstance(e, ev.StepDecision) and e.evicted)
    retraction = next(e for e in events if isinstance(e, ev.StepDecision) and e.retracted)
    guide = TourGuide()
    # a retraction before any eviction was seen: the tour waits for the eviction stop first
    got = guide.feed([e for e in events if e.step < first_evict] + [retraction])
    assert [s.name for s in got] == ["waiting", "admission", "chunk", "hit"]
    got = guide.feed([e for e in events if e.step >= first_evict])
    assert [s.name for s in got] == ["evict", "retract"]


async def test_the_app_pauses_at_each_stop_and_n_goes_on():
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.controller import ReplayController

    replay = Replay(TOUR_TRACE)
    ctl = ReplayController(replay, autoplay=True, speed=16.0)
    app = WorkbenchApp(ctl, tour=True, layout="tabs")
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for(app.ready.is_set)
        for k, (name, title) in enumerate(STOPS, 1):
            await wait_for(lambda k=k: len(app.tour_shown) == k, 30)
            await wait_for(lambda: ctl.paused)
            banner = str(app.query_one("#tour").render())
            assert f"tour {k}/6 · {title}" in banner and "n: " in banner, banner
            assert "n next stop" in " ".join(str(c.render()) for c in app.query("FooterKey"))
            await pilot.press("n")
            await pilot.pause()
        assert "tour done" in str(app.query_one("#tour").render())
        assert not ctl.paused
