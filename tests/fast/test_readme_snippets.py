"""The README's snippets run as written, and so do those that moved from it into the docs: each ```python
block saved as a script and run (one whose first line says it needs a server runs against a real
`workbench serve` on its default port), and every `.venv/bin/workbench` command line in a ```sh block
accepted by the CLI's own parser (parsed in-process, so nothing starts; an unknown subcommand or flag fails,
as it would on the command line). The README stays a front door: at most 12 KB.

The end-to-end tests of this module are in tests/e2e/test_readme_snippets_e2e.py.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
# The README's detail lives in these docs now; their snippets are checked as the README's are.
DOCS = ("http_server.md", "simulation.md", "benchmarks.md")
SOURCES = [README] + [(ROOT / "docs" / name).read_text() for name in DOCS]
BLOCKS = [block for text in SOURCES for block in re.findall(r"```(\w+)\n(.*?)```", text, flags=re.S)]
PYTHON = [body for lang, body in BLOCKS if lang == "python"]


def _commands() -> list[str]:
    out = []
    for lang, body in BLOCKS:
        if lang != "sh":
            continue
        for line in body.replace("\\\n", " ").splitlines():  # a line ending in a backslash goes on
            line = line.split("  #", 1)[0].strip().rstrip("&").strip()
            if line.startswith(".venv/bin/workbench "):
                out.append(line[len(".venv/bin/workbench ") :])
    return out


def test_the_readme_has_snippets_to_check():
    assert PYTHON and len(_commands()) >= 5


def test_the_readme_fits_a_front_door():
    """What it is, the two commands, the picture, a tour and links: the rest belongs in docs/."""
    size = len(README.encode())
    assert size <= 12 * 1024, f"README.md is {size} bytes; move detail into a doc under docs/ and link it"


@pytest.mark.parametrize("cmd", _commands())
def test_readme_workbench_command_parses(cmd):
    from workbench.cli import build_parser

    args = shlex.split(cmd.replace("~", str(Path.home())))
    try:
        parsed, extras = build_parser().parse_known_args(args)
    except SystemExit as exc:  # argparse: an unknown subcommand or a bad value
        pytest.fail(f"`workbench {cmd}` is not accepted by the CLI (exit {exc.code})")
    assert not extras, f"`workbench {cmd}`: unknown arguments {extras}"
    assert getattr(parsed, "func", None), f"`workbench {cmd}` names no command"


def test_the_command_check_fails_on_a_mistyped_flag():
    from workbench.cli import build_parser

    _, extras = build_parser().parse_known_args(["serve", "--prot", "3"])
    assert extras == ["--prot", "3"]
