"""Every walkthrough notebook runs top to bottom in a fresh kernel (nbclient), as a reader would run it.

The notebooks prove their points with assertions on live trace output, so a
notebook that "runs" but no longer shows what its prose claims fails here too.
Cells tagged `skip-ci` (GPU-only) are left out. Executed copies (with outputs)
are written to $WORKBENCH_ARTIFACTS/notebooks (default: out/test-artifacts/notebooks)
for inspection; the notebooks in git stay without outputs (checked below).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parent.parent
WALKTHROUGHS = sorted((ROOT / "walkthroughs").glob("*.ipynb"))
ARTIFACTS = Path(os.environ.get("WORKBENCH_ARTIFACTS", ROOT / "out" / "test-artifacts")) / "notebooks"
CELL_TIMEOUT_S = 600


def test_there_are_walkthroughs():
    names = [p.name for p in WALKTHROUGHS]
    assert len(names) >= 6, names
    assert all(n[:2].isdigit() and n[2] == "_" for n in names), names


@pytest.mark.parametrize("path", WALKTHROUGHS, ids=[p.stem for p in WALKTHROUGHS])
def test_outputs_are_stripped_in_git(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; strip them before committing"
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# "), "starts with a title"


@pytest.mark.parametrize("path", WALKTHROUGHS, ids=[p.stem for p in WALKTHROUGHS])
def test_walkthrough_runs(path):
    nb = nbformat.read(path, as_version=4)
    nb.cells = [c for c in nb.cells if "skip-ci" not in c.get("metadata", {}).get("tags", [])]
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    t0 = time.monotonic()
    try:
        client.execute()
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, ARTIFACTS / path.name)
    print(f"{path.name}: {time.monotonic() - t0:.1f} s")
