"""The plugin host, as a third party meets it: a real (tiny) installed distribution.

The `plugin_dir` fixture (tests/conftest.py) copies the modules in tests/data/plugins plus
their `*.dist-info` (METADATA + entry_points.txt in group `workbench.plugins`) into a temporary
directory and puts that directory on sys.path, which is all `importlib.metadata` needs to find it. The plugin adds a
TUI panel, a Jupyter view and a workload; two more entry points are broken (one
raises inside `register`, one names a module that does not exist).

The end-to-end tests of this module are in tests/e2e/test_plugins_e2e.py.
"""

from __future__ import annotations

import asyncio

import pytest
from synthetic import synthetic_trace
from workbench.core.trace.replay import Replay

from workbench.plugins import load_plugins

EVENTS = synthetic_trace(n_requests=5, seed=2)


def test_plugin_contributions_show_up_and_broken_ones_are_skipped(plugin_dir):
    reg = load_plugins(reload=True)
    info = {p.name: p for p in reg.plugins}
    ok = info["reqcount"]
    assert ok.error is None and ok.distribution == "wb-reqcount" and ok.module == "wb_reqcount:register"
    assert sorted(ok.contributed) == ["panel:reqcount", "policy:shortest-first", "view:reqcount", "workload:countdown"]
    assert reg.panels["reqcount"].plugin == reg.views["reqcount"].plugin == "reqcount"
    assert reg.workloads["countdown"].factory().requests()[0] == "count down from 3"
    assert "RuntimeError: boom" in info["broken"].error
    assert "ModuleNotFoundError" in info["ghost"].error and info["ghost"].distribution == "wb-broken"
    # the built-ins went through the same door and are all still there
    assert info["builtin"].error is None
    assert {"gantt", "batch", "radix", "kv", "queues", "latency", "dashboard"} <= set(reg.views)
    assert all(reg.views[n].plugin == "builtin" for n in ("gantt", "radix", "dashboard"))


def test_plugin_view_joins_the_dashboard(plugin_dir):
    pytest.importorskip("plotly")
    load_plugins(reload=True)
    from workbench.widgets import Dashboard

    d = Dashboard(EVENTS, views=["gantt", "reqcount"])
    try:
        assert d["reqcount"].value == "<b>5</b> requests seen"
        d.slider.value = 0  # replay back to the first step
        assert d["reqcount"].value == f"<b>{len(d.state.requests)}</b> requests seen"
        assert len(d.state.requests) < 5
    finally:
        d.close()
    # the registry's factories for built-in views work on their own, too
    reg = load_plugins()
    view = reg.views["batch"].factory(EVENTS)
    assert sum(view.figure.data[2].y) == sum(s.decode_tokens for s in view.feed.state.steps) > 0


def test_plugin_workload_is_accepted_by_the_runner(plugin_dir):
    load_plugins(reload=True)
    from workbench.tui.workload import WorkloadRunner

    runner = WorkloadRunner(None, kind="countdown")  # unknown kinds raise ValueError
    assert next(runner._prompts) == "count down from 3"
    with pytest.raises(ValueError):
        WorkloadRunner(None, kind="no-such-workload")


async def test_plugin_panel_is_mounted_and_fed_in_the_tui(plugin_dir):
    pytest.importorskip("textual")
    reg = load_plugins(reload=True)
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.controller import ReplayController

    ctl = ReplayController(Replay(EVENTS), autoplay=False)
    ctl.seek_end()  # every event released up front
    app = WorkbenchApp(ctl, panels=["queues", "reqcount"], registry=reg, layout="grid")
    async with app.run_test(size=(120, 40)) as pilot:
        panel = app.panels["reqcount"]
        loop = asyncio.get_running_loop()
        end = loop.time() + 10
        while panel.last_text != "5 requests seen":
            assert loop.time() < end, f"panel never updated: {panel.last_text!r}"
            await pilot.pause(0.05)
        assert panel.border_title == "Request count"


def test_a_plugin_policy_is_selectable_and_unknown_names_say_where_to_look(plugin_dir):
    from types import SimpleNamespace

    from workbench.core.args import ServerArgs
    from workbench.core.managers.schedule_policy import SchedulePolicy

    load_plugins(reload=True)
    assert ServerArgs(schedule_policy="shortest-first").schedule_policy == "shortest-first"
    with pytest.raises(ValueError, match="registered by a plugin.*workbench plugins"):
        ServerArgs(schedule_policy="no-such-policy")
    policy = SchedulePolicy("shortest-first", None, True)
    queue = [SimpleNamespace(origin_input_ids=[0] * n) for n in (5, 2, 9)]
    policy.calc_priority(queue)
    assert [len(r.origin_input_ids) for r in queue] == [2, 5, 9]


def test_cli_says_which_builtin_parts_did_not_load(monkeypatch):
    import workbench.builtin_plugins as builtin
    from workbench.plugins import PluginRegistry

    real_import = __import__

    def fake_import(name, *a, **kw):
        if name == "workbench.widgets.registration":
            raise ImportError("No module named 'ipywidgets'")
        return real_import(name, *a, **kw)

    reg = PluginRegistry()
    monkeypatch.setattr("builtins.__import__", fake_import)
    builtin.register(reg)
    monkeypatch.undo()
    assert reg.missing == [("workbench.widgets.registration", "ImportError: No module named 'ipywidgets'")]
    assert "fcfs" in reg.policies and "tree" in reg.panels
