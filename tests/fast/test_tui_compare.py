"""`workbench tui --compare schedule_policy=fcfs,lpm` (issue #40 Build 4): two simulated engines on one
seeded arrival stream and one clock, side by side. The workload has 4 shared 160-token prefixes and
arrives faster than a 4-request running limit serves it, so requests queue; from then on fcfs admits
the oldest waiting request whatever its prefix while lpm takes one whose prefix is already cached."""

from __future__ import annotations

import argparse

import pytest
from textual.widgets import DataTable, Static
from tui_helpers import wait_for
from workbench.core.simulation.compare import SimPair, compare_workload, parse_compare
from workbench.core.trace.compare import admitted, ttft_cdf
from workbench.tui.compare import CompareApp, SimCompareSource
from workbench.tui.fmt import plain_text

N = 10  # requests: enough for a queue and a first divergence, quick to simulate twice


def _pair() -> SimPair:
    return SimPair("schedule_policy", ["fcfs", "lpm"], workload=compare_workload(n=N, seed=0), seed=0)


def test_parse_compare_takes_any_engine_setting_and_says_what_to_write():
    assert parse_compare("schedule-policy=fcfs,lpm") == ("schedule_policy", ["fcfs", "lpm"])
    assert parse_compare("chunked_prefill_size=256,2048") == ("chunked_prefill_size", [256, 2048])
    assert parse_compare("disable_radix_cache=true,false") == ("disable_radix_cache", [True, False])
    with pytest.raises(ValueError, match="two values"):
        parse_compare("schedule_policy=fcfs")
    with pytest.raises(ValueError, match="not an engine setting"):
        parse_compare("schedule_polcy=fcfs,lpm")


def test_one_clock_both_sides_stand_at_the_same_simulated_instant():
    pair = _pair()
    for _ in range(60):
        pair.step()
        # every action due by the shared clock was taken on both sides, none beyond it
        for side in pair.sides:
            assert side.next_t is None or side.next_t > pair.now
            assert side.sim.clock.now <= pair.now + 1.0  # a step started by now ends within its length
    a, b = (pair.sides[i].sim for i in range(2))
    assert a.seed == b.seed and a.args.schedule_policy == "fcfs" and b.args.schedule_policy == "lpm"


async def test_compare_app_shows_both_policies_their_diff_and_ttft_cdfs():
    pair = _pair()
    app = CompareApp(SimCompareSource(pair, rate=0))  # as fast as this host can
    async with app.run_test(size=(200, 60)) as pilot:
        await wait_for(lambda: pair.done, timeout=120)
        await pilot.pause(0.3)
        app._fold(force=True)
        await pilot.pause()
        fcfs, lpm = (m.state for m in app.models)
        # both served every request of the one arrival stream
        assert sum(r.finish_ts is not None for r in fcfs.requests.values()) == N
        assert sum(r.finish_ts is not None for r in lpm.requests.values()) == N

        # the first step where the policies differ: lpm admits a request whose prefix is cached,
        # fcfs the oldest waiting one, which is another
        assert app.diff.lines, "the policies never admitted differently"
        step, line = app.diff.lines[0]
        sa = next(sv for sv in fcfs.steps if sv.step == step)
        sb = next(sv for sv in lpm.steps if sv.step == step)
        (rid_a, cached_a), (rid_b, cached_b) = admitted(sa)[0], admitted(sb)[0]
        assert rid_a != rid_b and cached_b > cached_a
        assert int(rid_a[1:]) < int(rid_b[1:])  # fcfs took the older one
        assert (
            line == f"step {step}: fcfs admitted {rid_a} ({cached_a} cached) · lpm admitted {rid_b} ({cached_b} cached)"
        )
        shown = plain_text(app.query_one("#diff", Static).render(), width=200)
        assert app.diff.lines[-1][1] in shown  # the panel lists the newest differences

        # each stack shows its own decision at that step: the step's row in each Batch panel
        for i, (sv, rid, other) in enumerate(((sa, rid_a, rid_b), (sb, rid_b, rid_a))):
            table = app.query_one(f"#batch-{i}").query_one(DataTable)
            row = " ".join(str(c) for c in table.get_row(f"{sv.proc}:{sv.step}:{sv.ts}"))
            assert rid in row and other not in row
        queues = [app.query_one(f"#queues-{i}").query_one(DataTable) for i in range(2)]
        assert all(q.row_count > 0 for q in queues)

        # the TTFT CDFs: each side's N first tokens as its simulator timed them; the order changed them
        xa, ya = ttft_cdf(fcfs)
        xb, yb = ttft_cdf(lpm)
        assert len(xa) == len(xb) == N and ya[-1] == yb[-1] == 1.0 and ya[0] == 1 / N
        for xs, side in ((xa, pair.sides[0]), (xb, pair.sides[1])):
            assert xs == pytest.approx(sorted(side.sim.result.ttft.values()), abs=1e-6)
        assert xa != pytest.approx(xb, abs=1e-6)
        cdf = plain_text(app.query_one("#ttft-cdf", Static).render())
        assert "● fcfs" in cdf and "○ lpm" in cdf and cdf.count("p50") == 2
        await pilot.press("q")


def test_cli_compare_flags_build_a_simulated_pair():
    from workbench.core.args import ServerArgs
    from workbench.tui.cli import add_tui_args
    from workbench.tui.compare import make_compare_source

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    add_tui_args(p)
    src = make_compare_source(
        p.parse_args(
            ["--compare", "chunked-prefill-size=256,2048", "--max-running-requests", "8", "--compare-requests", "5"]
        )
    )
    assert isinstance(src, SimCompareSource) and len(src.pair.workload) == 5
    assert [s.sim.args.chunked_prefill_size for s in src.pair.sides] == [256, 2048]
    assert all(s.sim.args.max_running_requests == 8 for s in src.pair.sides)
    with pytest.raises(ValueError, match="FLAG=VALUE_A,VALUE_B"):
        make_compare_source(p.parse_args(["--compare", "schedule_policy"]))


def test_dashboard_compare_draws_both_sides_the_diff_and_the_cdfs():
    from workbench.widgets.dashboard import Dashboard

    cmp = Dashboard.compare("schedule_policy=fcfs,lpm", requests=N)
    assert cmp.diff_lines == [] and "no first tokens yet" in cmp.cdf_box.value
    cmp.advance(60)  # past the first step where they differ (step 39 on this workload)
    first = cmp.diff_lines[0]
    assert first.startswith("step ") and "fcfs admitted r" in first and "lpm admitted r" in first
    assert "(0 cached)" in first.split(" · ")[0] and "(160 cached)" in first.split(" · ")[1]
    assert html_escape(first) in cmp.diff_box.value
    cmp.run()
    cdf = cmp.cdf()
    assert set(cdf) == {"fcfs", "lpm"} and all(len(xs) == N for xs, _ in cdf.values())
    assert 'class="cdf-fcfs"' in cmp.cdf_box.value and 'class="cdf-lpm"' in cmp.cdf_box.value
    for i, side in enumerate(("fcfs", "lpm")):
        assert f"data-side='{side}'" in cmp.sides[i].value and "<svg" in cmp.sides[i].value
    assert "done" in cmp.header.value


def html_escape(s: str) -> str:
    import html

    return html.escape(s)


async def test_compare_app_pauses_and_steps_both_sides_on_the_shared_clock():
    pair = _pair()
    app = CompareApp(SimCompareSource(pair, rate=0, paused=True))
    async with app.run_test(size=(160, 50)) as pilot:
        await pilot.pause(0.3)
        assert pair.now == pair.workload[0].arrival and not app.models[0].state.steps  # paused: nothing ran
        for _ in range(3):
            before = (pair.now, sum(len(m.state.steps) for m in app.models))
            await pilot.press("s")
            await pilot.pause()
            # a step: the side that is behind took its next action (the clock moved, or a step ran at
            # the same instant), and neither side has anything due by the shared clock
            assert (pair.now, sum(len(m.state.steps) for m in app.models)) > before
            assert all(side.next_t > pair.now for side in pair.sides)
        assert all(m.state.steps for m in app.models) and app.source.paused
        await pilot.press("p")  # runs on
        await wait_for(lambda: pair.done, timeout=120)
        await pilot.press("q")


def test_cli_compare_real_builds_two_engines_one_setting_apart():
    from workbench.core.args import ServerArgs
    from workbench.tui.cli import add_tui_args
    from workbench.tui.compare import RealCompareSource, make_compare_source

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    add_tui_args(p)
    src = make_compare_source(p.parse_args(["--compare", "schedule_policy=fcfs,lpm", "--real", "--rate", "3"]))
    try:
        assert isinstance(src, RealCompareSource) and src.labels == ["fcfs", "lpm"]
        assert [c._server_args.schedule_policy for c in src.controllers] == ["fcfs", "lpm"]
        # the workload starts on both once both are up (neither gets a head start)
        assert src.workload == "shared-prefix" and src.workload_rate == 3
        assert all(c.workload is None and c.rate == 3 for c in src.controllers)
    finally:
        src.close()  # nothing started: closing is a no-op
