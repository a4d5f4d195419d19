"""Issue #40 item 10: `workbench tui` with stdout not a terminal.

With a controlling terminal (`make run | tee log`) the app draws on it at its real size; with
none (a pipe under CI) it refuses with what to do instead, rather than drawing escape codes into
the pipe."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest
from tui_helpers import FIXTURE

EXE = os.path.join(os.path.dirname(sys.executable), "workbench")


def test_no_terminal_at_all_is_a_clear_refusal():
    # start_new_session: no controlling terminal, so /dev/tty cannot be opened; stdout is a pipe
    out = subprocess.run(
        [EXE, "tui", "--replay", FIXTURE],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    assert out.returncode == 2, (out.returncode, out.stdout[-500:], out.stderr[-500:])
    assert "no controlling terminal" in out.stderr and "workbench record" in out.stderr, out.stderr
    assert "\x1b[" not in out.stdout  # nothing drawn into the pipe


@pytest.mark.skipif(not shutil.which("tmux"), reason="needs tmux (apt-get install tmux)")
def test_piped_stdout_draws_on_the_terminal_at_its_size(tmp_path):
    name = f"wbpipe-{uuid.uuid4().hex[:8]}"
    piped = tmp_path / "piped.txt"
    # `workbench tui ... | cat > FILE` in a 150×44 pane; COLUMNS/LINES unset (pytest sets 80×24)
    cmd = f"env -u COLUMNS -u LINES {EXE} tui --replay {FIXTURE} --paused | cat > {piped}; sleep 600"
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "150", "-y", "44", "sh", "-c", cmd], check=True)
    try:
        deadline = time.monotonic() + 60
        screen = ""
        while time.monotonic() < deadline:
            screen = subprocess.run(
                ["tmux", "capture-pane", "-t", f"={name}:", "-p"], capture_output=True, text=True
            ).stdout
            if "REPLAY" in screen and "Request detail" in screen:
                break
            time.sleep(0.3)
        lines = screen.splitlines()
        assert "REPLAY" in screen, screen
        # drawn at the pane's size, not at 80×24: the status line and the footer reach past column 80,
        # and the grid (auto at 150×44) shows Request detail beside Events
        assert max(len(x) for x in lines) > 100, screen
        assert len(lines) > 30, screen
        subprocess.run(["tmux", "send-keys", "-t", f"={name}:", "q"], check=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "REPLAY" in screen:
            time.sleep(0.3)
            screen = subprocess.run(
                ["tmux", "capture-pane", "-t", f"={name}:", "-p"], capture_output=True, text=True
            ).stdout
        assert "REPLAY" not in screen, "q did not end the app"
        assert "\x1b[" not in piped.read_text()  # the pipe got no screen drawing
    finally:
        subprocess.run(["tmux", "kill-session", "-t", f"={name}"], capture_output=True)


# ---- issue #40 item 11: a simulated deployment starts with something to watch ----------------


def _tui_args(argv):
    import argparse

    from workbench.core.args import ServerArgs
    from workbench.tui.cli import add_tui_args

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    add_tui_args(parser)
    return parser.parse_args(argv)


def test_a_simulated_deployment_without_a_workload_runs_the_kv_pressure_scenario():
    from workbench.tui.cli import make_controller

    sim = ["--simulate", "h100", "--model", "llama-3.1-70b", "--tp-size", "8"]
    c = make_controller(_tui_args(sim))
    # arrivals start with the engine, on a pool small enough to fill, and the app says why
    assert c.scenario is not None and c.scenario.name == "kv-pressure"
    assert c._server_args.max_total_tokens == 640 and c._server_args.simulate == "h100"
    assert "kv-pressure" in c.start_note and "--max-total-tokens" in c.start_note
    # the user's own choices win
    c = make_controller(_tui_args([*sim, "--max-total-tokens", "4096"]))
    assert c._server_args.max_total_tokens == 4096
    c = make_controller(_tui_args([*sim, "--workload", "chat"]))
    assert c.scenario is None and c.workload == "chat" and not c.start_note
    # a real engine is left as it was: nothing runs until w
    c = make_controller(_tui_args([]))
    assert c.scenario is None and c.workload is None and not c.start_note
