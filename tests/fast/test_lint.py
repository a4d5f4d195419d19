"""ruff (configured in pyproject.toml) finds nothing: unused or undefined names, f-strings without
placeholders, syntax errors, unsorted imports, pre-3.10 idioms; and every file is as `ruff format` writes
it. Part of the fast tier. The pre-commit hooks (.pre-commit-config.yaml) run the same commands."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The two ruff commands, over the whole tree: the tests below and the pre-commit hooks run exactly these.
RUFF_CHECK = ["check", "."]
RUFF_FORMAT = ["format", "--check", "."]


def _ruff() -> str:
    ruff = Path(sys.executable).with_name("ruff")
    exe = str(ruff) if ruff.exists() else shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed: pip install -e '.[test]' brings it")
    return exe


def test_ruff_check_is_clean():
    proc = subprocess.run(
        [_ruff(), *RUFF_CHECK, "--output-format", "concise"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_ruff_format_leaves_every_file_as_it_is():
    proc = subprocess.run([_ruff(), *RUFF_FORMAT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, "run `.venv/bin/ruff format .`:\n" + proc.stdout[-4000:] + proc.stderr[-2000:]


def test_the_pre_commit_hooks_run_what_the_fast_tier_lints():
    """Each hook's command is one the fast tier runs (ruff here, mypy through tests/fast/test_types.py,
    whose `python tests/fast/test_types.py` is its test's check), and each of those has a hook."""
    config = (ROOT / ".pre-commit-config.yaml").read_text()
    entries = sorted(line.split("entry:", 1)[1].strip() for line in config.splitlines() if "entry:" in line)
    expected = [f".venv/bin/ruff {' '.join(RUFF_CHECK)}", f".venv/bin/ruff {' '.join(RUFF_FORMAT)}"]
    types = ROOT / "tests" / "fast" / "test_types.py"
    if types.exists():
        assert 'if __name__ == "__main__":' in types.read_text(), "the mypy hook runs test_types.py as a script"
        expected.append(".venv/bin/python tests/fast/test_types.py")
    assert entries == sorted(expected)
    # Local hooks only: nothing fetched from the network, every command from the project's venv.
    assert [line.strip() for line in config.splitlines() if line.strip().startswith("- repo:")] == ["- repo: local"]
    assert config.count("language: system") == len(expected)
    assert config.count("pass_filenames: false") == len(expected), "each hook checks the whole tree, as the test does"
