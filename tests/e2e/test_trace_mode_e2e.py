"""End-to-end part of tests/fast/test_trace_mode.py (what starts processes, engines or servers, or loads the
reference model).

`--trace-mode`: auto (emit while something listens), on (always), off (never).

The bus folds everything it receives into its own TraceState (what late subscribers get as a
snapshot), so whether the pipeline emitted while nobody listened is visible afterwards.
"""

from __future__ import annotations

import pytest
from pipeline_helpers import drain_events
from workbench.core.trace.events import ReqFinished, ReqSnapshot

SP = {"max_new_tokens": 3, "temperature": 0.0}


def _finished_rids(events) -> set[str]:
    return {e.rid for e in events if isinstance(e, ReqFinished)} | {
        e.rid for e in events if isinstance(e, ReqSnapshot) and e.state == "finished"
    }


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_trace_mode_on_emits_with_nobody_listening_and_auto_does_not(mode):
    from workbench.core.engine import Engine

    with Engine(show_progress=False, max_total_tokens=2048, trace_mode=mode) as engine:
        out = engine.generate("The radix tree", SP)
        rid = out["meta_info"]["id"]
        trace_ms = engine.get_internal_state()["trace_ms"]
        sub = engine.subscribe(with_snapshot=True, name="late")
        try:
            # The scheduler's ReqFinished travels its own socket and may trail generate()'s return.
            seen = _finished_rids(
                drain_events(sub, until=lambda evs: rid in _finished_rids(evs), timeout=15.0 if mode == "on" else 2.0)
            )
        finally:
            sub.close()
        assert (rid in seen) == (mode == "on")
        # The scheduler times its own traced sections (what `bench trace` reports); auto mode
        # with nobody listening never enters one.
        assert (trace_ms > 0) == (mode == "on")


def test_trace_mode_off_emits_nothing_even_to_a_subscriber():
    from workbench.core.engine import Engine

    with Engine(show_progress=False, max_total_tokens=2048, trace_mode="off") as engine:
        sub = engine.subscribe(with_snapshot=False, name="watcher")
        try:
            out = engine.generate("The radix tree", SP)
            assert out["meta_info"]["completion_tokens"] == 3
            events = [e for e in [sub.get(timeout=1.0)] if e is not None] + sub.drain()
        finally:
            sub.close()
        assert not [e for e in events if getattr(e, "rid", None) == out["meta_info"]["id"]]
        assert engine.get_internal_state()["trace_ms"] == 0


def test_bench_trace_quick_prints_every_mode_and_its_accounted_cost(capsys):
    from workbench.cli import main

    assert main(["bench", "trace", "--quick", "--rounds", "1", "--max-total-tokens", "4096"]) == 0
    out = capsys.readouterr().out
    accounted = out[out.index("accounted cost") :]
    for mode in ("auto, idle", "on, idle", "busy"):
        line = next(l for l in accounted.splitlines() if l.startswith(mode))
        shares = [float(x.rstrip("%")) for x in line[len(mode) :].split()]
        assert len(shares) == 3 and all(x >= 0 for x in shares)
        if mode == "auto, idle":
            assert shares[0] == 0.0  # tracers disabled: the scheduler never enters a traced section
        else:
            assert shares[0] > 0.0
