"""End-to-end part of tests/fast/test_trace_clock.py (what starts processes, engines or servers, or loads the
reference model).

The trace's clock (core/trace/clock.py): the host's monotonic clock by default; a simulated
deployment's `SharedClock`, which stands still until moved, moves by exactly what it is told, runs at a
rate (stopping at an announced arrival), is held by an arriving request, and reads the same from
another process. A tracer stamps with whichever clock the process installed."""

from __future__ import annotations

import subprocess
import sys

import pytest
from workbench.core.trace import clock as trace_clock


@pytest.fixture
def shared(tmp_path):
    c = trace_clock.SharedClock(str(tmp_path / "clock"), create=True)
    yield c
    c.close()


def test_another_process_reads_the_same_time(shared):
    shared.advance(777)
    expected = shared.now_ns()
    code = (
        "import sys; from workbench.core.trace import clock as c; c.attach(sys.argv[1]); "
        "print(c.now_ns(), c.current().simulated); c.current().note_sent()"
    )
    out = subprocess.run([sys.executable, "-c", code, shared.path], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(expected), "True"]
    assert shared.sent() == 1
