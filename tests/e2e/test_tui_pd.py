"""`workbench tui --disaggregation` (issue #38 item 4): a real 1P1D pair (two Engines in this process,
the KV moving over the TCP transport) in the real app. Both servers side by side in the Prefill |
Decode panel, labelled by role; a request's journey (prefill queue → prefill → transfer → decode)
in that panel and in Request detail, whose TTFT parts sum exactly to the TTFT."""

from __future__ import annotations

import pytest
from textual.widgets import Static
from tui_helpers import wait_for
from workbench.tui.fmt import plain_text

pytestmark = pytest.mark.timeout(300)


async def test_tui_disaggregation_shows_both_servers_and_the_journey():
    import argparse

    from workbench.core.args import ServerArgs
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.cli import add_tui_args, make_controller
    from workbench.tui.pd import PDController

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    add_tui_args(parser)
    args = parser.parse_args(
        ["--disaggregation", "--workload", "chat", "--rate", "4", "--workload-max-new-tokens", "4"]
        + ["--max-total-tokens", "4096", "--random-seed", "0"]
    )
    controller = make_controller(args)
    assert isinstance(controller, PDController)
    app = WorkbenchApp(controller, layout="grid")
    async with app.run_test(size=(180, 60)) as pilot:
        await wait_for(app.ready.is_set, 120)
        st = app.model.state

        def finished_pd():  # decode-side requests whose prefill side and transfer are in the trace
            return [
                rid
                for rid, r in st.requests.items()
                if r.state == "finished" and st.pd.role(rid) == "decode" and "decode" in st.pd.room_of(rid).transfers
            ]

        await wait_for(lambda: len(finished_pd()) >= 2, 90)
        assert st.pd.role_label("scheduler.dp0") == "prefill" and st.pd.role_label("scheduler.dp1") == "decode"
        rid = finished_pd()[0]
        app.select_request(rid)
        await wait_for(lambda: "pd" in app.panels, 10)  # the panel joins with the first pd.* event
        await pilot.pause(0.5)
        app.refresh_panels(force=True)
        await pilot.pause(0.2)

        b = st.ttft_parts(rid)
        r = st.requests[rid]
        assert sum(p.ns for p in b.parts) == b.ttft_ns == r.first_token_ts - r.arrival_ts
        kinds = [p.kind for p in b.parts]
        assert kinds[0] == "arrived" and kinds[-1] == "first_token"
        for k in ("decode_queue", "prefill", "transfer"):  # prefill_queue too, when the prefill was the later
            assert k in kinds, kinds
        assert kinds.index("prefill") < kinds.index("transfer") and kinds.index("decode_queue") < kinds.index(
            "transfer"
        )

        pd = app.panels["pd"]
        prefill_pane = plain_text(pd.query_one("#pd-prefill", Static).content, 90)
        decode_pane = plain_text(pd.query_one("#pd-decode", Static).content, 90)
        assert "PREFILL" in prefill_pane and "scheduler.dp0" in prefill_pane
        assert "DECODE" in decode_pane and "prealloc queue" in decode_pane and "transfers" in decode_pane
        journey = plain_text(pd.query_one("#pd-journey", Static).content, 200)
        assert f"journey of {rid}" in journey
        stages = [ln.split("s ", 1)[1][:14].strip() for ln in journey.splitlines()[1:] if ln.strip().startswith("+")]
        order = [stages.index(s) for s in ("prefill queue", "prefill", "transfer", "decode")]
        assert order == sorted(order) and "decode queue" in stages, journey
        assert "tokens" in journey and ("MB" in journey or "KB" in journey)  # the transfer's size

        errors = [ln.text for ln in app.model.log.lines if ln.category == "error"]
        assert not app._broken_panels, errors
        detail = plain_text(app.panels["detail"].query_one("#detail-body", Static).content, 200)
        assert "decode side of room" in detail and "journey" in detail
        for label in ("decode queue", "prefill queue", "transfer", "first token"):
            assert label in detail, detail
        assert "ATTACHED" not in app.controller.status() and "1P1D" in app.controller.status()
        queues_title = str(app.panels["queues"].border_title)
        assert "dp0 prefill" in queues_title and "dp1 decode" in queues_title
        # the prompt box goes through the pair too: the answer is the decode server's
        app.send_prompt("Say hello.")
        await wait_for(app.chat_done.is_set, 60)
        assert app.last_answer.strip(), "no answer through the PD pair"
        chat = next(r for r in st.requests if r.startswith("chat-") and st.pd.role(r) == "decode")
        assert st.pd.peer(chat) == f"{chat}.p"
        await pilot.press("q")


def test_attach_of_a_real_pair_labels_the_servers_and_joins_them():
    """`workbench tui --attach P D`: two servers publishing their traces (--trace-publish), requests
    sent to both with a room as a PD router does; the attach controller says which server is which and
    the merged picture joins each request's two sides."""
    import random
    import threading
    import time

    from workbench.core.engine import Engine
    from workbench.core.entrypoints.server_process import free_port
    from workbench.core.trace.state import TraceState
    from workbench.tui.controller import MultiAttachController

    bp, pa, da = free_port(), f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    kw = dict(show_progress=False, max_total_tokens=4096, random_seed=0)
    prefill = Engine(disaggregation_mode="prefill", disaggregation_bootstrap_port=bp, trace_publish=pa, **kw)
    decode = Engine(disaggregation_mode="decode", trace_publish=da, **kw)
    ctl = MultiAttachController([pa, da])
    try:
        ctl.start(lambda _: None)
        time.sleep(1.0)  # the subscriptions connect before the requests' events are published
        st = TraceState()
        sp = {"max_new_tokens": 4, "temperature": 0}
        for i, prompt in enumerate(["The capital of France is", "List three colours:"]):
            pd = dict(bootstrap_host="127.0.0.1", bootstrap_port=bp, bootstrap_room=random.getrandbits(63))
            t = threading.Thread(target=prefill.generate, args=(prompt, sp), kwargs=pd)
            t.start()
            decode.generate(prompt, sp, rid=f"d{i}", **pd)
            t.join()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            st.apply_many(ctl.drain())
            done = [r for r in ("d0", "d1") if st.pd.room_of(r) and "decode" in st.pd.room_of(r).transfers]
            if len(done) == 2 and all(st.pd.peer(r) in st.requests for r in done):
                break
            time.sleep(0.1)
        assert "dp0 prefill, dp1 decode" in ctl.status()
        assert st.pd.role_label("scheduler.dp0") == "prefill" and st.pd.role_label("scheduler.dp1") == "decode"
        for rid in ("d0", "d1"):
            b = st.ttft_parts(rid)
            assert b is not None and not b.partial
            assert sum(p.ns for p in b.parts) == b.ttft_ns
            assert {"decode_queue", "prefill", "transfer"} <= {p.kind for p in b.parts}
    finally:
        ctl.close()
        decode.shutdown()
        prefill.shutdown()
