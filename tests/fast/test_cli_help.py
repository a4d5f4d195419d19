"""The command line explains itself: every engine flag has help text (with its default and choices),
and a mistyped flag gets the usage of the command it was given to and a guess.

The end-to-end tests of this module are in tests/e2e/test_cli_help_e2e.py.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from workbench.core.args import FLAG_HELP, ServerArgs

from workbench.cli import build_parser, main


def test_every_server_arg_has_help():
    missing = [f.name for f in dataclasses.fields(ServerArgs) if not (f.metadata.get("help") or FLAG_HELP.get(f.name))]
    assert not missing, f"ServerArgs fields without help text: {missing}"
    assert not set(FLAG_HELP) - {f.name for f in dataclasses.fields(ServerArgs)}, "help for a field that is gone"


def test_serve_help_shows_text_default_and_choices(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    for f in dataclasses.fields(ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        # the flag's entry is followed by words of help, not by the next flag
        entry = re.search(rf"^\s+{re.escape(flag)}\b[^\n]*\n?(.*?)(?=^\s+--|\Z)", out, re.M | re.S)
        assert entry and re.search(r"[a-z]{3}", entry.group(0).split(flag, 1)[1]), f"{flag} has no help text"
    assert "--port PORT" in out and "(default: 30000)" in out
    assert "{auto,float32,bfloat16,float16}" in out and "(default: fcfs)" in out


def test_a_mistyped_flag_gets_the_commands_usage_and_a_guess(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--prot", "8000"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "workbench serve: error: unrecognized arguments: --prot 8000" in err
    assert "did you mean --port?" in err and "usage: workbench serve" in err
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--max-concurency", "3"])
    err = capsys.readouterr().err
    assert "workbench bench serve: error" in err and "did you mean --max-concurrency?" in err
