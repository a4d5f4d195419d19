"""The simulator against published results (issue #37 item 5): the rows name their sources, and
docs/simulation.md's table is what `workbench bench sim-published` prints now.

The rows of a few requests (vLLM's latency tests) are simulated here and must give exactly the
doc's figures, so a change to the cost model or the hardware table that moves them fails until the
table is regenerated. The ShareGPT rows take minutes (thousands of requests), so for them the test
checks that each doc line carries the row's published figure and source and that its error and
verdict agree with its own published and simulated figures.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from workbench.bench.sim_published import FIGURES, ROWS, WITHIN, error, fmt, simulate, table_lines
from workbench.cli import build_parser

DOC = Path(__file__).resolve().parents[2] / "docs" / "simulation.md"
FAST = [r for r in ROWS if r.n <= 8]  # a batch at once: about a second each


def _doc_lines() -> dict[tuple[str, str], list[str]]:
    """The doc's table under "Against published results": (row key, figure name) -> its cells."""
    text = DOC.read_text()
    assert "## Against published results" in text, "docs/simulation.md lacks its 'Against published results' section"
    section = text.split("## Against published results", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in section.splitlines():
        m = re.match(r"\| `([\w.-]+)` \|", line)
        if m:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            out[(m.group(1), cells[2])] = cells
    return out


def _number(cell: str) -> float:
    return float(cell.replace(",", ""))


def test_every_row_names_a_source_and_a_checkable_setup():
    assert 6 <= len(ROWS) <= 12
    assert len({r.key for r in ROWS}) == len(ROWS)
    for r in ROWS:
        assert re.match(r"https://\S+$", r.source), f"{r.key}: no source URL"
        assert r.figures and set(r.figures) <= set(FIGURES), r.key
        assert r.n > 0 and r.tp >= 1 and r.prompt_len[0] <= r.prompt_len[1] and r.output_len[0] <= r.output_len[1]
        assert r.note, f"{r.key}: say what the published setup has that the simulator leaves out"


def test_the_doc_table_has_every_row_with_its_source_and_consistent_errors():
    doc = _doc_lines()
    for r in ROWS:
        for key, published in r.figures.items():
            cells = doc.get((r.key, FIGURES[key]))
            assert cells, f"docs/simulation.md has no line for {r.key} {FIGURES[key]}: rerun the command"
            _, _, _, pub, sim, err, verdict, src = cells
            assert pub == fmt(published), f"{r.key}: the doc's published figure is not the row's"
            assert r.source in src, f"{r.key}: the doc's line does not link its source"
            e = error(_number(pub), _number(sim))
            assert abs(_number(err.rstrip("%")) / 100 - e) <= 0.011, f"{r.key}: error column {err} against {e:+.1%}"
            assert verdict == ("yes" if abs(_number(err.rstrip("%"))) <= 100 * WITHIN else "no"), r.key


@pytest.mark.parametrize("row", FAST, ids=[r.key for r in FAST])
def test_the_doc_figures_are_what_the_simulator_gives_now(row):
    sim = simulate(row)
    doc = _doc_lines()
    for key, published in row.figures.items():
        cells = doc[(row.key, FIGURES[key])]
        assert cells[4] == fmt(sim[key]), (
            f"{row.key}: the doc says {cells[4]}, the simulator now gives {fmt(sim[key])}; "
            "rerun `workbench bench sim-published` and update docs/simulation.md"
        )
        assert cells[5] == f"{error(published, sim[key]):+.0%}"
    # the printed table is the same line the doc holds
    line = next(x for x in table_lines([(row, sim)]) if f"`{row.key}`" in x)
    assert [c.strip() for c in line.strip().strip("|").split("|")] == doc[(row.key, FIGURES[next(iter(row.figures))])]


def test_a_latency_row_is_the_makespan_of_its_batch():
    row = FAST[0]
    sim = simulate(row)
    # 8 requests of 32 tokens at once: one prefill then 127 decode steps, all finishing together
    assert sim["latency_ms"] > 127 * sim["tpot_p50_ms"]
    assert sim["latency_ms"] == pytest.approx(sim["ttft_p50_ms"] + 127 * sim["tpot_p50_ms"], rel=1e-6)


def test_the_command_is_registered_and_refuses_an_unknown_row(capsys):
    args = build_parser().parse_args(["bench", "sim-published", "--rows", "no-such-row"])
    assert args.func(args) == 2
    assert "unknown row(s) no-such-row" in capsys.readouterr().err
