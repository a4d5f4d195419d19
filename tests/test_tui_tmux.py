"""`workbench tui --replay FILE` in a real terminal (tmux), driven by keys like a person would.

Needs tmux and ../shared/testing/tui_in_tmux.sh (or $WORKBENCH_TESTING_DIR); skipped without them.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from tests.tui_helpers import FIXTURE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTING = os.environ.get("WORKBENCH_TESTING_DIR") or os.path.join(ROOT, "..", "shared", "testing")
SCRIPT = os.path.join(TESTING, "tui_in_tmux.sh")

pytestmark = pytest.mark.skipif(not (shutil.which("tmux") and os.path.exists(SCRIPT)),
                                reason="needs tmux and shared/testing/tui_in_tmux.sh")


def _t(*args, timeout: float = 90, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if check and out.returncode != 0:
        raise AssertionError(f"tui_in_tmux.sh {' '.join(args)} failed ({out.returncode}):\n{out.stderr}")
    return out


def test_replay_in_tmux_keys_panels_and_clean_exit():
    name = f"wbtui-{uuid.uuid4().hex[:8]}"
    exe = os.path.join(os.path.dirname(sys.executable), "workbench")
    # Under pytest the session's environment carries COLUMNS=80 LINES=24, which Textual would
    # believe over the real pane size.
    _t("start", name, "-x", "160", "-y", "48", "--", "env", "-u", "COLUMNS", "-u", "LINES", exe, "tui", "--replay", FIXTURE, "--paused",
       "--layout", "grid", "--speed", "8")
    try:
        _t("wait", name, "Batch composition", "30")
        screen = _t("capture", name).stdout
        for title in ("Queues", "Batch composition", "Radix tree", "KV pool", "Latency", "Events",
                      "Request detail"):
            assert title in screen, screen
        assert "REPLAY tui_trace.jsonl" in screen and "PAUSED" in screen
        # three single steps: the recording's first three scheduler steps, one per key
        for _ in range(3):
            _t("keys", name, "s")
        _t("wait", name, r"step 10 +PAUSED", "20")
        screen = _t("capture", name).stdout
        assert "Batch composition — 3 steps" in screen, screen
        # play to the end of the recording
        _t("keys", name, "p")
        _t("wait", name, r"· end", "60")
        _t("wait", name, r"done 7", "20")
        screen = _t("capture", name).stdout
        for rid in ("sp-1", "long-1", "chat-2"):
            assert rid in screen
        assert "[3 children]" in screen        # the shared system prompt branches three ways
        # help, then quit
        _t("keys", name, "?")
        _t("wait", name, "what you are looking at", "20")
        _t("keys", name, "?")            # (Escape then q too fast would read as Alt+q)
        time.sleep(0.5)
        _t("keys", name, "q")
        assert _t("exited", name, "20", check=False).returncode == 0
        assert "Traceback" not in _t("capture", name).stdout
    finally:
        _t("stop", name, check=False)
