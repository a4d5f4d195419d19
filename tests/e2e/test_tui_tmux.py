"""`workbench tui --replay FILE` in a real terminal (tmux), driven by keys like a person would.

Needs tmux (skipped without it). The small driver below starts the app in a detached session,
sends keys, polls the screen, and reads the command's exit status from a marker line printed
after it ends.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid

import pytest
from tui_helpers import FIXTURE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXIT_MARK = "__workbench_tmux_exit__"

pytestmark = pytest.mark.skipif(not shutil.which("tmux"), reason="needs tmux (apt-get install tmux)")


class Tmux:
    """One detached tmux session running one command."""

    def __init__(self, name: str):
        self.name = name

    def _tmux(self, *args: str, check: bool = True) -> str:
        out = subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=30, cwd=ROOT)
        if check and out.returncode != 0:
            raise AssertionError(f"tmux {' '.join(args)} failed: {out.stderr}")
        return out.stdout

    def start(self, cols: int, rows: int, *cmd: str) -> None:
        # After the command ends, print its status and keep the pane, so the test can read both.
        script = '"$@"; s=$?; printf "\\n%s %s\\n" "$0" "$s"; exec sleep 86400'
        self._tmux(
            "new-session",
            "-d",
            "-s",
            self.name,
            "-x",
            str(cols),
            "-y",
            str(rows),
            "-c",
            ROOT,
            "sh",
            "-c",
            script,
            EXIT_MARK,
            *cmd,
        )

    def keys(self, *keys: str) -> None:
        for k in keys:
            self._tmux("send-keys", "-t", f"={self.name}:", k)

    def capture(self) -> str:
        return self._tmux("capture-pane", "-t", f"={self.name}:", "-p")

    def wait(self, regex: str, timeout: float) -> None:
        """Poll the screen until `regex` matches (a bound on the wait, not a timing assertion)."""
        deadline = time.monotonic() + timeout
        while True:
            screen = self.capture()
            if re.search(regex, screen):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for /{regex}/; screen was:\n{screen}")
            time.sleep(0.2)

    def exit_status(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hist = self._tmux("capture-pane", "-t", f"={self.name}:", "-p", "-S", "-200")
            found = re.findall(rf"^{EXIT_MARK} (\d+)$", hist, re.M)
            if found:
                return int(found[-1])
            time.sleep(0.2)
        return None

    def stop(self) -> None:
        self._tmux("kill-session", "-t", f"={self.name}", check=False)


def _all_of(*texts: str) -> str:
    """A regex matching a screen that shows every one of `texts` (in any order)."""
    return "".join(f"(?=[\\s\\S]*{re.escape(t)})" for t in texts)


def test_replay_in_tmux_keys_panels_and_clean_exit():
    tm = Tmux(f"wbtui-{uuid.uuid4().hex[:8]}")
    exe = os.path.join(os.path.dirname(sys.executable), "workbench")
    # Under pytest the session's environment carries COLUMNS=80 LINES=24, which Textual would
    # believe over the real pane size.
    tm.start(
        160,
        48,
        "env",
        "-u",
        "COLUMNS",
        "-u",
        "LINES",
        exe,
        "tui",
        "--replay",
        FIXTURE,
        "--paused",
        "--layout",
        "grid",
        "--speed",
        "8",
    )
    try:
        titles = ("Queues", "Batch composition", "Radix tree", "KV pool", "Latency", "Events", "Request detail")
        # One screen showing all of it: a frame can be caught half drawn, so wait, do not capture once.
        tm.wait(_all_of(*titles, "REPLAY tui_trace.jsonl", "PAUSED"), 30)
        # three single steps: the recording's first three scheduler steps, one per key
        for _ in range(3):
            tm.keys("s")
        tm.wait(r"step 10 +PAUSED", 20)
        # The panel redraws on its own tick, possibly a frame after the status line.
        tm.wait(_all_of("Batch composition — 3 steps"), 20)
        # play to the end of the recording
        tm.keys("p")
        tm.wait(r"· end", 60)
        tm.wait(r"done 7", 20)
        # the panels (redrawn on their own tick) show the requests; the shared system prompt
        # branches three ways
        tm.wait(_all_of("sp-1", "long-1", "chat-2", "[3 children]"), 20)
        # help, then quit
        tm.keys("?")
        tm.wait("what you are looking at", 20)
        tm.keys("?")  # (Escape then q too fast would read as Alt+q)
        # q while the help is still up would only close it: wait until it is gone
        tm.wait(r"\A(?![\s\S]*what you are looking at)", 20)
        tm.keys("q")
        assert tm.exit_status(20) == 0
        assert "Traceback" not in tm.capture()
    finally:
        tm.stop()
