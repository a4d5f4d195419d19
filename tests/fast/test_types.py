"""mypy (configured in pyproject.toml's [tool.mypy]) finds no type error in the typed core: the KV
cache, the trace modules, every module of core/managers (the scheduler and its mixins, the model
worker, the tokenizer / detokenizer managers, the DP controller), the model runner and the
simulator. Part of the fast tier.

setup.py installs core/ as `workbench.core`, through an import hook that mypy does not run, so this
test lays the `workbench` package out as mypy can read it: .mypy_cache/src/workbench holds links to
workbench/'s entries and to core/, tui/ and widgets/. mypy's own cache beside it keeps a second run
to seconds. By hand: `python tests/fast/test_types.py` (the same check, its report on stdout).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / ".mypy_cache" / "src"
# setup.py's mapping: top-level folders installed under the `workbench` package.
MAPPED = {"core": "core", "tui": "tui", "widgets": "widgets"}

# What mypy reports on, as paths from the repository root (a folder: every module in it). Modules
# these import are read for their types but their own errors are not reported (follow_imports=silent).
TYPED = [
    "core/mem_cache",
    "core/trace",
    # the scheduler, its mixins and contract, the model worker, the tokenizer / detokenizer managers
    # and the data-parallel controller: every module of core/managers
    "core/managers",
    "core/model_executor/model_runner.py",
    # the simulator's worker (offline and live)
    "core/simulation/sim_worker.py",
    "core/simulation/simulator.py",
    "core/simulation/live.py",
]


def lay_out_package() -> Path:
    """.mypy_cache/src/workbench: a link per entry of workbench/, plus core/, tui/, widgets/."""
    pkg = SRC / "workbench"
    pkg.mkdir(parents=True, exist_ok=True)
    links = {entry.name: entry for entry in (ROOT / "workbench").iterdir() if entry.name != "__pycache__"}
    links.update({name: ROOT / folder for name, folder in MAPPED.items()})
    for name, target in links.items():
        link = pkg / name
        if link.is_symlink() and Path(os.readlink(link)) == target:
            continue
        if link.is_symlink():
            link.unlink()
        try:
            link.symlink_to(target, target_is_directory=target.is_dir())
        except FileExistsError:  # another run laid it at the same moment
            pass
    return SRC


def mypy_targets(paths: list[str]) -> list[str]:
    """`-p`/`-m` arguments naming each path's module (core/x/y.py -> workbench.core.x.y, a test
    helper tests/x.py -> x, as run_mypy puts tests/ on mypy's path)."""
    args: list[str] = []
    for path in paths:
        parts = Path(path).with_suffix("").parts
        if parts[0] in MAPPED:
            parts = ("workbench", *parts)
        elif parts[0] == "tests" and len(parts) == 2:
            parts = parts[1:]
        elif parts[0] != "workbench":
            raise ValueError(f"{path}: not in the workbench package nor a helper in tests/")
        args += ["-p" if (ROOT / path).is_dir() else "-m", ".".join(parts)]
    return args


def run_mypy(targets: list[str]) -> subprocess.CompletedProcess:
    """mypy over `targets` (mypy_targets' arguments or files), its report with repository paths."""
    lay_out_package()
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *targets],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        # the test helpers (tests/scheduler_harness.py ...) import each other by their bare names
        env={**os.environ, "MYPYPATH": str(ROOT / "tests")},
    )
    proc.stdout = "".join(map(_repo_path, proc.stdout.splitlines(keepends=True)))
    return proc


def _repo_path(line: str) -> str:
    """A report line with its file where it is in the repository, not under the laid-out package."""
    laid = ".mypy_cache/src/workbench/"
    if not line.startswith(laid):
        return line
    rest = line[len(laid) :]
    return rest if rest.split("/")[0] in MAPPED else "workbench/" + rest


def test_mypy_finds_no_type_error_in_the_typed_core():
    pytest.importorskip("mypy", reason="mypy is not installed: pip install -e '.[test]' brings it")
    proc = run_mypy(mypy_targets(TYPED))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def test_mypy_reports_an_error_in_a_checked_module(tmp_path):
    """The check is live: a wrong annotation in a module under TYPED is reported, at its own path."""
    pytest.importorskip("mypy", reason="mypy is not installed: pip install -e '.[test]' brings it")
    bad = tmp_path / "bad.py"
    bad.write_text("from workbench.core.mem_cache.radix_cache import RadixCache\n\nx: RadixCache = 3\n")
    proc = run_mypy([str(bad)])
    assert proc.returncode == 1 and "bad.py:3: error" in proc.stdout, proc.stdout + proc.stderr


# The scheduler's model worker has three implementations: the real one, the tests' stand-in and the
# simulator's; and two overlap clients. Each must satisfy its Protocol in scheduler_contract.py.
CONFORMANCE = """
# A class that did not resolve would be Any and conform to anything: that is an error here. (Set for
# this file only: a command-line option would change every module's options and void mypy's cache.)
# mypy: disallow-any-unimported
from scheduler_harness import StandInWorker
from workbench.core.managers.scheduler_contract import ModelWorker, OverlapWorker
from workbench.core.managers.tp_worker import TpModelWorker
from workbench.core.managers.tp_worker_overlap_thread import TpModelWorkerClient
from workbench.core.simulation.sim_worker import SimOverlapClient, SimWorker


def real(w: TpModelWorker) -> ModelWorker:
    return w


def stand_in(w: StandInWorker) -> ModelWorker:
    return w


def simulated(w: SimWorker) -> ModelWorker:
    return w


def real_overlap(w: TpModelWorkerClient) -> OverlapWorker:
    return w


def simulated_overlap(w: SimOverlapClient) -> OverlapWorker:
    return w
"""


def test_every_model_worker_implements_the_scheduler_contract(tmp_path):
    pytest.importorskip("mypy", reason="mypy is not installed: pip install -e '.[test]' brings it")
    check = tmp_path / "workers_conform.py"
    check.write_text(CONFORMANCE)
    proc = run_mypy([str(check)])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


if __name__ == "__main__":
    result = run_mypy(mypy_targets(sys.argv[1:] or TYPED))
    sys.stdout.write(result.stdout + result.stderr)
    sys.exit(result.returncode)
