"""`workbench generate`: a prompt from standard input, and --show-stats as a table of named figures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from workbench.cli import format_stats

WORKBENCH = str(Path(sys.executable).with_name("workbench"))


def test_stats_table_names_each_figure():
    text = format_stats(
        {
            "prompt_tokens": 38,
            "cached_tokens": 12,
            "completion_tokens": 9,
            "ttft": 0.5,
            "e2e_latency": 1.3,
            "finish_reason": {"type": "stop", "matched": "\n"},
        }
    )
    lines = dict(line.strip().split("  ", 1) for line in text.splitlines())
    assert {k: v.strip() for k, v in lines.items()} == {
        "prompt tokens": "38 (12 cached)",
        "completion tokens": "9",
        "time to first token": "0.500 s",
        "decode": "10.0 tokens/s",
        "end to end": "1.300 s",
        "finish reason": "stop (matched '\\n')",
    }
    one = format_stats(
        {
            "prompt_tokens": 3,
            "completion_tokens": 1,
            "ttft": 0.2,
            "e2e_latency": 0.2,
            "finish_reason": {"type": "length", "matched": None},
        }
    )
    assert "decode               - tokens/s" in one and "finish reason        length" in one


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
