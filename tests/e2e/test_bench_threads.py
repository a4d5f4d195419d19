"""`workbench bench threads --quick`: the neighbour benchmark runs end to end and prints its table.

A smoke run (tiny workloads, one policy): the busy-loop and TUI neighbours start and stop,
every cell is measured, and each neighbour's figure is printed as a ratio of quiet.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def test_bench_threads_quick_prints_every_neighbour(default_prepared):
    exe = Path(sys.executable).with_name("workbench")
    proc = subprocess.run(
        [str(exe), "bench", "threads", "--quick", "--policies", "1", "--cell-timeout", "120"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "--num-threads 1: 1 compute thread(s), fixed: set by --num-threads" in out
    for workload in ("bs1", "bs8"):
        row = next(line for line in out.splitlines() if line.startswith(f"| --num-threads 1 | {workload} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        # policy, workload, quiet, busy, tui, busy/quiet, tui/quiet, quiet GEMM GFLOP/s (% of peak), threads at end
        assert len(cells) == 9, row
        for fig in cells[2:5]:
            assert float(re.match(r"[≤ ]*([\d.]+) \(load", fig).group(1)) > 0, row
        for ratio in cells[5:7]:
            assert float(re.match(r"[≤ ]*([\d.]+)", ratio).group(1)) > 0, row
        gemm = re.fullmatch(r"([\d.]+) \((\d+%|-)\)", cells[7])
        assert gemm and float(gemm.group(1)) > 0, row  # the quiet figure's linears as a share of the machine's peak
        assert cells[8] == "quiet 1, busy 1, tui 1", row
    # The TUI neighbour rendered throughout (the bench fails if its process exits early).
    assert "cut short" not in proc.stderr
