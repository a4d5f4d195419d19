"""The guided tour (`workbench tui --tour`, what `make run` starts) on the real default model, in
the real TUI (Textual Pilot): it stops six times, in order (waiting, admission, chunked prefill,
radix hit, eviction, retraction), pauses the scheduler at each, says what happened, and goes on
at `n`. Each stop's event is checked in the engine's own trace (a bus subscriber of this test's,
not what the app folded): the stop names a step, and that step really holds the event."""

from __future__ import annotations

import asyncio

import pytest
from tui_helpers import wait_for
from workbench.core.trace import events as ev
from workbench.tui.tour import STOPS

from workbench.scenarios import get_scenario

pytestmark = pytest.mark.timeout(900)


def _happened(name: str, step: int, events: list) -> bool:
    """The trace holds stop `name`'s event at scheduler step `step`."""
    at = [e for e in events if e.step == step]
    decisions = [e for e in at if isinstance(e, ev.StepDecision)]
    scheduled = [e for e in at if isinstance(e, ev.ReqScheduled)]
    if name == "waiting":
        return any(d.waiting > 0 for d in decisions)
    if name == "admission":
        return any(d.admitted for d in decisions) and bool(scheduled)
    if name == "chunk":
        return any(s.num_chunks > 1 for s in scheduled)
    if name == "hit":
        return any(s.prefix_hit > 0 for s in scheduled)
    if name == "evict":
        return any(isinstance(e, ev.CacheEvict) and e.tokens > 0 for e in at)
    if name == "retract":
        return any(isinstance(e, ev.ReqRetracted) for e in at)
    raise AssertionError(name)


def _where(k: int, app, controller, trace: list) -> str:
    """What a stop that never came leaves to read: the stops shown, the guide's next, the pause, the
    workload, the last step and how many of each case the trace holds."""
    from workbench.scenarios import runner_status

    steps = [e.step for e in trace if isinstance(e, ev.BatchStep)]
    decisions = [e for e in trace if isinstance(e, ev.StepDecision)]
    runner = getattr(controller, "_runner", None)
    engine = controller.engine
    procs = {role: ("alive" if p.is_alive() else f"dead ({p.exitcode})") for role, p in engine.procs.items()}
    errors = [line.text for line in app.model.log.lines if line.category == "error"][-3:]
    return (
        f"stop {k} never came: shown {[(s.index, s.name, s.step) for s in app.tour_shown]}, guide next "
        f"{app.tour.next_name!r}, queued {len(app._tour_queue)}, controller paused {controller.paused}, "
        f"workload {runner_status(runner) if runner is not None else None}, last step {max(steps, default=-1)}, "
        f"decisions {len(decisions)} (waiting {sum(1 for d in decisions if d.waiting)}, evicted "
        f"{sum(1 for d in decisions if d.evicted)}, retracted {sum(1 for d in decisions if d.retracted)}), "
        f"trace events {len(trace)}, processes {procs}, last errors {errors}"
    )


async def test_the_tour_stops_at_six_events_that_really_happened():
    from workbench.core.args import ServerArgs
    from workbench.core.engine import Engine
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.controller import EngineController

    scn = get_scenario("tour")
    engine = await asyncio.to_thread(Engine, server_args=scn.server_args(ServerArgs(show_progress=False)))
    trace: list = []
    handle = engine.bus.subscribe_callback(trace.extend, name="test-tour")
    try:
        controller = EngineController(engine, scenario=scn)
        app = WorkbenchApp(controller, layout="grid", tour=True)
        async with app.run_test(size=(160, 48)) as pilot:
            await wait_for(app.ready.is_set, 120)
            steps = []
            for k, (name, title) in enumerate(STOPS, 1):
                try:
                    await wait_for(lambda k=k: len(app.tour_shown) == k, 240, interval=0.1)
                except AssertionError:
                    raise AssertionError(_where(k, app, controller, trace)) from None
                stop = app.tour_shown[-1]
                assert (stop.index, stop.name) == (k, name)
                # the scheduler is paused at the stop: no step runs while the line is read
                await wait_for(lambda: controller.paused, 60)
                await pilot.pause(0.5)
                last = max((e.step for e in trace if isinstance(e, ev.BatchStep)), default=-1)
                await pilot.pause(1.5)
                assert max(e.step for e in trace if isinstance(e, ev.BatchStep)) == last, f"steps ran at stop {k}"
                banner = str(app.query_one("#tour").render())
                assert f"tour {k}/6 · {title}" in banner and f"step {stop.step}" in banner, banner
                assert _happened(name, stop.step, trace), f"stop {k} ({name}) at step {stop.step}: not in the trace"
                steps.append(stop.step)
                await pilot.press("n")
                if k < len(STOPS):
                    await wait_for(lambda: not controller.paused or len(app.tour_shown) > k, 60)
            assert steps == sorted(steps)
            # a minute on a busy 2-core machine is about 40-60 steps: every case well within that
            assert steps[-1] <= 60, steps
            banner = str(app.query_one("#tour").render())
            assert "tour done" in banner, banner
    finally:
        handle.close()
        await asyncio.to_thread(engine.shutdown)
