"""A live Dashboard in a real JupyterLab page, in Debian's Chromium (Playwright, no downloaded browser).

The test writes a small notebook (engine + Dashboard + a few requests), opens it
in JupyterLab, runs all cells through the app's command registry, and checks in
the page that every plot rendered *with data*: the browser-side plotly figures
hold the points, the Gantt bars and the icicle's nodes are drawn as SVG, and the
header shows the finished requests. The screenshot is kept as an artifact
($WORKBENCH_ARTIFACTS or out/test-artifacts/dashboard.png).

Needs: `apt-get install chromium` and the `test` extra (jupyterlab, playwright,
ipywidgets, plotly, anywidget). Never `playwright install`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("jupyterlab")
pytest.importorskip("plotly")
sync_api = pytest.importorskip("playwright.sync_api")

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("WORKBENCH_ARTIFACTS", ROOT / "out" / "test-artifacts"))
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
# Quiet, deterministic Lab: no news toast, every cell in the DOM (no windowing), no kernel dialog, no autosave.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
        "doNotDisturbMode": True,
    },
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {
        "windowingMode": "none",
        "autoStartDefaultKernel": True,
    },
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
}
NOTEBOOK_CELLS = [
    "from workbench import Engine\nfrom workbench.widgets import Dashboard\n"
    "engine = Engine(max_total_tokens=2048, chunked_prefill_size=64, show_progress=False)\n"
    "dash = Dashboard(engine, height=280)\ndash",
    "system = 'You are a helpful assistant for a course on computer systems. Answer briefly. '\n"
    "prompts = [system + q for q in ('What is a cache?', 'What is a thread?', 'What is a page?',\n"
    "                                'What is a socket?', 'What is a disk?')]\n"
    "engine.generate(prompts[0], {'max_new_tokens': 6, 'temperature': 0, 'ignore_eos': True})\n"
    "outs = engine.generate(prompts[1:], {'max_new_tokens': 8, 'temperature': 0, 'ignore_eos': True})\n"
    "dash.flush()\nprint('finished', dash.state.counters.num_requests_total)",
    "engine.shutdown()",
]
# Per plot: how many data points its browser-side traces hold (x for bars/lines, ids for the icicle).
PLOT_POINTS_JS = """() => Array.from(document.querySelectorAll('.workbench-dashboard .js-plotly-plot')).map(
  g => (g.data || []).reduce((n, t) => n + ((t.ids || t.x || []).length), 0))"""
LAB_STATE_JS = """() => {
  const app = window.jupyterapp; if (!app) return null;
  const w = app.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  if (!k || !w.content || !w.content.model) return null;
  const cells = w.content.model.cells; let pending = 0; const errors = [];
  for (let i = 0; i < cells.length; i++) {
    const c = cells.get(i).toJSON();
    if (c.cell_type !== 'code') continue;
    if (c.execution_count == null) pending++;
    for (const o of (c.outputs || [])) if (o.output_type === 'error') errors.push(`cell ${i}: ${o.ename}: ${o.evalue}`);
  }
  return {status: k.status, pending, errors};
}"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_notebook(path: Path, cells: list[str]) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


@contextlib.contextmanager
def jupyter_lab(root: Path):
    """A JupyterLab server on a free loopback port, rooted at `root`; yields (base_url, token)."""
    env = dict(
        os.environ,
        JUPYTERLAB_SETTINGS_DIR=str(root / "lab-settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(root / "lab-workspaces"),
    )
    for rel, content in LAB_SETTINGS.items():
        f = root / "lab-settings" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(content))
    port, token = _free_port(), secrets.token_hex(16)
    log = open(root / "lab.log", "w+")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--allow-root",
            "--ip=127.0.0.1",
            f"--port={port}",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=root,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"jupyter lab exited:\n{log.read()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("jupyter lab did not start in 120 s") from None
                time.sleep(0.3)
        yield base, token
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.seek(0)
        print("---- jupyter lab log (tail) ----\n" + log.read()[-2000:])
        log.close()


def run_all_cells(page, base: str, token: str, name: str, timeout_s: float = 420) -> None:
    """Open notebook `name` in Lab, run every cell, and wait until all ran; raise on a cell error."""
    page.goto(f"{base}/lab/tree/{name}?token={token}", timeout=120_000)
    page.wait_for_function(f"({LAB_STATE_JS})() !== null && ({LAB_STATE_JS})().status === 'idle'", timeout=120_000)
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    deadline = time.monotonic() + timeout_s
    while True:
        st = page.evaluate(f"({LAB_STATE_JS})()")
        if st and st["errors"]:
            raise AssertionError("cell error: " + "; ".join(st["errors"]))
        if st and st["pending"] == 0 and st["status"] == "idle":
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"cells still running after {timeout_s} s: {st}")
        page.wait_for_timeout(500)


@pytest.fixture
def lab(tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    write_notebook(tmp_path / "dashboard.ipynb", NOTEBOOK_CELLS)
    with jupyter_lab(tmp_path) as server:
        yield server


def test_live_dashboard_renders_with_data_in_jupyterlab(lab):
    base, token = lab
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1900})
            page_errors: list[str] = []
            page.on("pageerror", lambda e: page_errors.append(str(e)))
            run_all_cells(page, base, token, "dashboard.ipynb")
            dash = page.locator(".workbench-dashboard")
            dash.wait_for(state="visible", timeout=60_000)
            page.get_by_text("finished 5").first.wait_for(timeout=30_000)  # the header, from the trace
            deadline = time.monotonic() + 60
            while True:
                points = page.evaluate(PLOT_POINTS_JS)
                if len(points) == 6 and all(n > 0 for n in points):
                    break
                if time.monotonic() > deadline:
                    page.screenshot(path=str(ARTIFACTS / "dashboard-failed.png"))
                    raise AssertionError(
                        f"plots without data in the browser: {points} (see {ARTIFACTS / 'dashboard-failed.png'})"
                    )
                page.wait_for_timeout(500)
            drawn = {
                "gantt bars": page.locator(".workbench-view-gantt .barlayer .point").count(),
                "batch bars": page.locator(".workbench-view-batch .barlayer .point").count(),
                "radix nodes": page.locator(".workbench-view-radix .iciclelayer path.surface").count(),
                "kv lines": page.locator(".workbench-view-kv .scatterlayer .trace").count(),
                "latency lines": page.locator(".workbench-view-latency .scatterlayer .trace").count(),
            }
            page.wait_for_timeout(800)  # let plotly finish its transitions
            dash.screenshot(path=str(shot))
            print("points per plot:", points, "drawn:", drawn, "screenshot:", shot)
            # 5 requests: a queued + prefill + decode bar each at least; the tree: root + shared prefix + leaves
            assert drawn["gantt bars"] >= 15 and drawn["batch bars"] >= 3 and drawn["radix nodes"] >= 4, drawn
            assert drawn["kv lines"] >= 1 and drawn["latency lines"] >= 3, drawn
            assert not page_errors, page_errors
        finally:
            browser.close()
    assert shot.stat().st_size > 20_000


# ---- walkthrough 03 after Run All ------------------------------------------------------------------


def png_pixels(png: bytes) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB/RGBA, non-interlaced PNG (what Chromium writes) into rows of raw pixels.
    (No imaging library in the test extra; the format is simple enough.)"""
    import struct
    import zlib

    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, ihdr = 8, b"", None
    while pos < len(png):
        n, kind = struct.unpack(">I4s", png[pos : pos + 8])
        body = png[pos + 8 : pos + 8 + n]
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    w, h, depth, colour, _, _, interlace = ihdr
    assert depth == 8 and colour in (2, 6) and not interlace, ihdr
    bpp = 3 if colour == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), w * bpp, [], bytearray(w * bpp)
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line if bpp == 3 else b"".join(line[j : j + 3] for j in range(0, stride, 4))))
        prev = line
    return w, h, rows


def count_colour(png: bytes, hex_colour: str) -> int:
    """Pixels of exactly this colour in a screenshot."""
    rgb = bytes.fromhex(hex_colour.lstrip("#"))
    _, _, rows = png_pixels(png)
    return sum(sum(1 for j in range(0, len(r), 3) if r[j : j + 3] == rgb) for r in rows)


@pytest.fixture
def lab_03(tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    shutil.copy(ROOT / "walkthroughs" / "03_scheduler.ipynb", tmp_path / "03_scheduler.ipynb")
    with jupyter_lab(tmp_path) as server:
        yield server


def test_walkthrough_03_keeps_its_gantt_after_run_all(lab_03):
    """Walkthrough 03 in JupyterLab, Run All: its last cell shuts the engine down, yet the Gantt chart
    the text points to is on the page. The kept picture of the 15 stepped steps is drawn (its bars
    have a size on the page and show in a screenshot, in the decode and prefill colours, with A's
    stall as two decode bars), and the live Dashboard at the top is still there with its bars and
    the narrated last step in its header."""
    from workbench.core.trace.palette import PALETTE

    base, token = lab_03
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "walkthrough03-gantt.png"
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1200})
            page_errors: list[str] = []
            page.on("pageerror", lambda e: page_errors.append(str(e)))
            run_all_cells(page, base, token, "03_scheduler.ipynb", timeout_s=540)
            snap = page.locator('.workbench-snapshot[data-name="after-15-steps"]')
            snap.wait_for(state="visible", timeout=30_000)
            gantt = snap.locator("svg.workbench-snapshot-gantt")
            gantt.scroll_into_view_if_needed()
            boxes = [b for b in (r.bounding_box() for r in gantt.locator("rect.span").all()) if b]
            a_decode = gantt.locator('rect.span[data-rid="A"][data-kind="decode"]').count()
            png = gantt.screenshot(path=str(shot))
            drawn = {k: count_colour(png, PALETTE[k]) for k in ("computed", "decode")}
            live = page.locator(".workbench-dashboard .workbench-view-gantt .barlayer .point")
            deadline = time.monotonic() + 60
            while live.count() == 0 and time.monotonic() < deadline:
                page.wait_for_timeout(500)
            last_step = page.locator(".workbench-dashboard .workbench-laststep").first.inner_text()
            print(
                "snapshot bars:",
                len(boxes),
                "A decode bars:",
                a_decode,
                "pixels:",
                drawn,
                "live bars:",
                live.count(),
                "last step:",
                last_step,
                "screenshot:",
                shot,
            )
            assert len(boxes) >= 8 and all(b["width"] >= 1 and b["height"] >= 5 for b in boxes), boxes
            assert a_decode >= 2, "A's decode bar has a gap while B's chunks run"
            assert all(n > 50 for n in drawn.values()), drawn
            assert live.count() >= 6, "the live Dashboard was closed or lost its Gantt bars"
            assert last_step.startswith("last step") and "step" in last_step[9:], last_step
            assert not page_errors, page_errors
        finally:
            browser.close()
