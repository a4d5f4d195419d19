"""Regenerate docs/images/tui.png: the TUI on the live default model with a shared-prefix workload.

    .venv/bin/python docs/images/make_tui_png.py

Runs the app headless (Textual's run_test), saves an SVG screenshot and converts it with
../shared/testing/svg_to_png.sh (chromium renders box-drawing and spacing most faithfully).
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SVG_TO_PNG = os.path.join(HERE, "..", "..", "..", "shared", "testing", "svg_to_png.sh")


async def shoot() -> str:
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.controller import EngineController

    ctl = EngineController(server_args={"show_progress": False, "chunked_prefill_size": 64},
                           workload="shared-prefix", rate=0.7, max_new_tokens=16)
    app = WorkbenchApp(ctl, layout="grid")
    async with app.run_test(size=(160, 48)) as pilot:
        while not app.ready.is_set():
            assert not app.startup_error, app.startup_error
            await asyncio.sleep(0.2)
        st = app.model.state
        while st.counters.num_requests_total < 6:
            await asyncio.sleep(0.2)
        running = [r for r in st.running if r.startswith("sp-")]
        app.select_request(running[len(running) // 2] if running else None)
        await pilot.pause(1.0)
        app.refresh_panels(force=True)
        await pilot.pause()
        path = app.save_screenshot("tui.svg", path=HERE)
        await pilot.press("q")
    ctl.close()
    return path


def main() -> int:
    svg = asyncio.run(shoot())
    subprocess.run(["bash", SVG_TO_PNG, svg, os.path.join(HERE, "tui.png"), "--with", "chromium"], check=True)
    os.remove(svg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
