"""Every walkthrough notebook runs top to bottom in a fresh kernel (nbclient), as a reader would run it.

The notebooks prove their points with assertions on live trace output, so a
notebook that "runs" but no longer shows what its prose claims fails here too.
Cells tagged `skip-ci` (GPU-only) are left out. Executed copies (with outputs)
are written to $WORKBENCH_ARTIFACTS/notebooks (default: out/test-artifacts/notebooks)
for inspection; the notebooks in git stay without outputs (checked below).
"""

from __future__ import annotations

import os
import re
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[2]
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
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    t0 = time.monotonic()
    try:
        client.execute()
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, ARTIFACTS / path.name)
    print(f"{path.name}: {time.monotonic() - t0:.1f} s")
    # Start-up progress is ordinary output in a kernel: a front end draws stderr as an error box.
    pink = [
        i
        for i, c in enumerate(nb.cells)
        for o in c.get("outputs", [])
        if o.get("name") == "stderr" and "[workbench]" in o.get("text", "")
    ]
    assert not pink, f"{path.name}: engine start-up lines on stderr in cells {pink}"
    check = PICTURE_CHECKS.get(path.stem)
    if check is not None:
        check(snapshots(nb))
    check = OUTPUT_CHECKS.get(path.stem)
    if check is not None:
        check(nb)


# ---- the pictures the walkthroughs keep -------------------------------------------------------------
# Where the text talks about a moment, the notebook shows a static picture of it
# (widgets/static.py): inline SVG in an HTML output, kept in the executed notebook.

SVG = "{http://www.w3.org/2000/svg}"


def snapshots(nb) -> dict[str, ET.Element]:
    """Every static picture in the executed notebook's outputs, by name (data-name)."""
    found = {}
    for c in nb.cells:
        for o in c.get("outputs", []):
            html = (o.get("data") or {}).get("text/html", "")
            if "workbench-snapshot" in html:
                root = ET.fromstring(html)  # well-formed: inline SVG in a div
                found[root.get("data-name")] = root
    return found


def view(root: ET.Element, name: str) -> ET.Element:
    return next(e for e in root.iter(f"{SVG}svg") if e.get("data-view") == name)


def spans(root: ET.Element, rid: str, kind: str) -> list[ET.Element]:
    return [
        e
        for e in view(root, "gantt").iter(f"{SVG}rect")
        if e.get("class") == "span" and e.get("data-rid") == rid and e.get("data-kind") == kind
    ]


def nodes(root: ET.Element) -> list[ET.Element]:
    return [e for e in view(root, "radix").iter(f"{SVG}rect") if e.get("class") == "node"]


def check_03(snaps: dict) -> None:
    moment = snaps["after-15-steps"]  # A stalls behind B's chunks: the picture must show it
    assert len(spans(moment, "A", "decode")) >= 2, "A's decode bar has a gap"
    assert len(spans(moment, "B", "prefill")) >= 2, "B is prefilled in chunks"
    assert spans(moment, "C", "prefill") and spans(moment, "C", "queued")
    assert int(view(moment, "batch").get("data-steps")) >= 15
    segs = [e for e in view(moment, "batch").iter(f"{SVG}rect") if e.get("class") == "seg"]
    assert {"computed", "decode"} <= {e.get("data-kind") for e in segs}
    assert "last step:" in "".join(moment.itertext())  # the narrated step line
    marks = [(e.get("data-rid"), e.get("data-mark")) for e in moment.iter() if e.get("class") == "mark"]
    assert {("A", "first_token"), ("B", "first_token"), ("C", "first_token")} <= set(marks)
    assert view(moment, "kv").get("data-capacity") == "192"
    waiting = [e for e in view(moment, "queues").iter(f"{SVG}polyline") if e.get("data-kind") == "waiting"]
    assert int(waiting[0].get("data-max")) >= 1, "each request waited a moment before its step: the line shows it"

    # issue #40 item 13: the pool runs dry at the end and the scheduler retracts a request
    retraction = snaps["retraction"]
    marks = {e.get("data-mark") for e in retraction.iter() if e.get("class") == "mark"}
    assert "retracted" in marks, "the picture of the retraction shows one"


def check_04(snaps: dict) -> None:
    def children(root):
        kids: dict[str, int] = {}
        for n in nodes(root):
            kids[n.get("data-parent")] = kids.get(n.get("data-parent"), 0) + 1
        return kids

    shared = snaps["prefix-shared"]
    inner = [n.get("data-node") for n in nodes(shared) if n.get("data-state") != "root"]
    assert max(children(shared).get(n, 0) for n in inner) >= 2, "the shared prefix is one node, a leaf per question"
    assert max(children(snaps["tree-grows"]).values()) >= 4
    locked = [n for n in nodes(snaps["locked"]) if n.get("data-state") == "locked"]
    assert locked and all(int(n.get("data-lock")) >= 1 for n in locked)
    assert re.search(r"\[lock \d+\]", "".join(view(snaps["locked"], "radix").itertext()))
    assert not [n for n in nodes(snaps["released"]) if n.get("data-state") == "locked"]
    # (an evicted node stays in the picture, in the evicted colour, until the next tree snapshot)
    cached = lambda root: [n.get("data-label") for n in nodes(root) if n.get("data-state") != "evicted"]  # noqa: E731
    assert any(lb.startswith("Rivers") for lb in cached(snaps["first-three"]))
    after = snaps["after-eviction"]
    assert int(after.get("data-evicted")) > 0
    ghosts = [n for n in nodes(after) if n.get("data-state") == "evicted"]
    assert ghosts, "the picture after the eviction (its legend says evicted) draws what was evicted"
    assert not any(lb.startswith("Rivers") for lb in cached(after)), "the oldest prompt was evicted"
    assert any(lb.startswith("Valleys") for lb in cached(after)), "the newest is still cached"
    assert view(after, "kv").get("data-capacity") == "1024"


PICTURE_CHECKS = {"03_scheduler": check_03, "04_radix_cache": check_04}


# ---- what the walkthroughs print (issue #40 item 13) -------------------------------------------------

HEX_RID = re.compile(r"\b[0-9a-f]{32}\b")  # an engine-made rid: names in text and captions instead


def text_outputs(nb) -> list[str]:
    """Each code cell's printed and displayed text (stdout, text/plain, text/html), one string per cell."""
    out = []
    for c in nb.cells:
        if c.cell_type != "code":
            continue
        parts = []
        for o in c.get("outputs", []):
            parts.append(o.get("text", ""))
            data = o.get("data") or {}
            parts += [data.get("text/plain", ""), data.get("text/html", "")]
        out.append("".join(parts))
    return out


def output_checks_03(nb) -> None:
    text = "\n".join(text_outputs(nb))
    assert not re.search(r"\bstep\s+-1\b", text), "a timeline line says 'step -1' (before any step)"
    # the step costs: the first pass of a fresh engine is far slower than its tokens explain, and says so
    lines = re.findall(r"^step\s+\d+ \w+\s+\d+ tokens\s+forward\s+([\d.]+) ms.*$", text, re.M)
    full = [ln for ln in text.splitlines() if re.match(r"^step\s+\d+ \w+\s+\d+ tokens\s+forward", ln)]
    assert len(lines) >= 15, full
    ms = [float(x) for x in lines]
    typical = sorted(ms[1:])[len(ms[1:]) // 2]
    if ms[0] > 3 * typical:
        assert "warm-up" in full[0], f"the slow first step is not explained: {full[0]}"
    assert "waiting" in text and "(C: budget)" in text, "the table shows C waiting for the token budget"


def output_checks_04(nb) -> None:
    outs = text_outputs(nb)
    top = next(o for o in outs if "widest node has" in o)
    assert "''" not in top and "node 0:" not in top, f"the root is not a cached prefix: {top}"
    snaps = [o for o in outs if "workbench-snapshot" in o]
    assert snaps and not any(HEX_RID.search(o) for o in snaps), "a picture's caption names a request by a 32-hex rid"


OUTPUT_CHECKS = {"03_scheduler": output_checks_03, "04_radix_cache": output_checks_04}
