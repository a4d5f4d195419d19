"""`pause on` against a live engine (a simulated deployment: the real tokenizer manager, scheduler
and detokenizer processes over a simulated worker): the TUI pauses the real scheduler through its
controller when a prompt starts a chunked prefill, says why, the scheduler then runs no step until
`p`, and the request finishes after it. The replayed checks are tests/fast/test_step_history.py."""

from __future__ import annotations

import threading
import time

import pytest

# sim_speed 0.02: each simulated pass takes 50x its time on the wall clock (a 64-token chunk of a 70B
# on 8 H100s: ms), so the prefill is still running when the TUI's pause lands (it polls at 10 Hz)
SIM = dict(
    simulate="h100",
    model_path="llama-3.1-70b",
    tp_size=8,
    show_progress=False,
    chunked_prefill_size=64,
    sim_speed=0.02,
)


@pytest.fixture(scope="module")
def engine():
    from workbench.core.engine import Engine

    eng = Engine(**SIM)
    yield eng
    eng.shutdown()


async def test_pause_on_chunk_pauses_the_real_scheduler_until_p(engine):
    from tui_helpers import wait_for
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.controller import EngineController

    ctl = EngineController(engine=engine, max_new_tokens=4)
    app = WorkbenchApp(ctl, pause_on=["chunk"], layout="tabs")
    out: list = []
    async with app.run_test(size=(140, 40)) as pilot:
        await wait_for(app.ready.is_set, 60)
        prompt = list(range(100, 400))  # 300 tokens against a 64-token chunk: 5 chunks
        t = threading.Thread(
            target=lambda: out.append(
                engine.generate(input_ids=[prompt], sampling_params={"max_new_tokens": 4, "temperature": 0.0})
            ),
            daemon=True,
        )
        t.start()
        await wait_for(lambda: app.paused_on is not None and ctl.paused, 60)
        hit = app.paused_on
        assert hit.kind == "chunk" and "prefilled in 5 chunks" in hit.line, hit
        line = str(app.query_one("#pauseon").render())
        assert f"paused on chunk at step {hit.step}" in line and "p resumes" in line, line
        # the scheduler itself is paused: no step runs while the TUI waits, the request is not done
        await pilot.pause()
        ran = engine.step_gate("pause")["step"]  # already paused: this only reads where it stands
        time.sleep(1.0)
        assert not out and t.is_alive()
        assert engine.step_gate("pause")["step"] == ran
        await pilot.press("p")
        await wait_for(lambda: bool(out), 60)
        assert out[0][0]["meta_info"]["completion_tokens"] == 4
        assert not ctl.paused and app.paused_on is None
