"""`workbench tui`: argument parsing and the entry point (the main CLI wires these in).

workbench tui --tour                                                # the guided tour (make run)
workbench tui [--model PATH] [--scenario kv-pressure]              # live engine, a demo running
workbench tui [--workload shared-prefix --rate 2]                   # ... or a fixed-rate workload
workbench tui --workload mooncake_trace.jsonl [--time-scale 20]      # ... or a production trace
workbench tui --attach tcp://127.0.0.1:5557                         # watch `serve --trace-publish`
workbench tui --attach tcp://127.0.0.1:5557 tcp://127.0.0.1:5558    # ... several: a router's workers, a PD pair
workbench tui --disaggregation [--scenario chat]                    # a 1P1D pair in this process
workbench tui --disaggregation 2P4D --simulate h100 --model llama-3.1-70b --tp-size 8   # simulated xPyD
workbench tui --replay run.jsonl [--speed 4]                        # play a recording
workbench tui --compare schedule_policy=fcfs,lpm [--real]           # two engines side by side, one clock
workbench tui --pause-on retract,evict                              # pause when one happens (any source)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator

LAYOUTS = ("auto", "grid", "tabs")
#: what a simulated deployment runs when no workload is named (issue #40 item 11)
SIMULATED_DEFAULT_SCENARIO = "kv-pressure"


def add_tui_args(parser: argparse.ArgumentParser) -> None:
    """The TUI's own flags (engine flags come from ServerArgs.add_cli_args)."""
    from workbench.tui.workload import KINDS

    g = parser.add_argument_group("TUI")
    src = g.add_mutually_exclusive_group()
    src.add_argument(
        "--attach",
        metavar="ADDR",
        nargs="+",
        default=None,
        help="watch a running `workbench serve --trace-publish ADDR` instead of starting an engine; "
        "several addresses (workers behind a router) are shown side by side as dp0, dp1, ...",
    )
    src.add_argument("--replay", metavar="FILE", default=None, help="play a recorded trace (.jsonl[.gz])")
    src.add_argument(
        "--disaggregation",
        nargs="?",
        const="1P1D",
        default=None,
        metavar="xPyD",
        help="a one-command demo of disaggregated serving: start a prefill and a decode server (1P1D) in "
        "this process behind a small PD router, both side by side, with the usual --scenario / --workload; "
        "with --simulate, a simulated deployment, which may be xPyD (e.g. --disaggregation 2P4D: servers "
        "picked round robin) (to watch a real pair: --attach PREFILL_ADDR DECODE_ADDR; docs/disaggregation.md)",
    )
    from workbench.scenarios import SCENARIOS

    demo = g.add_mutually_exclusive_group()
    demo.add_argument(
        "--scenario",
        choices=list(SCENARIOS),
        default=None,
        help="start a demo scenario at once: its engine settings (where you did not set the flag) "
        "and a workload whose rate adapts to this machine (docs/scenarios.md); "
        + "; ".join(f"{s.name}: {s.summary}" for s in SCENARIOS.values()),
    )
    demo.add_argument(
        "--tour",
        action="store_true",
        help="the guided tour (what `make run` starts): the `tour` scenario, pausing at each of six stops "
        "(waiting, admission, chunked prefill, radix hit, eviction, retraction) with a line on what just "
        "happened; n goes on (docs/tui.md)",
    )
    demo.add_argument(
        "--workload",
        metavar="KIND_OR_FILE",
        default=None,
        help=f"start this workload at once: a kind ({', '.join(KINDS)}) at a fixed rate (w toggles it, "
        "W cycles the kind), or a trace FILE played on this engine at a time scale that suits it "
        "(Mooncake JSONL, Azure or BurstGPT CSV, a workbench JSONL or a --record file; docs/simulation.md)",
    )
    g.add_argument(
        "--compare",
        metavar="FLAG=A,B",
        default=None,
        help="two engines one engine setting apart, side by side on one seeded arrival stream and one clock "
        "(e.g. schedule_policy=fcfs,lpm): Queues, Batch and tree for each, where their steps admitted "
        "differently, TTFT CDFs overlaid; simulated unless --real (docs/tui.md)",
    )
    g.add_argument(
        "--real",
        action="store_true",
        help="with --compare: two real engines (each runs the same seeded --workload at --rate on the host "
        "clock) instead of two simulated ones",
    )
    g.add_argument(
        "--compare-speed",
        type=float,
        default=10.0,
        help="with --compare (simulated): scheduler steps per second to show (+ and - change it; 0: as fast "
        "as this host can)",
    )
    g.add_argument(
        "--compare-requests",
        type=int,
        default=120,
        help="with --compare (simulated): how many requests the seeded arrival stream has (--rate: their "
        "rate per simulated second, default 100)",
    )
    g.add_argument(
        "--rate",
        type=float,
        default=None,
        help="workload requests per second (default 1; with --scenario the starting rate, which "
        "then adapts; + and - change it)",
    )
    from workbench.trace_runner import add_live_trace_args

    add_live_trace_args(g)
    g.add_argument("--workload-max-new-tokens", type=int, default=32, help="max_new_tokens of workload requests")
    g.add_argument("--speed", type=float, default=1.0, help="replay speed")
    g.add_argument("--paused", action="store_true", help="start with the scheduler (or replay) paused")
    g.add_argument(
        "--pause-on",
        default="",
        metavar="KINDS",
        help="pause the scheduler (or replay) when one of these happens, comma-separated: retract, evict, "
        "chunk, preempt (e.g. retract,evict); the line under the status says why, h opens the step, "
        "p goes on, o changes them",
    )
    g.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="auto",
        help="grid: every panel on one screen; tabs: one per tab (auto: by terminal size)",
    )
    g.add_argument("--panels", default=None, help="comma-separated panel names and order (default: all)")
    g.add_argument(
        "--tui-log",
        default=None,
        help="where the engine's own output and log go while the TUI owns the terminal "
        "(default: a new file in ~/.cache/workbench/logs, named on the start-up screen)",
    )


def make_controller(args: argparse.Namespace):
    """The controller for the parsed flags (raises ValueError/OSError with a clear message)."""
    from workbench.tui.controller import AttachController, EngineController, ReplayController

    replay = getattr(args, "replay", None)
    attach = getattr(args, "attach", None)
    if replay:
        from workbench.core.trace.replay import Replay

        if not os.path.exists(replay):
            raise FileNotFoundError(f"no such trace file: {replay}")
        from workbench.trace_runner import workload_hint

        hint = workload_hint(replay)
        if hint:
            raise ValueError(hint)
        return ReplayController(
            Replay(replay),
            autoplay=not getattr(args, "paused", False),
            speed=getattr(args, "speed", 1.0),
            title=os.path.basename(replay),
        )
    if attach:
        from workbench.tui.controller import MultiAttachController

        return AttachController(attach[0]) if len(attach) == 1 else MultiAttachController(attach)
    from workbench.core.args import ServerArgs

    try:
        sa = ServerArgs.from_cli_args(args)
    except TypeError:
        sa = ServerArgs()
    from workbench.trace_runner import WorkloadError, trace_spec_from_args

    try:
        workload = trace_spec_from_args(args, seed=sa.random_seed or 0) or getattr(args, "workload", None)
    except WorkloadError as exc:
        raise ValueError(str(exc)) from None  # a message for people (friendly() prints it as it is)
    rate = getattr(args, "rate", None)
    if not isinstance(workload, (str, type(None))):
        print(f"workbench tui: {workload.describe(rate, simulated=bool(sa.simulate))}", file=sys.stderr)
        rate = workload.played_rate(rate, simulated=bool(sa.simulate))  # the controller's rate: + and - from it
    scenario = "tour" if getattr(args, "tour", False) else getattr(args, "scenario", None)
    default_note = ""
    if sa.simulate and not scenario and workload is None and not getattr(args, "disaggregation", None):
        # A simulated deployment with nothing to run sat idle with no hint, and a fixed rate a
        # simulated 8-GPU deployment takes in its stride (KV 0%, no queue) teaches nothing: run the
        # scenario that makes a queue and KV pressure on any deployment (its small pool, adaptive rate).
        scenario = SIMULATED_DEFAULT_SCENARIO
        default_note = (
            f"no --workload or --scenario given: the {scenario} scenario runs, with its small KV pool "
            "(--max-total-tokens to change it), so requests queue and the pool fills (w stops it, W picks "
            "another workload)"
        )
    if scenario:
        from workbench.scenarios import get_scenario

        scenario = get_scenario(scenario)
        sa = scenario.server_args(sa)
    cls, extra = EngineController, {}
    if getattr(args, "disaggregation", None):
        from workbench.core.simulation.pd import parse_pd
        from workbench.tui.pd import PDController

        text = args.disaggregation if isinstance(args.disaggregation, str) else "1P1D"
        try:
            shape = parse_pd(text)
        except ValueError:
            raise ValueError(f"--disaggregation {text!r}: write xPyD, e.g. 1P1D or 2P4D") from None
        if shape != (1, 1) and not sa.simulate:
            raise ValueError(
                f"--disaggregation {args.disaggregation} starts {sum(shape)} servers: simulated ones only (add "
                "--simulate h100 --model llama-3.1-70b --tp-size 8, say); real engines make a 1P1D pair here"
            )
        cls, extra = PDController, {"shape": shape}
    controller = cls(
        server_args=sa,
        workload=workload,
        scenario=scenario,
        rate=rate,
        max_new_tokens=getattr(args, "workload_max_new_tokens", 32),
        start_paused=getattr(args, "paused", False),
        **extra,
    )
    controller.start_note = default_note
    return controller


class NoTerminal(RuntimeError):
    """Neither stdout nor a controlling terminal to draw on (a pipe under CI, a cron job)."""


def app_terminal() -> str | None:
    """Where the app draws: None when stdout and stderr are the terminal (the usual case), else
    "/dev/tty", the controlling terminal (`make run | tee log`: stdout is a pipe, and Textual,
    which sizes the screen by stdout, would draw at 80×24 with the engine's output painted over
    it). Raises NoTerminal, with what to do instead, when there is no terminal at all."""
    if os.isatty(1) and os.isatty(2):
        return None
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:
        raise NoTerminal(
            "the TUI draws on a terminal and there is none here (stdout is not a terminal and there is no "
            "controlling terminal); run it in a terminal, or record a run without one "
            "(workbench record --scenario kv-pressure --duration 60 -o run.jsonl) and play it in a "
            "terminal later (workbench tui --replay run.jsonl)"
        ) from None
    os.close(fd)
    return "/dev/tty"


@contextlib.contextmanager
def isolate_child_output(log_path: str | None, terminal: str | None = None) -> Iterator[None]:
    """Send fds 1 and 2 (inherited by the engine's child processes, and whatever the
    loader prints) to `log_path`, while Textual keeps writing to the terminal through
    duplicates of the original fds (or through `terminal`, e.g. /dev/tty when stdout is a
    pipe). Without this, a child's warning would scribble over the screen. `log_path` None:
    fds 1 and 2 stay as they are (no engine here) and only Textual's streams move to `terminal`."""
    saved = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    enc = getattr(sys.stdout, "encoding", None) or "utf-8"
    if terminal is not None:
        tty_out = open(terminal, "w", buffering=1, encoding=enc)  # noqa: SIM115 (closed below)
        tty_err = open(terminal, "w", buffering=1, encoding=enc)  # noqa: SIM115
    else:
        tty_out = os.fdopen(os.dup(1), "w", buffering=1, encoding=enc)
        tty_err = os.fdopen(os.dup(2), "w", buffering=1, encoding=enc)
    moved = log_path is not None
    if moved:
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        orig1, orig2 = os.dup(1), os.dup(2)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        if moved:
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
        sys.stdout = sys.__stdout__ = tty_out  # Textual reads these when the App is created
        sys.stderr = sys.__stderr__ = tty_err
        yield
    finally:
        for f in (tty_out, tty_err):
            with contextlib.suppress(Exception):
                f.flush()
        if moved:
            os.dup2(orig1, 1)
            os.dup2(orig2, 2)
            for fd in (orig1, orig2, log_fd):
                os.close(fd)
        sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__ = saved
        for f in (tty_out, tty_err):
            with contextlib.suppress(Exception):
                f.close()


def run_tui(args: argparse.Namespace) -> int:
    """Run the TUI for parsed arguments; returns the exit status."""
    if getattr(args, "compare", None):  # two engines side by side: their own app (tui/compare.py)
        return run_compare(args)
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.controller import friendly

    try:
        controller = make_controller(args)
    except Exception as exc:
        print(f"workbench tui: {friendly(exc)}", file=sys.stderr)
        return 2
    try:
        terminal = app_terminal()
    except NoTerminal as exc:
        controller.close()
        print(f"workbench tui: {exc}", file=sys.stderr)
        return 2
    panels = [p.strip() for p in (getattr(args, "panels", None) or "").split(",") if p.strip()] or None
    live = controller.mode == "live"
    log_path: str | None = getattr(args, "tui_log", None)
    if live and not log_path:
        from workbench.core.engine_log import new_log_path

        log_path = new_log_path("tui")
    if live:
        controller.log_path = log_path  # the engine logs where its children's output goes
    try:
        # A live engine's children write to fd 1 and 2: into the log, never over the screen; with
        # stdout piped (`make run | tee log`) the app draws on the controlling terminal instead.
        isolate = live or terminal is not None
        with isolate_child_output(log_path if live else None, terminal) if isolate else contextlib.nullcontext():
            try:
                app = WorkbenchApp(
                    controller,
                    panels=panels,
                    layout=getattr(args, "layout", "auto"),
                    log_path=log_path if live else None,
                    tour=bool(getattr(args, "tour", False)) and live,
                    pause_on=[k.strip() for k in (getattr(args, "pause_on", "") or "").split(",") if k.strip()],
                )
            except ValueError as exc:
                controller.close()
                print(f"workbench tui: {exc}", file=sys.stderr)
                return 2
            try:
                app.run()
            finally:
                controller.close()
    except KeyboardInterrupt:
        controller.close()
        return 130
    if terminal is not None and live:  # what the pipe gets: where the engine's output went
        print(f"workbench tui: drew on {terminal} (stdout is not a terminal); the engine's log: {log_path}")
    if app.startup_error:
        print(f"workbench tui: {app.startup_error}" + (f" (details: {log_path})" if log_path else ""), file=sys.stderr)
        return 1
    return int(app.return_code or 0)


def run_compare(args: argparse.Namespace) -> int:
    """`workbench tui --compare ...`: build the source, run the app; returns the exit status."""
    from workbench.tui.compare import CompareApp, RealCompareSource, make_compare_source
    from workbench.tui.controller import friendly

    try:
        source = make_compare_source(args)
    except Exception as exc:
        print(f"workbench tui --compare: {friendly(exc)}", file=sys.stderr)
        return 2
    try:
        terminal = app_terminal()
    except NoTerminal as exc:
        source.close()
        print(f"workbench tui: {exc}", file=sys.stderr)
        return 2
    real = isinstance(source, RealCompareSource)
    log_path = None
    if real:
        from workbench.core.engine_log import new_log_path

        log_path = getattr(args, "tui_log", None) or new_log_path("tui")
        for c in source.controllers:
            c.log_path = log_path
    app = CompareApp(source)
    try:
        isolate = real or terminal is not None
        with isolate_child_output(log_path, terminal) if isolate else contextlib.nullcontext():
            app.run()
    finally:
        if real:
            print("workbench tui --compare: shutting down both engines…", file=sys.stderr, flush=True)
        source.close()
    if app.startup_error:
        print(f"workbench tui --compare: {app.startup_error}", file=sys.stderr)
        return 1
    return int(app.return_code or 0)


def main(argv: list[str] | None = None) -> int:
    """`python -m workbench.tui` (the same flags as `workbench tui`)."""
    from workbench.core.args import ServerArgs

    parser = argparse.ArgumentParser(prog="workbench tui", description="watch the scheduler live")
    ServerArgs.add_cli_args(parser)
    add_tui_args(parser)
    return run_tui(parser.parse_args(argv))
