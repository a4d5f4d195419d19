"""End-to-end part of tests/fast/test_cli_generate.py (what starts processes, engines or servers, or loads the
reference model).

`workbench generate`: a prompt from standard input, and --show-stats as a table of named figures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

WORKBENCH = str(Path(sys.executable).with_name("workbench"))


def test_generate_reads_the_prompt_from_stdin(default_prepared):
    proc = subprocess.run(
        [
            WORKBENCH,
            "generate",
            "-",
            "--raw",
            "--max-new-tokens",
            "4",
            "--dtype",
            "float32",
            "--show-stats",
            "--no-show-progress",
        ],
        input="The capital of France is",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout
    assert "prompt tokens" in proc.stderr and "tokens/s" in proc.stderr
    empty = subprocess.run([WORKBENCH, "generate", "-"], input="  \n", capture_output=True, text=True, timeout=120)
    assert empty.returncode == 2 and "standard input was empty" in empty.stderr
