"""The test layout holds: the folder is the tier (docs/testing.md).

tests/fast is `make test`, run after every change; tests/e2e is the rest of what CI runs. A test file left
at tests/ itself would be in neither `make test` nor its folder's tier, and a fast test that loads the
reference model or starts a server would make `make test` slow without anyone deciding it. These checks
read source only (no imports), so they cost milliseconds.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TIERS = ("fast", "e2e")
# conftest fixtures that load the real default model beside transformers' reference (minutes on 2 cores),
# or serve it (a three-process engine behind the HTTP server).
REFERENCE_MODEL_FIXTURES = {"hf_model", "runner_fp32", "served_16k"}
# Calls that start a three-process engine or a server. The fast files allowed to make them, and why.
STARTS_PROCESSES = re.compile(r"(?<![A-Za-z_.])(Engine|start_server|served_engine|launch_server|ServerProcess)\(")
STARTS_PROCESSES_OK = {
    "test_gpu_only.py": "the engine runs only on CUDA; without it those tests skip",
}


def _test_files(tier: str) -> list[Path]:
    return sorted((TESTS / tier).glob("test_*.py"))


def test_every_test_file_is_in_a_tier_folder():
    assert not sorted(p.name for p in TESTS.glob("test_*.py")), "move it to tests/fast or tests/e2e"
    for tier in TIERS:
        assert _test_files(tier), f"tests/{tier} has no test files"
        # One conftest (tests/conftest.py) and no packages: pytest's default import mode puts each
        # test file's folder and tests/ on sys.path, which is how the helper modules are imported.
        assert not (TESTS / tier / "conftest.py").exists() and not (TESTS / tier / "__init__.py").exists()
        stray = [p.name for p in (TESTS / tier).glob("*.py") if not p.name.startswith("test_")]
        assert not stray, f"helper modules live in tests/, not tests/{tier}: {stray}"


def test_test_file_names_are_unique_across_tiers():
    # Two test modules with one basename cannot both be imported without packages.
    names = [p.name for tier in TIERS for p in _test_files(tier)]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})


def test_the_tier_is_the_folder_and_markers_are_registered_once():
    conftest = (TESTS / "conftest.py").read_text()
    assert "addinivalue_line" not in conftest, "markers are registered in pyproject.toml only"
    pyproject = (TESTS.parent / "pyproject.toml").read_text()
    assert "--strict-markers" in pyproject
    for tier in TIERS:
        for path in _test_files(tier):
            assert not re.search(r"pytest\.mark\.(e2e|fast)\b", path.read_text()), (
                f"{path.name}: the folder is the tier"
            )


def test_fast_tests_leave_the_reference_model_and_servers_to_e2e():
    found = []
    for path in _test_files("fast"):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                asked = {a.arg for a in node.args.args + node.args.kwonlyargs} & REFERENCE_MODEL_FIXTURES
                if asked:
                    found.append(f"{path.name}:{node.lineno} {node.name} uses {sorted(asked)}")
        hit = STARTS_PROCESSES.search(text)
        if hit is not None and path.name not in STARTS_PROCESSES_OK:
            found.append(f"{path.name} calls {hit.group(0)}")
    assert not found, "these belong in tests/e2e:\n" + "\n".join(found)
