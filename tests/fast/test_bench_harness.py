"""The bench harness (workbench/bench/harness.py), its prompt builders (prompts.py) and the bench package's
imports: A B B A order, what an interleaved run records, the figures of ratio tables, per-configuration
failures, deterministic prompts, and no bench module reaching into another's private names or cycle."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from workbench.bench import harness, prompts

BENCH = Path(harness.__file__).parent


def test_abba_runs_each_side_first_and_last_equally_often():
    turns = list(harness.abba("wb", "peer", 2))
    assert [t.side for t in turns] == ["wb", "peer", "peer", "wb"] * 2
    assert [t.other for t in turns[:4]] == ["peer", "wb", "wb", "peer"]
    assert [t.tag for t in turns] == ["[1/2]"] * 4 + ["[2/2]"] * 4


def test_interleave_records_samples_loads_and_the_idle_side(monkeypatch):
    values = iter(range(100))
    reported = []
    got = harness.interleave(
        {"a": lambda: ("a", next(values)), "b": lambda: ("b", next(values))},
        2,
        lambda turn, value, load, idle: reported.append((turn.side, value, idle)),
        idle_pids={"a": [], "b": []},  # no processes: the idle side used 0 cores
    )
    assert got.samples["a"] == [("a", 0), ("a", 3), ("a", 4), ("a", 7)]
    assert got.samples["b"] == [("b", 1), ("b", 2), ("b", 5), ("b", 6)]
    assert len(got.loads) == 8 and got.idle_cores == {"a": [0.0] * 4, "b": [0.0] * 4}
    assert [side for side, _, _ in reported] == ["a", "b", "b", "a"] * 2
    assert all(idle == 0.0 for _, _, idle in reported)
    plain = harness.interleave({"a": lambda: 1.0, "b": lambda: 2.0}, 1)
    assert plain.idle_cores == {"a": [], "b": []} and plain.samples == {"a": [1.0, 1.0], "b": [2.0, 2.0]}


def test_cpu_seconds_counts_this_process():
    import os

    assert harness.cpu_seconds([os.getpid()]) > 0
    assert harness.cpu_seconds([2**22 + 12345]) == 0.0  # a pid that does not exist counts 0


def test_ratio_figures_and_tables():
    assert harness.median_ratio([3.0, 1.0, 2.0], [1.0, 1.0, 4.0]) == (2.0, 1.0, 2.0)
    nan = harness.median_ratio([1.0], [0.0])[2]
    assert nan != nan and harness.ratio_text(nan) == "n/a" and harness.ratio_text(1.234) == "1.23×"
    assert harness.goal_text(1.0, 1.0) == "met" and harness.goal_text(0.99, 1.0) == "not met"
    assert harness.load_range([2.5, 1.0, 1.75]) == "1.00–2.50" and harness.load_range([]) == ""
    table = harness.markdown_table(["a", "b c"], [["1", ""], ["2", "x"]])
    assert table.splitlines() == ["| a | b c |", "|---|---|", "| 1 |  |", "| 2 | x |"]


def test_attempt_notes_a_failure_and_goes_on(capsys):
    failures: list[str] = []
    with harness.attempt(failures, "float32, 2 threads"):
        raise RuntimeError("engine did not start")
    with harness.attempt(failures, "bfloat16, 2 threads"):
        pass
    assert failures == ["float32, 2 threads: RuntimeError: engine did not start"]
    harness.print_failures(failures)
    out = capsys.readouterr().out
    assert "[bench] FAILED float32, 2 threads: RuntimeError" in out
    assert "not measured: float32, 2 threads: RuntimeError: engine did not start" in out
    with pytest.raises(KeyboardInterrupt), harness.attempt(failures, "x"):  # only Exceptions are caught
        raise KeyboardInterrupt


class _WordTokenizer:
    """One id per character: enough for the prompt builders' cutting and prefixing."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_prompts_are_deterministic_and_cut_to_length():
    tok = _WordTokenizer()
    a = prompts.mixed_prompts(tok, 6, random.Random(0), (8, 16))
    assert a == prompts.mixed_prompts(tok, 6, random.Random(0), (8, 16))
    assert {len(p) for p in a} <= {8, 16}
    shared = prompts.prefix_prompts(tok, 3, 20, 5, random.Random(0))
    assert all(p[:20] == shared[0][:20] and len(p) == 25 for p in shared)
    assert len({tuple(p[20:]) for p in shared}) == 3  # each its own suffix
    assert prompts.repeated_text_prompt(tok, 12, 7)[:2] == [ord("7"), ord(" ")]
    ids = prompts.random_ids(random.Random(1), 2, 5, 10, 20)
    assert len(ids) == 2 and all(len(p) == 5 and all(10 <= t < 20 for t in p) for p in ids)
    assert prompts.torch_random_ids(2, 4, 256, seed=3) == prompts.torch_random_ids(2, 4, 256, seed=3)
    wls = prompts.build_workloads(tok, quick=True)
    assert [w.key for w in wls] == ["i", "ii", "iii"] and wls[2].decode_only and len(wls[2].prompts) == 1
    assert wls[0].label == "(i) 4 × 16–32 tok × 8 new"


def _bench_imports() -> dict[str, list[tuple[str, str]]]:
    """module -> (imported bench module, imported name) for every import anywhere in it, functions included."""
    mods = {p.stem for p in BENCH.glob("*.py")}
    out: dict[str, list[tuple[str, str]]] = {}
    for path in BENCH.glob("*.py"):
        found = out.setdefault(path.stem, [])
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "workbench.bench":
                found += [(a.name, "") for a in node.names if a.name in mods]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("workbench.bench."):
                found += [(node.module.split(".")[2], a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                found += [(a.name.split(".")[2], "") for a in node.names if a.name.startswith("workbench.bench.")]
    return out


def test_no_bench_module_imports_private_names_or_forms_a_cycle():
    imports = _bench_imports()
    private = [f"{m} imports {t}.{n}" for m, found in imports.items() for t, n in found if n.startswith("_")]
    assert private == []
    graph = {m: {t for t, _ in found if t != m} for m, found in imports.items()}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    assert [m for m in graph if reaches(m, m, {m})] == []
    users = ("engine_bench", "peer_bench", "llamacpp_bench", "served_peer", "trace_bench", "model_bench")
    assert all("harness" in graph[m] for m in users)  # the one harness, not a copy of its parts
