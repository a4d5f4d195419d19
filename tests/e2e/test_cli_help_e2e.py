"""End-to-end part of tests/fast/test_cli_help.py (what starts processes, engines or servers, or loads the
reference model).

The command line explains itself: every engine flag has help text (with its default and choices),
and a mistyped flag gets the usage of the command it was given to and a guess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

WORKBENCH = str(Path(sys.executable).with_name("workbench"))


def test_top_level_help_lists_every_bench():
    proc = subprocess.run([WORKBENCH, "--help"], capture_output=True, text=True, timeout=60)
    bench_line = next(ln for ln in proc.stdout.splitlines() if ln.strip().startswith("bench"))
    for name in ("model", "engine", "serve", "threads", "tp", "trace"):
        assert name in bench_line
