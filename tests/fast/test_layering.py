"""Imports point downward only (issue #16): walks every module's imports with `ast` and fails on an
edge that goes up a layer.

Layers, top to bottom: the CLI, benchmarks and workloads (`workbench.*` outside the three below) and
the views (`workbench.tui`, `workbench.widgets`) over the core (`workbench.core`). Inside the core, the
trace package (events, bus, reducer) knows nothing of the engine side, and the kernels (`core.layers`)
never import a runner, a manager or the engine; they may use the batch description
(`model_executor.forward_batch_info`), as SGLang's attention backends do. Imports inside functions count too.
"""

from __future__ import annotations

import ast
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


def module_name(path: Path) -> str:
    folder = path.relative_to(ROOT).parts[0]
    parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
    return ".".join([PACKAGES[folder], *parts])


def imports_of(source: str) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, node.lineno))
    return out


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


def violations(files) -> list[str]:
    found = []
    for path in files:
        src = module_name(path)
        for dst, line in imports_of(path.read_text()):
            why = upward(src, dst)
            if why:
                found.append(f"{path.relative_to(ROOT)}:{line}: {src} -> {dst} ({why})")
    return found


def _sources():
    for folder in PACKAGES:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_imports_point_downward_only():
    found = violations(_sources())
    assert not found, "upward imports:\n" + "\n".join(found)


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    """The same walk over a core module that imports the CLI, and a kernel that imports the runner."""
    fake = tmp_path / "core" / "mem_cache"
    fake.mkdir(parents=True)
    (fake / "leaky.py").write_text("def f():\n    from workbench.cli import main\n")
    kernel = tmp_path / "core" / "layers"
    kernel.mkdir(parents=True)
    (kernel / "k.py").write_text(
        "from workbench.core.model_executor.model_runner import ModelRunner\n"
        "from workbench.core.model_executor.forward_batch_info import ForwardBatch\n"
    )
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    found = violations([fake / "leaky.py", kernel / "k.py"])
    assert len(found) == 2
    assert "workbench.core.mem_cache.leaky -> workbench.cli (the core imports something outside the core)" in found[0]
    assert "a kernels package imports a runner" in found[1]


def test_no_benchmark_or_test_only_code_in_the_core():
    assert not list((ROOT / "core").glob("bench/*.py")), "benchmarks live beside the CLI: workbench/bench/"
    assert not (ROOT / "core" / "trace" / "synthetic.py").exists(), "test-only code lives in tests/"
    assert not (ROOT / "core" / "trace" / "workloads.py").exists(), "workloads drive an Engine: workbench/"
