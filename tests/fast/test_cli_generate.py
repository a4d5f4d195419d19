"""`workbench generate`: a prompt from standard input, and --show-stats as a table of named figures.

The end-to-end tests of this module are in tests/e2e/test_cli_generate_e2e.py.
"""

from __future__ import annotations

from workbench.cli import format_stats


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
