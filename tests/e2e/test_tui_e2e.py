"""End-to-end part of tests/fast/test_tui.py (what starts processes, engines or servers, or loads the
reference model).

TUI tests without an engine: replay of the recorded fixture, synthetic traces, the CLI."""

from __future__ import annotations

import subprocess
import sys

PANELS = ("queues", "batch", "tree", "kv", "latency", "events", "detail", "experts", "pd")


def test_builtin_panels_register_lazily():
    code = (
        "import sys; from workbench.plugins import load_plugins; r = load_plugins(); "
        "print(sorted(r.panels)); print('textual' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == str(sorted(PANELS))
    assert out[1] == "False", "registering the panels must not import Textual"
    from workbench.tui.panels.base import TracePanel

    from workbench.plugins import load_plugins

    for name in PANELS:
        widget = load_plugins().panels[name].factory()
        assert isinstance(widget, TracePanel) and widget.PANEL_NAME == name and widget.HELP
