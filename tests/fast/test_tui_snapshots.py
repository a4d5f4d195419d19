"""Snapshot tests: each panel rendered from the recorded fixture trace at a fixed point.

The clock is frozen: in replay mode the app's clock is the replay position,
which the test sets, so ages and latency windows come out the same every run.
Update after an intended change: `pytest tests/fast/test_tui_snapshots.py --snapshot-update`.
"""

from __future__ import annotations

import pytest
from tui_helpers import replay_app, show_at, step_ts

SIZE = (110, 30)
# Step 21: the long prompt's last chunk is done, two chats are prefilling/decoding, four
# shared-prefix requests have finished (so latency has numbers and the tree has its branches).
AT_STEP = 21
SELECT = "long-1"


def _run_before(step: int = AT_STEP):
    async def run_before(pilot):
        app = pilot.app
        await show_at(app, pilot, app.controller.replay, step_ts(app.controller.replay, step))

    return run_before


@pytest.mark.parametrize("panel", ["queues", "batch", "tree", "kv", "latency", "events", "detail"])
def test_panel_snapshot(snap_compare, panel):
    app, _ = replay_app(panels=[panel], select=SELECT)
    assert snap_compare(app, terminal_size=SIZE, run_before=_run_before())


def test_full_screen_snapshot(snap_compare):
    app, _ = replay_app(layout="grid", select=SELECT)
    assert snap_compare(app, terminal_size=(160, 48), run_before=_run_before())
