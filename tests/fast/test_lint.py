"""ruff (configured in pyproject.toml) finds nothing: unused or undefined names, f-strings without
placeholders, syntax errors; and every file is as `ruff format` writes it. Part of the fast tier."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> str:
    ruff = Path(sys.executable).with_name("ruff")
    exe = str(ruff) if ruff.exists() else shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed: pip install -e '.[test]' brings it")
    return exe


def test_ruff_check_is_clean():
    proc = subprocess.run(
        [_ruff(), "check", "--output-format", "concise", "."], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_ruff_format_leaves_every_file_as_it_is():
    proc = subprocess.run([_ruff(), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, "run `.venv/bin/ruff format .`:\n" + proc.stdout[-4000:] + proc.stderr[-2000:]
