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
