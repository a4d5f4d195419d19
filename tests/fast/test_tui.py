"""TUI tests without an engine: replay of the recorded fixture, synthetic traces, the CLI.

The end-to-end tests of this module are in tests/e2e/test_tui_e2e.py.
"""

from __future__ import annotations

import argparse

import pytest
from synthetic import synthetic_trace
from textual.widgets import DataTable, Input, RichLog, Static
from tui_helpers import FIXTURE, replay_app, show_at, step_ts, wait_for
from workbench.core.trace import events as ev
from workbench.core.trace.replay import Replay
from workbench.core.trace.state import TraceState
from workbench.core.trace.views import TreeNodeView
from workbench.tui.fmt import plain_text
from workbench.tui.model import TuiModel

PANELS = ("queues", "batch", "tree", "kv", "latency", "events", "detail", "experts")


def test_model_log_and_reset():
    m = TuiModel()
    m.apply(synthetic_trace(n_requests=4))
    cats = {line.category for line in m.log.lines}
    assert {"arrive", "finish", "proc"} <= cats
    finished = [line for line in m.log.lines if line.category == "finish"]
    assert len(finished) == 4 and all("TTFT" in line.text for line in finished)
    v, e = m.version, m.epoch
    m.apply([ev.TraceReset(ts=1, proc="replay")])
    assert m.epoch == e + 1 and m.version == v + 1 and not m.log.lines and not m.state.requests


def _big_tree(n_shared: int = 50, per: int = 80, now: int = 10**12) -> dict[int, TreeNodeView]:
    """root -> n_shared prefixes -> `per` leaves each; prefix 0 holds a locked (hot) leaf."""
    tree = {0: TreeNodeView(0, -1, 0)}
    nid = 1
    for i in range(n_shared):
        p = nid
        tree[p] = TreeNodeView(p, 0, 32, f"system prompt {i}", last_access=now - 120 * 10**9)
        tree[0].children.append(p)
        nid += 1
        for j in range(per):
            hot = i == 0 and j == 0
            tree[nid] = TreeNodeView(
                nid, p, 8, f"q{i}.{j}", lock_ref=1 if hot else 0, last_access=now if hot else now - 100 * 10**9
            )
            tree[p].children.append(nid)
            nid += 1
    return tree


def test_tree_render_stays_bounded_and_folds_cold_subtrees():
    from workbench.tui.panels.tree import render_tree

    now = 10**12
    tree = _big_tree(now=now)
    assert len(tree) == 1 + 50 * 81
    text, lines = render_tree(tree, now, max_lines=400, max_children=12)
    plain = text.plain
    assert lines <= 401
    # the hot path is expanded: the locked leaf is visible with its lock count
    assert "“q0.0” 8t lock 1" in plain
    # cold prefixes fold into one line each, and the surplus children are summarized
    assert "80 cold below" in plain
    assert "38 colder subtrees" in plain
    # a highlighted cold leaf is unfolded even though it is cold
    target = next(n.node_id for n in tree.values() if n.text == "q7.5")
    text2, _ = render_tree(tree, now, highlight={target}, max_children=12)
    assert "“q7.5”" in text2.plain and "“q7.5”" not in plain


def test_tree_shared_prefix_from_fixture():
    from workbench.tui.panels.tree import render_tree

    st = TraceState()
    st.apply_many(Replay(FIXTURE).events)
    shared = [n for n in st.tree.values() if len(n.children) >= 3]
    assert shared, "the four shared-prefix requests branch off one node"
    plain = render_tree(st.tree, st.last_ts)[0].plain
    assert f"[{len(shared[0].children)} children]" in plain


async def test_replay_step_key_releases_exactly_one_step():
    app, replay = replay_app(panels=["batch"])
    ids = [e.step for e in replay.events if type(e) is ev.BatchStep]
    async with app.run_test(size=(120, 30)) as pilot:
        await wait_for(app.ready.is_set)
        for k in range(3):
            await pilot.press("s")
            await wait_for(lambda: app.control_results == k + 1)
            await pilot.pause()
            assert [s.step for s in app.model.state.steps] == ids[: k + 1]
            assert app.last_step_result == ids[k]
            table = app.query_one("#batch-table", DataTable)
            assert table.row_count == k + 1
            assert str(table.get_row_at(k)[0]) == str(ids[k])
        assert app.controller.paused


async def test_queue_table_matches_trace_state():
    app, replay = replay_app(panels=["queues"])
    async with app.run_test(size=(120, 30)) as pilot:
        await show_at(app, pilot, replay, step_ts(replay, 21))
        st = app.model.state
        table = app.query_one("#queues-table", DataTable)
        # waiting (and new) first, so a long running list cannot push them off-screen
        extra = st.unlisted()
        in_queues = (
            st.waiting
            + [r.rid for r in extra if r.state == "queued"]
            + [r.rid for r in extra if r.state == "arrived"]
            + st.chunked
            + [r for r in st.running if r not in st.chunked]
        )
        rows = [table.get_row_at(i) for i in range(table.row_count)]
        assert [str(r[1]) for r in rows][: len(in_queues)] == in_queues
        for row in rows:
            r = st.requests[str(row[1])]
            assert (str(row[3]), str(row[4]), str(row[5]), str(row[6])) == (
                str(r.prompt_tokens),
                str(r.cached_tokens),
                str(r.computed_tokens),
                str(r.output_tokens),
            )


async def test_selection_keys_detail_and_events_filter():
    app, replay = replay_app(layout="grid")
    async with app.run_test(size=(160, 48)) as pilot:
        await show_at(app, pilot, replay, replay.end_ns)
        await pilot.press("right_square_bracket")
        rid = app.model.selected
        assert rid in app.model.state.requests
        await pilot.pause()
        detail = plain_text(app.query_one("#detail-body", Static).content, 100)
        r = app.model.state.requests[rid]
        assert detail.startswith(rid) and f"prompt {r.prompt_tokens} t" in detail and "timeline" in detail
        # filter the events log
        await pilot.press("f")
        assert isinstance(app.focused, Input)
        await pilot.press(*"finish")
        await pilot.pause()
        log = app.query_one("#events-log", RichLog)
        text = "\n".join(line.text for line in log.lines)
        assert text.count("finished") == 7 and "arrived" not in text
        await pilot.press("escape")
        assert not isinstance(app.focused, Input)


async def test_help_layout_and_tabs():
    app, replay = replay_app(layout="tabs")
    async with app.run_test(size=(100, 30)) as pilot:
        await show_at(app, pilot, replay, replay.end_ns)
        await pilot.press("question_mark")
        await pilot.pause()
        from workbench.tui.help import HelpScreen

        assert isinstance(app.screen, HelpScreen)
        body = plain_text(app.screen.query_one("#help-body", Static).content, 120)
        for title in ("Queues", "Batch composition", "Radix tree", "KV pool", "Latency", "Events", "Request detail"):
            assert title in body
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        assert list(app.visible_panels()) == ["queues"]
        await pilot.press("3")
        await pilot.pause()
        assert list(app.visible_panels()) == ["tree"]
        await pilot.press("l")
        await pilot.pause()
        assert app.layout_mode == "grid" and set(app.visible_panels()) == set(PANELS) - {
            "experts"
        }  # experts: only once a MoE routes


async def test_256_in_flight_and_a_big_tree_stay_bounded():
    # 300 requests, up to 256 decoding at once; the app folds and renders them.
    events = synthetic_trace(n_requests=300, max_running=256, chunk_size=512, kv_total=10**6)
    replay = Replay(events)
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.controller import ReplayController

    app = WorkbenchApp(ReplayController(replay, autoplay=False), layout="grid")
    peak = max((len(e.running) for e in events if type(e) is ev.QueueState), default=0)
    assert peak >= 200
    at = next(e.ts for e in events if type(e) is ev.QueueState and len(e.running) == peak)
    async with app.run_test(size=(160, 48)) as pilot:
        await show_at(app, pilot, replay, at)
        st = app.model.state
        assert len(st.running) == peak
        table = app.query_one("#queues-table", DataTable)
        assert table.row_count == len(st.chunked) + len(st.running) + len(st.waiting) + min(
            8, sum(r.done for r in st.requests.values())
        )
        # one tick after more events only updates what changed
        replay.advance_to(at + 10**9)
        app._tick()
        await pilot.pause()
        assert table.row_count <= 300 + 8


async def test_startup_error_is_a_message_not_a_traceback():
    from workbench.core.model_loader.errors import ModelLoadError
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.controller import EngineController

    class BadEngine(EngineController):
        def start(self, progress):
            progress("loading /nope/model.gguf")
            raise ModelLoadError("no model at /nope/model.gguf: pass a GGUF file or an HF directory")

    app = WorkbenchApp(BadEngine(server_args={}), layout="grid")
    async with app.run_test(size=(120, 30)) as pilot:
        await wait_for(lambda: app.startup_error is not None)

        def startup_log() -> str:
            return plain_text(app.query_one("#startup-log", Static).content, 110)

        # The error is drawn on the app's next tick, which a busy machine can delay.
        await wait_for(lambda: "no model at" in startup_log(), 30)
        body = startup_log()
        assert "no model at /nope/model.gguf" in body and "Traceback" not in body and "press q" in body.lower()
        await pilot.press("q")
    assert app.return_code in (0, None)


async def test_a_broken_plugin_panel_does_not_take_the_app_down():
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.controller import ReplayController
    from workbench.tui.panels.base import TracePanel
    from workbench.tui.registration import register_builtin

    from workbench.plugins import PluginRegistry

    class Exploding(TracePanel):
        PANEL_NAME = "boom"

        def update_view(self, model):
            raise RuntimeError("kaput")

    reg = PluginRegistry()
    register_builtin(reg)
    reg.add_panel("boom", "Boom", Exploding)
    reg.add_panel("broken", "Broken", lambda: 1 / 0)
    app = WorkbenchApp(
        ReplayController(Replay(FIXTURE), autoplay=False),
        registry=reg,
        panels=["queues", "boom", "broken"],
        layout="grid",
    )
    async with app.run_test(size=(120, 30)) as pilot:
        await show_at(app, pilot, app.controller.replay, app.controller.replay.end_ns)
        assert "boom" in app._broken_panels
        errors = [line.text for line in app.model.log.lines if line.category == "error"]
        assert any("kaput" in e for e in errors)
        assert app.query_one("#queues-table", DataTable).row_count > 0


@pytest.mark.parametrize("how", ["q", "ctrl+c", "harness"])
async def test_every_way_out_closes_the_controller(how):
    app, replay = replay_app(panels=["kv"])
    closed = []
    app.controller.close = lambda: closed.append(True)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(app.ready.is_set)
        if how != "harness":
            await pilot.press(how)
            await wait_for(lambda: closed)
    assert closed and all(closed)


async def test_attach_to_a_remote_trace_stream():
    from workbench.core.trace.bus import TraceBus
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.controller import AttachController

    bus = TraceBus("tcp://127.0.0.1:*", publish_addr="tcp://127.0.0.1:*", model="smol")
    events = synthetic_trace(n_requests=5)
    app = WorkbenchApp(AttachController(bus.publish_endpoint), panels=["queues", "events"], layout="grid")
    try:
        async with app.run_test(size=(120, 30)) as pilot:
            await wait_for(lambda: app.ready.is_set() and bus.listener_count == 1)
            bus.publish_batch(events)
            await wait_for(lambda: app.model.state.counters.num_requests_total == 5)
            await pilot.pause()
            assert app.model.state.model == "smol"
            assert app.controller.status().startswith("ATTACHED tcp://127.0.0.1:")
            table = app.query_one("#queues-table", DataTable)
            # the finished requests, once the panel's next refresh has drawn them
            await wait_for(lambda: table.row_count == 5)
            await pilot.press("p")  # no controls when attached: a warning, nothing else
            await pilot.press("q")
        await wait_for(lambda: bus.listener_count == 0)
    finally:
        bus.close()


def test_cli_replay_of_a_missing_file_is_a_clear_error(capsys):
    from workbench.tui.cli import add_tui_args, run_tui

    p = argparse.ArgumentParser()
    add_tui_args(p)
    assert run_tui(p.parse_args(["--replay", "/nonexistent/run.jsonl"])) == 2
    assert "no such trace file" in capsys.readouterr().err


def test_unknown_panel_is_rejected():
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.controller import ReplayController

    with pytest.raises(ValueError, match="unknown panel"):
        WorkbenchApp(ReplayController(Replay(FIXTURE)), panels=["nope"])


async def test_tabs_layout_mounts_every_panel():
    # Small terminals get one tab per panel; the tabs must mount and switch like the grid.
    from textual.widgets import TabbedContent
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.controller import ReplayController

    app = WorkbenchApp(ReplayController(Replay(FIXTURE), autoplay=False), layout="tabs")
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        tabs = app.query_one("#tabs", TabbedContent)
        assert len(app.panels) >= 5
        assert len(app.visible_panels()) == 1
        second = list(app.panels)[1]
        tabs.active = f"tab-{second}"
        await pilot.pause()
        assert list(app.visible_panels()) == [second]


def _dp_events():
    """Two data-parallel replicas: the controller's dispatches and each replica's own queue."""
    from workbench.core.trace import events as ev

    t = 1_000_000_000
    out = []
    for i, (rid, rank) in enumerate((("a", 0), ("b", 1), ("c", 1))):
        out += [
            ev.ReqArrived(ts=t + i, proc="tokenizer", rid=rid),
            ev.ReqDispatched(
                ts=t + 10 + i, proc="dp_controller", rid=rid, dp_rank=rank, method="round_robin", loads=[1, 2]
            ),
        ]
    out += [
        ev.QueueState(ts=t + 100, proc="scheduler.dp0", waiting=[], running=["a"], chunked=[]),
        ev.QueueState(ts=t + 101, proc="scheduler.dp1", waiting=["c"], running=["b"], chunked=[]),
    ]
    return out


async def test_queues_panel_names_each_requests_replica_under_data_parallelism():
    from workbench.core.trace.replay import Replay
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.controller import ReplayController
    from workbench.tui.panels.queues import QueuesPanel

    replay = Replay(_dp_events())
    app = WorkbenchApp(ReplayController(replay, autoplay=False, title="dp"), panels=["queues"])
    async with app.run_test(size=(140, 30)) as pilot:
        await show_at(app, pilot, replay, replay.end_ns)
        table = app.query_one("#queues-table", DataTable)
        await wait_for(lambda: table.row_count == 3)
        labels = {str(table.get_row_at(i)[1]): str(table.get_row_at(i)[0]) for i in range(3)}
        assert labels == {"a": "running@dp0", "b": "running@dp1", "c": "waiting@dp1"}
        title = str(app.query_one(QueuesPanel).border_title)
        assert "dp0 0w/1r" in title and "dp1 1w/1r" in title
