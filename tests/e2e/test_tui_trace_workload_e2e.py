"""`workbench tui --workload mooncake.jsonl` on the real engine (default model, issue #37).

The TUI's own flags are parsed (`workbench tui`'s parser), its controller built by `make_controller`
and the app driven headless: the Mooncake trace's requests arrive at their scaled times with the
trace's prompt and output lengths, and requests whose hash_ids share leading blocks hit the radix
cache for those blocks (512 tokens each), while a request with blocks of its own hits nothing.
"""

from __future__ import annotations

import json

import pytest
from tui_helpers import wait_for

pytestmark = pytest.mark.timeout(400)

# (ms, input_length, output_length, hash_ids): rows 2 and 4 share block 0 with row 1 (row 4 also
# block 1); row 3 shares nothing.
ROWS = [
    (0, 700, 4, [0, 1]),
    (400, 650, 3, [0, 2]),
    (800, 300, 2, [5]),
    (1600, 1100, 4, [0, 1, 7]),
]


def _tui_args(argv):
    import argparse

    from workbench.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["tui", *argv])
    assert isinstance(args, argparse.Namespace)
    return args


async def test_tui_plays_a_mooncake_trace_on_the_real_engine_and_shared_blocks_hit_the_cache(tmp_path):
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.cli import make_controller

    trace = tmp_path / "mooncake_trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": h}) + "\n"
            for t, n, o, h in ROWS
        )
    )
    args = _tui_args(
        ["--workload", str(trace), "--time-scale", "2", "--chunked-prefill-size", "512", "--random-seed", "0"]
    )
    c = make_controller(args)
    assert c.workload.name == "mooncake mooncake_trace.jsonl"
    app = WorkbenchApp(c, layout="grid")
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(app.ready.is_set, 180)
        runner = c.runner
        assert type(runner).__name__ == "TraceRunner" and runner.time_scale == 2
        await wait_for(lambda: runner.completed + runner.failed == len(ROWS), 240)
        assert runner.failed == 0, runner.last_error
        assert "1/2 speed" in c.status() and "4/4 sent" in c.status()
        st = app.model.state
        await wait_for(lambda: sum(1 for r in st.requests.values() if r.done) >= len(ROWS), 30)
        mine = sorted((r for r in st.requests.values() if r.rid.startswith("mc-")), key=lambda r: r.arrival_ts or 0)
        assert [r.prompt_tokens for r in mine] == [n for _, n, _, _ in ROWS]
        assert [r.output_tokens for r in mine] == [o for _, _, o, _ in ROWS]
        cached = [r.cached_tokens for r in mine]
        # the trace's 1.6 s, stretched twice: no request is sent before its scaled arrival (a busy
        # machine may send one late, so only the span is checked)
        span = (mine[-1].arrival_ts - mine[0].arrival_ts) / 1e9
        assert span > 3.1, span
        await pilot.press("q")
    c.close()
    assert cached[0] == 0 and cached[2] == 0, cached  # blocks nobody had before
    assert 512 <= cached[1] < 520, cached  # block 0 (512 tokens), not its own block 2
    # blocks 0 and 1 as row 1 had them: its 700 prompt tokens (its block 1 was cut at 188 tokens)
    assert 700 <= cached[3] < 710, cached


def test_record_plays_a_mooncake_trace_on_a_simulated_deployment_at_its_own_rate(tmp_path, capsys):
    """`workbench record --simulate h100 --workload mooncake.jsonl`: the headless path. A simulated
    deployment takes the trace's own arrivals (time scale 1), on its simulated clock."""
    from workbench.core.trace.events import ReqArrived, ReqFinished
    from workbench.core.trace.recorder import read_trace

    from workbench.cli import main

    trace = tmp_path / "mooncake_trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": h}) + "\n"
            for t, n, o, h in ROWS
        )
    )
    out = tmp_path / "run.jsonl"
    rc = main(["record", "--simulate", "h100", "--model", "llama-3.1-8b", "--workload", str(trace), "-o", str(out)])
    assert rc == 0
    assert "played at real time" in capsys.readouterr().err
    _, events = read_trace(out)
    arrived = sorted(e.ts for e in events if isinstance(e, ReqArrived))
    assert [round((t - arrived[0]) / 1e9, 1) for t in arrived] == [0.0, 0.4, 0.8, 1.6]
    finished = {e.prompt_tokens: e for e in events if isinstance(e, ReqFinished)}
    assert sorted(finished) == sorted(n for _, n, _, _ in ROWS)
    assert [finished[n].completion_tokens for _, n, _, _ in ROWS] == [o for _, _, o, _ in ROWS]
    assert [finished[n].cached_tokens for _, n, _, _ in ROWS] == [0, 512, 0, 700]
