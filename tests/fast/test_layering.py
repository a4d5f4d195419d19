"""Imports point downward only and never go round in a circle (issues #16 and #36).

The walk reads every module's imports with `ast`: `import` and `from ... import` statements
anywhere in the file (inside functions and `if TYPE_CHECKING:` blocks too), relative ones resolved
against the module's package, and `importlib.import_module("name")` / `__import__("name")` calls
with a literal name. A module that imports by a computed name (a lazy table of module paths) gets
an edge to every one of our modules that a string in it names, so no import hides from the walk.

Layers, top to bottom: the CLI, benchmarks and workloads (`workbench.*` outside the three below) and
the views (`workbench.tui`, `workbench.widgets`) over the core (`workbench.core`). Inside the core, the
trace package (events, bus, reducer) knows nothing of the engine side, and the kernels (`core.layers`)
never import a runner, a manager or the engine; they may use the batch description
(`model_executor.forward_batch_info`), as SGLang's attention backends do. The serving path (engine,
managers, entrypoints, io_struct) never imports the simulation: a simulated deployment plugs in.

Cycles: `import a.b.c` is an edge to module a.b.c; `from pkg import name` is an edge to pkg.name when
that is a module, else to pkg (its __init__). A strongly connected component of more than one module
is a cycle; the failure prints one loop through it with the file:line of each edge, and every other
edge inside it.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"core": "workbench.core", "tui": "workbench.tui", "widgets": "workbench.widgets", "workbench": "workbench"}
ENGINE_SIDE = (
    "engine",
    "managers",
    "model_executor",
    "entrypoints",
    "models",
    "layers",
    "distributed",
    "model_loader",
    "mem_cache",
    "sampling",
    "bench",
)
RUNNERS = (
    "model_executor.model_runner",
    "model_executor.cuda_graph_runner",
    "model_executor.offline_harness",
    "managers",
    "engine",
    "entrypoints",
    "bench",
)
# The serving path (files, or folders ending in "/", under ROOT) and what it must not import.
SERVING_PATH = ("core/engine.py", "core/managers/", "core/entrypoints/", "core/io_struct.py")
SIMULATION = "workbench.core.simulation"
DYNAMIC_IMPORTS = ("import_module", "__import__")


@dataclass(frozen=True)
class Edge:
    """Module `src` imports module `dst` at `path:line` (`how`: import, from, dynamic, named)."""

    src: str
    dst: str
    path: str
    line: int
    how: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.src} -> {self.dst} ({self.how})"


def module_name(path: Path, root: Path) -> str:
    folder = path.relative_to(root).parts[0]
    parts = [p for p in path.relative_to(root / folder).with_suffix("").parts if p != "__init__"]
    return ".".join([PACKAGES[folder], *parts])


def modules(root: Path) -> dict[str, Path]:
    """Every module of ours, by dotted name (a package by its own name, for its __init__.py)."""
    return {module_name(p, root): p for folder in PACKAGES for p in sorted((root / folder).rglob("*.py"))}


def _known(name: str, known) -> str:
    """The longest prefix of `name` that is one of our modules (`name` itself when none is)."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in known:
            return ".".join(parts[:k])
    return name


def _relative(package: str, dots: int, rest: str | None) -> str:
    base = package.rsplit(".", dots - 1)[0] if dots > 1 else package
    return f"{base}.{rest}" if rest else base


def _dynamic_name(call: ast.Call) -> str | bool | None:
    """The literal module name of an import_module()/__import__() call; False when it is computed;
    None for any other call."""
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name not in DYNAMIC_IMPORTS or not call.args:
        return None
    arg = call.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else False


def imports_of(path: Path, root: Path, known) -> list[Edge]:
    """Every import in the file at `path`, each resolved to one of `known` where it names one."""
    src = module_name(path, root)
    package = src if path.name == "__init__.py" else src.rpartition(".")[0]
    where = str(path.relative_to(root))
    tree = ast.parse(path.read_text(), filename=where)
    edges: set[Edge] = set()
    computed = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            edges |= {Edge(src, _known(a.name, known), where, node.lineno, "import") for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _relative(package, node.level, node.module) if node.level else node.module or ""
            for a in node.names:
                sub = f"{base}.{a.name}"
                edges.add(Edge(src, sub if sub in known else _known(base, known), where, node.lineno, "from"))
        elif isinstance(node, ast.Call):
            name = _dynamic_name(node)
            if name is False:
                computed = True
            elif name:
                stripped = name.lstrip(".")
                if stripped != name:
                    name = _relative(package, len(name) - len(stripped), stripped)
                edges.add(Edge(src, _known(name, known), where, node.lineno, "dynamic"))
    if computed:
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in known and node.value != src:
                edges.add(Edge(src, node.value, where, node.lineno, "named"))
    return sorted(edges, key=lambda e: (e.line, e.dst))


def import_graph(root: Path) -> tuple[dict[str, Path], list[Edge]]:
    known = modules(root)
    return known, [e for path in known.values() for e in imports_of(path, root, known)]


def upward(src: str, dst: str) -> str | None:
    """Why the edge src -> dst goes up a layer, or None."""
    if not dst.startswith("workbench"):
        return None
    core = "workbench.core"
    if src.startswith(core + ".") and not (dst == core or dst.startswith(core + ".")):
        return "the core imports something outside the core"
    if src.startswith(core + ".trace") and any(dst.startswith(f"{core}.{x}") for x in ENGINE_SIDE):
        return "the trace package imports the engine side"
    if src.startswith(core + ".layers") and any(dst.startswith(f"{core}.{x}") for x in RUNNERS):
        return "a kernels package imports a runner, a manager or the engine"
    return None


def violations(root: Path) -> list[str]:
    _, edges = import_graph(root)
    return [f"{e} ({why})" for e in edges if (why := upward(e.src, e.dst))]


def strongly_connected(nodes, succ: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components, iteratively (no recursion limit on a long import chain)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(succ.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(succ.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return out


def _loop(first: str, succ: dict[str, set[str]], inside: set[str]) -> list[str]:
    """A shortest path first -> ... -> first through `inside` (breadth first)."""
    came: dict[str, str] = {}
    todo = deque([first])
    while todo:
        v = todo.popleft()
        for w in sorted(succ.get(v, ()) & inside):
            if w == first:
                path = [v]
                while path[-1] != first:
                    path.append(came[path[-1]])
                return [first, *reversed(path[:-1]), first]
            if w not in came:
                came[w] = v
                todo.append(w)
    raise AssertionError(f"{first} is in a component but on no loop")


def cycles(known, edges: list[Edge]) -> list[str]:
    """One report per import cycle: a loop with the file:line of each edge, then the other edges
    inside the same component (all of them must go for the cycle to be gone)."""
    succ: dict[str, set[str]] = {}
    by_pair: dict[tuple[str, str], list[Edge]] = {}
    for e in edges:
        if e.dst in known and e.dst != e.src:
            succ.setdefault(e.src, set()).add(e.dst)
            by_pair.setdefault((e.src, e.dst), []).append(e)
    reports = []
    for comp in strongly_connected(known, succ):
        if len(comp) < 2:
            continue
        inside = set(comp)
        loop = _loop(comp[0], succ, inside)
        pairs = list(zip(loop, loop[1:]))
        lines = [f"cycle of {len(comp)} modules: " + " -> ".join(loop)]
        lines += [f"    {e}" for pair in pairs for e in by_pair[pair]]
        rest = [e for pair, es in sorted(by_pair.items()) if set(pair) <= inside and pair not in pairs for e in es]
        if rest:
            lines.append("  other edges inside it:")
            lines += [f"    {e}" for e in rest]
        reports.append("\n".join(lines))
    return reports


def simulation_imports(root: Path) -> list[str]:
    _, edges = import_graph(root)
    serving = [e for e in edges if any(e.path == p or (p.endswith("/") and e.path.startswith(p)) for p in SERVING_PATH)]
    return [str(e) for e in serving if e.dst == SIMULATION or e.dst.startswith(SIMULATION + ".")]


def test_imports_point_downward_only():
    found = violations(ROOT)
    assert not found, "upward imports:\n" + "\n".join(found)


def test_no_import_cycles():
    found = cycles(*import_graph(ROOT))
    assert not found, f"{len(found)} import cycle(s):\n" + "\n".join(found)


def test_the_serving_path_does_not_import_the_simulation():
    found = simulation_imports(ROOT)
    assert not found, "the serving path imports the simulation (a simulated deployment plugs in):\n" + "\n".join(found)


def test_no_benchmark_or_test_only_code_in_the_core():
    assert not list((ROOT / "core").glob("bench/*.py")), "benchmarks live beside the CLI: workbench/bench/"
    assert not (ROOT / "core" / "trace" / "synthetic.py").exists(), "test-only code lives in tests/"
    assert not (ROOT / "core" / "trace" / "workloads.py").exists(), "workloads drive an Engine: workbench/"


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_walk_sees_every_kind_of_import(tmp_path):
    """Relative imports at any depth, imports inside functions and under TYPE_CHECKING, literal
    dynamic imports, and the module paths named by a module that imports by a computed name."""
    root = _tree(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/trace/__init__.py": "",
            "core/trace/events.py": "",
            "core/trace/state.py": (
                "from typing import TYPE_CHECKING\n"
                "from . import events\n"
                "from .events import Event\n"
                "if TYPE_CHECKING:\n"
                "    from ..engine import Engine\n"
                "def f():\n"
                "    import importlib\n"
                "    importlib.import_module('..args', __package__)\n"
                "    __import__('workbench.tui.app')\n"
                "    from ...cli import main\n"
            ),
            "core/engine.py": "",
            "core/args.py": "",
            "tui/__init__.py": "",
            "tui/app.py": "",
            "tui/registration.py": (
                "PANELS = ('workbench.tui.app', 'not.ours')\n"
                "def make(name):\n"
                "    import importlib\n"
                "    return importlib.import_module(name)\n"
            ),
            "workbench/__init__.py": "",
            "workbench/cli.py": "",
        },
    )
    known, edges = import_graph(root)
    assert {(e.src.rsplit(".", 1)[-1], e.dst, e.line, e.how) for e in edges if e.dst in known} == {
        ("state", "workbench.core.trace.events", 2, "from"),
        ("state", "workbench.core.trace.events", 3, "from"),
        ("state", "workbench.core.engine", 5, "from"),
        ("state", "workbench.core.args", 8, "dynamic"),
        ("state", "workbench.tui.app", 9, "dynamic"),
        ("state", "workbench.cli", 10, "from"),
        ("registration", "workbench.tui.app", 1, "named"),
    }
    found = violations(root)
    assert [line.split(": ", 1)[0] for line in found] == [
        "core/trace/state.py:5",
        "core/trace/state.py:9",
        "core/trace/state.py:10",
    ], found
    assert "the trace package imports the engine side" in found[0]
    assert "the core imports something outside the core" in found[1] and "workbench.cli" in found[2]


def test_the_check_catches_an_upward_import(tmp_path):
    """A core module that imports the CLI, and a kernel that imports the runner."""
    root = _tree(
        tmp_path,
        {
            "core/mem_cache/leaky.py": "def f():\n    from workbench.cli import main\n",
            "core/layers/k.py": (
                "from workbench.core.model_executor.model_runner import ModelRunner\n"
                "from workbench.core.model_executor.forward_batch_info import ForwardBatch\n"
            ),
        },
    )
    found = violations(root)
    assert len(found) == 2
    assert "workbench.core.layers.k -> workbench.core.model_executor.model_runner" in found[0]
    assert "a kernels package imports a runner" in found[0]
    assert "workbench.core.mem_cache.leaky -> workbench.cli (from) (the core imports something outside" in found[1]


def test_the_cycle_check_finds_each_loop_with_its_lines(tmp_path):
    """Two cycles: a package __init__ that re-exports a submodule which imports a name from the
    package, and two modules that import each other, one of them inside a function."""
    root = _tree(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/trace/__init__.py": "from .state import TraceState\nVERSION = 1\n",
            "core/trace/state.py": "from workbench.core.trace import VERSION\nclass TraceState: ...\n",
            "core/trace/events.py": "from workbench.core.trace import state\n",  # to a module: no edge to __init__
            "workbench/__init__.py": "",
            "workbench/scenarios.py": "from workbench.workloads import run\n",
            "workbench/workloads.py": "def run():\n    pass\n\ndef record():\n    from . import scenarios\n",
        },
    )
    found = cycles(*import_graph(root))
    assert found == [
        "cycle of 2 modules: workbench.core.trace -> workbench.core.trace.state -> workbench.core.trace\n"
        "    core/trace/__init__.py:1: workbench.core.trace -> workbench.core.trace.state (from)\n"
        "    core/trace/state.py:1: workbench.core.trace.state -> workbench.core.trace (from)",
        "cycle of 2 modules: workbench.scenarios -> workbench.workloads -> workbench.scenarios\n"
        "    workbench/scenarios.py:1: workbench.scenarios -> workbench.workloads (from)\n"
        "    workbench/workloads.py:5: workbench.workloads -> workbench.scenarios (from)",
    ], "\n".join(found)
    (root / "workbench" / "workloads.py").write_text("def run():\n    pass\n")
    assert len(cycles(*import_graph(root))) == 1


def test_a_longer_cycle_is_shown_as_one_loop_and_its_other_edges(tmp_path):
    root = _tree(
        tmp_path,
        {
            "workbench/__init__.py": "",
            "workbench/a.py": "import workbench.b\n",
            "workbench/b.py": "import workbench.c\n",
            "workbench/c.py": "def f():\n    import importlib\n    importlib.import_module('workbench.a')\n",
            "workbench/d.py": "import workbench.a\n",  # into the cycle, not on it
        },
    )
    (found,) = cycles(*import_graph(root))
    assert found.splitlines() == [
        "cycle of 3 modules: workbench.a -> workbench.b -> workbench.c -> workbench.a",
        "    workbench/a.py:1: workbench.a -> workbench.b (import)",
        "    workbench/b.py:1: workbench.b -> workbench.c (import)",
        "    workbench/c.py:3: workbench.c -> workbench.a (dynamic)",
    ]


def test_the_serving_path_check_catches_a_simulation_import(tmp_path):
    root = _tree(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/simulation/__init__.py": "",
            "core/simulation/live.py": "",
            "core/managers/scheduler.py": "def f():\n    from workbench.core.simulation import live\n",
            "core/engine.py": "from ..core import simulation\n",  # resolves to workbench.core.simulation
            "core/deployment.py": "from workbench.core.simulation.live import x\n",  # not on the serving path
        },
    )
    found = simulation_imports(root)
    assert [line.split(": ", 1)[0] for line in found] == ["core/engine.py:1", "core/managers/scheduler.py:2"], found
