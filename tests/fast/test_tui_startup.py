"""The start-up screen says what the engine is doing (its phase and the phase's time) and where its
log is (issue #37 item 6). The phases come as `engine.phase` events through the controller's
progress callback, as a live Engine sends them; the folding is trace/startup.py's StartupProgress."""

from __future__ import annotations

import threading

from textual.widgets import Static
from tui_helpers import wait_for
from workbench.core.trace import events as ev
from workbench.core.trace.startup import StartupProgress, phase, report_phase, set_phase_sink
from workbench.tui.controller import EngineController
from workbench.tui.fmt import plain_text
from workbench.tui.startup import phase_lines

S = 10**9


class PhasedStart(EngineController):
    """Stands in for an engine's start (the point of the test is the screen): reports two phases,
    then waits until the test lets it go on, then fails the way an engine would."""

    def __init__(self, log_path: str):
        super().__init__(server_args={})
        self.log = log_path
        self.go_on = threading.Event()

    def start(self, progress):
        import time

        t = time.monotonic_ns()
        progress(ev.EnginePhase(ts=t - 3 * S, proc="engine", phase="model", detail="smollm2", log_path=self.log))
        progress(ev.EnginePhase(ts=t - 2 * S, proc="engine", phase="processes"))
        progress(ev.EnginePhase(ts=t - 1 * S, proc="scheduler", phase="weights", detail="SmolLM2-135M"))
        self.go_on.wait(30)
        progress(ev.EnginePhase(ts=time.monotonic_ns(), proc="engine", phase="failed", detail="boom"))
        raise RuntimeError("the scheduler process failed to start: boom")


async def test_starting_screen_names_the_phase_its_time_and_the_log(tmp_path):
    from workbench.tui.app import WorkbenchApp

    log = tmp_path / "engine.log"
    log.write_text("Loading weights: 40%|####\n")
    ctl = PhasedStart(str(log))
    app = WorkbenchApp(ctl, layout="grid")
    async with app.run_test(size=(120, 30)) as pilot:

        def text(widget_id: str) -> str:
            return plain_text(app.query_one(widget_id, Static).content, 110)

        await wait_for(lambda: "loading weights" in text("#startup-title"), 30)
        body = text("#startup-log")
        # on the screen, not only in the widget: the spinner once filled the box and hid it
        await pilot.pause()
        shown = app.query_one("#startup-log", Static).region
        assert shown.height >= len(body.splitlines()) and shown.y + shown.height <= app.size.height
        assert "▶ loading weights: SmolLM2-135M" in body
        assert "✓ preparing the model" in body and "✓ starting the scheduler and detokenizer processes" in body
        assert "· warming up" in body  # what is still to come
        assert f"log (weight loading, warnings, errors): {log}" in body.replace("\n", "")
        assert "Loading weights: 40%" in body  # the log's last line
        # the running phase's time moves while nothing else happens (it started a second before)
        first = float(body.split("SmolLM2-135M")[1].split()[0])
        assert first >= 1.0
        await wait_for(lambda: float(text("#startup-log").split("SmolLM2-135M")[1].split()[0]) >= first + 1, 10)

        ctl.go_on.set()
        await wait_for(lambda: "Could not start" in text("#startup-title"), 30)
        body = text("#startup-log")
        assert "✓ loading weights" in body and "✗ failed: boom" in body and str(log) in body.replace("\n", "")
        await pilot.press("q")


def test_startup_progress_folds_phases_and_their_times():
    sp = StartupProgress()
    for ts, name in [(0, "model"), (1, "processes"), (3, "weights"), (4, "kernels"), (6, "weights"), (7, "warmup")]:
        sp.apply(ev.EnginePhase(ts=ts * S, phase=name, log_path="/x.log" if ts == 0 else ""))
    sp.apply(ev.ReqArrived(ts=7 * S, rid="r"))  # other events are not its business
    assert sp.order() == ["model", "processes", "weights", "kernels", "warmup"]
    assert sp.current is not None and sp.current.name == "warmup" and not sp.done
    secs = {p.name: p.seconds for p in sp.phases}
    assert secs["weights"] == 2.0 and secs["kernels"] == 2.0 and secs["processes"] == 2.0  # weights: 3-4 and 6-7
    assert sp.current.elapsed(9 * S) == 2.0 and sp.log_path == "/x.log"
    sp.apply(ev.EnginePhase(ts=9 * S, phase="ready"))
    assert sp.done and sp.current is None and {p.name: p.seconds for p in sp.phases}["warmup"] == 2.0
    assert "▶" not in plain_text(phase_lines(sp, 10 * S))


def test_a_nested_phase_hands_back_to_the_one_it_interrupted():
    """What the kernel build does inside the warm-up (core/layers/cpu_ops._build)."""
    got: list[ev.EnginePhase] = []
    set_phase_sink(got.append)
    try:
        report_phase("weights", "m")
        with phase("kernels"):
            pass
    finally:
        set_phase_sink(None)
    assert [(e.phase, e.detail) for e in got] == [("weights", "m"), ("kernels", ""), ("weights", "m")]


def test_a_kernel_build_reports_the_kernels_phase(tmp_path, monkeypatch):
    """The real build path with a stand-in compiler (the point is the report, not the C)."""
    from workbench.core.layers import cpu_ops

    cc = tmp_path / "fake-cc"
    cc.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\ntouch "$2"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    got: list[ev.EnginePhase] = []
    set_phase_sink(got.append)
    try:
        report_phase("weights")
        cpu_ops._build(tmp_path / "kernels" / "lib.so")
    finally:
        set_phase_sink(None)
    assert [e.phase for e in got] == ["weights", "kernels", "weights"]
    assert (tmp_path / "kernels" / "lib.so").exists()


def test_the_engine_log_keeps_warnings_on_the_console(tmp_path, capsys):
    """The log file takes the `workbench` records, and a warning still reaches stderr where nothing
    else would print it (Python's last resort stops printing once any handler exists)."""
    import logging

    from workbench.core.engine_log import attach_log_file, detach_log_file

    root_handlers = logging.getLogger().handlers[:]
    logging.getLogger().handlers.clear()  # as in a script that never configured logging
    path = tmp_path / "e.log"
    handler = attach_log_file(str(path))
    try:
        logging.getLogger("workbench.core.test").warning("the pool is small")
    finally:
        detach_log_file(handler)
        logging.getLogger().handlers[:] = root_handlers
    assert "WARNING workbench.core.test: the pool is small" in path.read_text()
    assert "the pool is small" in capsys.readouterr().err
