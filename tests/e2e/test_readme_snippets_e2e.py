"""End-to-end part of tests/fast/test_readme_snippets.py (what starts processes, engines or servers, or loads the
reference model).

The README's snippets run as written, and so do those that moved from it into the docs: each ```python
block saved as a script and run (one whose first line says it needs a server runs against a real
`workbench serve` on its default port), and every `.venv/bin/workbench` command line in a ```sh block
accepted by the CLI's own parser (parsed in-process, so nothing starts; an unknown subcommand or flag fails,
as it would on the command line)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
# The README's detail lives in these docs now; their snippets are checked as the README's are.
DOCS = ("http_server.md", "simulation.md", "benchmarks.md")
SOURCES = [README] + [(ROOT / "docs" / name).read_text() for name in DOCS]
BLOCKS = [block for text in SOURCES for block in re.findall(r"```(\w+)\n(.*?)```", text, flags=re.S)]
PYTHON = [body for lang, body in BLOCKS if lang == "python"]


def _needs_server(body: str) -> bool:
    return "needs a server" in body.splitlines()[0]


@pytest.fixture(scope="module")
def default_server():
    """`workbench serve` as the README starts it: the default model on 127.0.0.1:30000."""
    from pipeline_helpers import served_engine_at

    with served_engine_at("127.0.0.1", 30000, max_total_tokens=16384) as pair:
        yield pair


@pytest.mark.parametrize("i", [i for i, b in enumerate(PYTHON) if not _needs_server(b)])
def test_readme_python_snippet_runs_as_a_script(tmp_path, i):
    _run_snippet(tmp_path, i)


@pytest.mark.parametrize("i", [i for i, b in enumerate(PYTHON) if _needs_server(b)])
def test_readme_client_snippet_runs_against_a_server(tmp_path, i, default_server):
    _run_snippet(tmp_path, i)


def _run_snippet(tmp_path, i: int) -> None:
    script = tmp_path / f"snippet{i}.py"
    script.write_text(PYTHON[i])
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
