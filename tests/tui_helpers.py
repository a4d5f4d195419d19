"""Shared helpers for the TUI tests (replay fixture, polling)."""

from __future__ import annotations

import asyncio
import os

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "tui_trace.jsonl")


async def wait_for(pred, timeout: float = 10.0, interval: float = 0.02):
    """Poll `pred` instead of sleeping a fixed time."""
    end = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < end, "condition not met in time"
        await asyncio.sleep(interval)


def step_ts(replay, step: int) -> int:
    """Trace time of the batch.step with this id."""
    return next(e.ts for e in replay.events if type(e).__name__ == "BatchStep" and e.step == step)


def replay_app(path: str = FIXTURE, **kw):
    """A WorkbenchApp over a paused Replay of `path` (events released only by the test)."""
    from workbench.core.trace.replay import Replay
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.controller import ReplayController

    replay = Replay(path)
    ctl = ReplayController(replay, autoplay=False, title=os.path.basename(path))
    return WorkbenchApp(ctl, **kw), replay


async def show_at(app, pilot, replay, ts: int) -> None:
    """Release the replay up to trace time `ts` and redraw every panel from it."""
    await wait_for(app.ready.is_set)
    replay.advance_to(ts)
    app._tick()
    await pilot.pause()
    app.refresh_panels(force=True)
    await pilot.pause()
