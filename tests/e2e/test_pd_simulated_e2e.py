"""Live simulated PD (issue #38 item 5, core/simulation/pd_live.py): a simulated prefill Engine and a
simulated decode Engine (70B on 8 H100s each) behind the TUI's PD pair, the room's meta over the real
TCP transport, each transfer timed by the link model on the decode side's simulated clock.

Checked: every request ends with its full output; the decode side's pd.transfer carries the prompt's
tokens x the model's KV bytes per token and the link model's ms; the first token waits for that
transfer; the TTFT parts of the joined trace sum exactly to the TTFT; the two servers' clocks agree;
and `workbench tui --disaggregation --simulate ...`'s app shows the SIMULATED badge and both servers."""

from __future__ import annotations

import threading
import time

import pytest
from textual.widgets import Static
from tui_helpers import wait_for
from workbench.core.trace import events as ev
from workbench.tui.fmt import plain_text

pytestmark = pytest.mark.timeout(300)

SIM = dict(simulate="h100", model_path="llama-3.1-70b", tp_size=8, show_progress=False)


@pytest.fixture(scope="module")
def pair():
    from workbench.core.engine import Engine
    from workbench.core.entrypoints.server_process import free_port
    from workbench.tui.pd import PDPair

    port = free_port()
    prefill = Engine(disaggregation_mode="prefill", disaggregation_bootstrap_port=port, **SIM)
    try:
        decode = Engine(disaggregation_mode="decode", **SIM)
    except BaseException:
        prefill.shutdown()
        raise
    p = PDPair(prefill, decode, port)
    yield p
    p.shutdown()


def test_requests_through_a_simulated_pair_wait_for_their_modelled_transfer(pair):
    from workbench.core.simulation import live
    from workbench.core.simulation.pd import pd_link
    from workbench.core.trace.state import TraceState

    assert pair.clock is pair.decode.clock and pair.clock.simulated
    cost = live._cost_model(pair.decode.server_args)
    link = pd_link(cost.model, cost.hw, cost.dtype_bytes, 8, 8)
    assert link.bytes_per_token == 80 * 8 * 128 * 2 * 2  # 70B: 80 layers, 8 KV heads of 128, k and v, bf16

    sub = pair.subscribe(with_snapshot=False, name="test")
    new = 6
    prompts = {f"q{i}": list(range(100 + i, 100 + i + n)) for i, n in enumerate((300, 1200, 2500, 4000))}
    outs: dict[str, dict] = {}

    def one(rid: str) -> None:
        outs[rid] = pair.generate(
            input_ids=prompts[rid], sampling_params={"max_new_tokens": new, "temperature": 0}, rid=rid
        )

    threads = [threading.Thread(target=one, args=(rid,)) for rid in prompts]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(120)
    assert set(outs) == set(prompts)
    for rid, out in outs.items():  # the client's answer (the decode server's): the full output
        meta = out["meta_info"]
        assert meta["completion_tokens"] == new and meta["finish_reason"]["type"] == "length", (rid, meta)
        assert meta["prompt_tokens"] == len(prompts[rid])

    st = TraceState()
    events: list = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got = sub.drain()
        events += got
        st.apply_many(got)
        if all(st.pd.room_of(r) and len(st.pd.room_of(r).transfers) == 2 for r in prompts):  # both sides' ends
            break
        time.sleep(0.05)
    sub.close()
    transfers = {e.rid: e for e in events if isinstance(e, ev.PDTransfer) and e.role == "decode"}
    for rid, ids in prompts.items():
        t = transfers[rid]
        assert t.ok and t.tokens == len(ids)
        assert t.nbytes == len(ids) * link.bytes_per_token  # what the deployment would have moved
        assert t.ms == pytest.approx(link.transfer_s(len(ids)) * 1e3)
        assert t.ms > 0.1  # 4000 tokens of 70B KV: 1.3 GB, milliseconds over 8 x 400 Gb/s
        # the prefill side reports the same modelled handover
        peer = st.pd.room_of(rid).transfers["prefill"]
        assert peer.nbytes == t.nbytes and peer.ms == pytest.approx(t.ms)
        # the TTFT, split along the journey, sums exactly; the first token came after the modelled bytes
        b = st.ttft_parts(rid)
        r = st.requests[rid]
        assert b is not None and not b.partial
        assert sum(p.ns for p in b.parts) == b.ttft_ns == r.first_token_ts - r.arrival_ts
        kinds = [p.kind for p in b.parts]
        assert "prefill" in kinds and "transfer" in kinds and kinds[-1] == "first_token", kinds
        wire = next(p for p in b.parts if p.kind == "transfer" and p.label == "transfer")
        assert wire.ns == pytest.approx(t.ms * 1e6, abs=1e3)
        assert outs[rid]["meta_info"]["ttft"] * 1e3 >= t.ms
    # the prefill of the longest prompt took longer (simulated) than the shortest's
    pre = {rid: sum(p.ns for p in st.ttft_parts(rid).parts if p.kind == "prefill") for rid in prompts}
    assert pre["q3"] > pre["q0"]
    # both servers' clocks agree: each is paced to the wall clock and, idle, back on speed x monotonic time
    time.sleep(0.3)  # both idle again
    for engine in (pair.prefill, pair.decode):
        off_ms = abs(engine.clock.now_ns() - time.monotonic_ns()) / 1e6  # --sim-speed 1
        assert off_ms < 100, off_ms
    for engine in (pair.prefill, pair.decode):  # nothing held on either side
        state = engine.get_internal_state()["disaggregation"]
        assert state.get("pd_held", 0) == 0 and state.get("pd_transferring", 0) == 0, state


async def test_tui_shows_a_simulated_pair_with_its_badge(pair):
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.pd import PDController

    controller = PDController(pair, workload="chat", rate=4, max_new_tokens=4)
    app = WorkbenchApp(controller, layout="grid")
    async with app.run_test(size=(180, 60)) as pilot:
        await wait_for(app.ready.is_set, 60)
        st = app.model.state

        def finished_pd():
            return [
                rid
                for rid, r in st.requests.items()
                if r.state == "finished" and st.pd.role(rid) == "decode" and "decode" in st.pd.room_of(rid).transfers
            ]

        await wait_for(lambda: len(finished_pd()) >= 2, 90)
        status = app.controller.status()
        assert "SIMULATED h100x8" in status and "1P1D" in status, status
        assert st.pd.role_label("scheduler.dp0") == "prefill" and st.pd.role_label("scheduler.dp1") == "decode"
        app.select_request(finished_pd()[0])
        await wait_for(lambda: "pd" in app.panels, 10)
        await pilot.pause(0.5)
        app.refresh_panels(force=True)
        await pilot.pause(0.2)
        pd = app.panels["pd"]
        prefill_pane = plain_text(pd.query_one("#pd-prefill", Static).content, 90)
        decode_pane = plain_text(pd.query_one("#pd-decode", Static).content, 90)
        assert "PREFILL" in prefill_pane and "DECODE" in decode_pane
        journey = plain_text(pd.query_one("#pd-journey", Static).content, 200)
        assert "transfer" in journey and "MB" in journey, journey  # the modelled bytes, not 0 B
        assert not app._broken_panels
        await pilot.press("q")
