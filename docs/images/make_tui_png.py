"""Regenerate the TUI pictures of README and docs/tui.md on the live default model:

    .venv/bin/python docs/images/make_tui_png.py            # both
    .venv/bin/python docs/images/make_tui_png.py eviction   # one of: tui, eviction

- tui.png: `make run`'s scenario (shared-prefix) once a queue has formed, a request selected.
- tui-eviction.png: the kv-pressure scenario stopped (`p`, then `s` one step at a time) on a step
  that evicted cached prefixes to admit waiting requests, so the last-step line, the KV pool
  and the tree show an eviction as it happens.

Runs the app headless (Textual's run_test), saves an SVG screenshot and converts it with
../shared/testing/svg_to_png.sh (chromium renders box-drawing and spacing most faithfully).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SVG_TO_PNG = os.path.join(HERE, "..", "..", "..", "shared", "testing", "svg_to_png.sh")


async def _until(pred, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"gave up after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.1)


async def shoot(name: str) -> str:
    from workbench.core.args import ServerArgs
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.controller import EngineController

    from workbench.scenarios import get_scenario

    scn = get_scenario("shared-prefix" if name == "tui" else "kv-pressure")
    ctl = EngineController(server_args=scn.server_args(ServerArgs(show_progress=False)), scenario=scn)
    app = WorkbenchApp(ctl, layout="grid")
    async with app.run_test(size=(160, 48)) as pilot:
        await _until(lambda: app.ready.is_set() or app.startup_error, 300, "the engine")
        assert not app.startup_error, app.startup_error
        st = app.model.state
        if name == "tui":
            await _until(
                lambda: st.queue_counts()["waiting"] > 0 and st.counters.num_requests_total >= 8, 120, "a waiting queue"
            )
            running = [r for r in st.running if r.startswith("sp-")]
            app.select_request(running[len(running) // 2] if running else None)
        else:
            await _until(lambda: st.counters.evicted_tokens_total > 0, 120, "the first eviction")
            await pilot.press("p")
            await _until(lambda: ctl.paused, 30, "the pause")

            def evicting() -> bool:
                d = st.steps[-1].decision if st.steps else None
                return d is not None and d.evicted > 0

            for _ in range(200):  # one scheduler iteration per `s` until one evicts
                if evicting():
                    break
                before = len(st.steps)
                await pilot.press("s")
                await _until(lambda: len(st.steps) > before, 30, "one step")
            else:
                raise SystemExit("no step evicted in 200 single steps")
            admitted = [r.rid for r in st.steps[-1].reqs if r.computed > 0]
            app.select_request(admitted[0] if admitted else None)
        await pilot.pause(1.0)
        app.refresh_panels(force=True)
        await pilot.pause()
        path = app.save_screenshot(f"{name}.svg", path=HERE)
        await pilot.press("q")
    ctl.close()
    return path


def main(argv: list[str]) -> int:
    names = argv or ["tui", "eviction"]
    for name in names:
        if name not in ("tui", "eviction"):
            raise SystemExit(f"unknown picture {name!r}: tui or eviction")
        svg = asyncio.run(shoot(name))
        png = os.path.join(HERE, "tui.png" if name == "tui" else "tui-eviction.png")
        subprocess.run(["bash", SVG_TO_PNG, svg, png, "--with", "chromium"], check=True)
        os.remove(svg)
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
