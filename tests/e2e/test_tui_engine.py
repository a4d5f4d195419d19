"""The TUI on the real engine (default model): one engine for the module, few tokens.

Checks that what the panels show is what TraceState holds after a shared-prefix
workload, that stepping runs exactly one scheduler iteration per keypress, and
that the prompt box returns the model's answer.
"""

from __future__ import annotations

import pytest
from textual.widgets import DataTable, Static
from tui_helpers import wait_for
from workbench.tui.fmt import fmt_count, fmt_s, plain_text

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engine():
    from workbench.core.engine import Engine

    eng = Engine(show_progress=False, chunked_prefill_size=64, max_running_requests=8, random_seed=0)
    yield eng
    eng.shutdown()


def _app(engine, **kw):
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.controller import EngineController

    return WorkbenchApp(EngineController(engine=engine, max_new_tokens=4), **kw)


def _path_tokens(tree, nid):
    n, total = tree[nid], 0
    while n is not None:
        total += n.tokens
        n = tree.get(n.parent_id)
    return total


async def test_shared_prefix_workload_stepping_and_panels(engine):
    from workbench.tui.workload import SHARED_SYSTEM, chat_text, make_prompts

    app = _app(engine, layout="grid")
    c = app.controller
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(app.ready.is_set, 30)
        st = app.model.state
        # Pause first, so the four requests queue up and can be walked through step by step.
        await pilot.press("p")
        await wait_for(lambda: app.control_results == 1 and c.paused, 30)
        c.start_workload("shared-prefix", rate=50, max_requests=4, temperature=0.0)

        def sp_rids():
            return sorted((r for r in st.requests if r.startswith("sp-")), key=lambda r: int(r[3:]))

        await wait_for(lambda: len(sp_rids()) == 4 and all(st.requests[r].state == "queued" for r in sp_rids()), 60)
        sp = sp_rids()
        await pilot.pause(0.3)
        # Redraw now: the panels' own refresh runs on a timer that a busy machine can delay.
        app.refresh_panels(force=True)
        await pilot.pause()
        # the queue table shows the queued requests with TraceState's token counts
        table = app.query_one("#queues-table", DataTable)
        rows = {str(table.get_row_at(i)[1]): table.get_row_at(i) for i in range(table.row_count)}
        for rid in sp:
            r = st.requests[rid]
            assert str(rows[rid][0]) == "waiting" and str(rows[rid][2]) == "queued"
            assert str(rows[rid][3]) == str(r.prompt_tokens) and r.prompt_tokens > 60

        # one keypress = exactly one scheduler iteration = one new batch.step
        for k in range(3):
            before = [s.step for s in st.steps]
            results = app.control_results
            await pilot.press("s")
            await wait_for(lambda: app.control_results == results + 1, 60)
            await wait_for(lambda: st.steps and st.steps[-1].step == app.last_step_result, 30)
            await pilot.pause(0.3)  # let any (wrong) extra step show up
            app.refresh_panels(force=True)  # the tables below, drawn from the state just checked
            await pilot.pause()
            new = [s.step for s in st.steps][len(before) :]
            if k == 0:  # after the first step the scheduler lists its queues again
                queued = set(st.waiting) | set(st.running) | set(st.chunked)
                assert queued & set(sp)
                rows = {str(table.get_row_at(i)[1]): table.get_row_at(i) for i in range(table.row_count)}
                for rid in st.running:
                    assert str(rows[rid][0]) == "running"
                for rid in st.waiting:
                    assert str(rows[rid][0]) == "waiting"
            assert new == [app.last_step_result], f"keypress {k}: steps {new}"
            assert not before or new[0] > before[-1]
            batch = app.query_one("#batch-table", DataTable)
            assert str(batch.get_row_at(batch.row_count - 1)[0]) == str(new[0])
        assert c.paused

        await pilot.press("p")  # resume and let the workload finish
        await wait_for(lambda: c.runner.completed + c.runner.failed == 4, 120)
        await wait_for(lambda: all(st.requests[r].done for r in sp), 30)
        await pilot.pause(0.3)
        assert c.runner.failed == 0, c.runner.last_error
        app.refresh_panels(force=True)
        await pilot.pause()

        # batch composition: one row per step in TraceState, same ids, newest last
        batch = app.query_one("#batch-table", DataTable)
        shown = [str(batch.get_row_at(i)[0]) for i in range(batch.row_count)]
        assert shown == [str(s.step) for s in list(st.steps)[-len(shown) :]]
        assert any(s.mode == "extend" and s.cached_tokens > 0 for s in st.steps), "later requests reuse the prefix"

        # the radix tree: the shared prefix ends at one node with several children
        prompts = [next(make_prompts("shared-prefix")) for _ in range(1)]
        assert prompts[0][0]["content"] == SHARED_SYSTEM
        ids = [
            engine.tokenizer.encode(chat_text(engine, m), add_special_tokens=False)
            for m in [p for p, _ in zip(make_prompts("shared-prefix"), range(4))]
        ]
        lcp = 0
        while all(len(x) > lcp for x in ids) and len({x[lcp] for x in ids}) == 1:
            lcp += 1
        tree = st.tree
        forks = [n for n in tree.values() if n.parent_id in tree and _path_tokens(tree, n.node_id) == lcp]
        assert len(forks) == 1, (lcp, [(n.node_id, n.text, _path_tokens(tree, n.node_id)) for n in tree.values()])
        fork = forks[0]
        assert len(fork.children) >= 3
        tree_text = plain_text(app.query_one("#tree-body", Static).content, 200)
        assert f"[{len(fork.children)} children]" in tree_text

        # latency: the numbers on screen are TraceState's percentiles at the app's clock
        now = app.model.now_ns
        pct = st.latency_percentiles(60, now)
        lat_text = plain_text(app.query_one("#latency-body", Static).content, 120)
        line = next(x for x in lat_text.splitlines() if x.split()[:2] == ["TTFT", "60s"])
        assert line.split()[2:5] == [fmt_s(v, compact=True) for v in pct["ttft"]]
        # the requests in Queues (recently finished) carry TraceState's TTFT
        for rid in sp:
            r = st.requests[rid]
            assert r.ttft is not None and r.output_tokens == 4
        await pilot.press("q")
    assert c.runner is None or not c.runner._thread.is_alive()


async def test_prompt_box_returns_the_models_answer(engine):
    from workbench.tui.workload import chat_text

    question = "What is the capital of France?"
    app = _app(engine, layout="grid", chat_max_new_tokens=12)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(app.ready.is_set, 30)
        await pilot.press("slash")
        await pilot.press(*question)
        await pilot.press("enter")
        try:
            await wait_for(app.chat_done.is_set, 120)
        finally:
            print("answer so far:", repr(app.last_answer), app.model.state.requests.get("chat-1"))
        await pilot.pause(0.3)
        rid = app.model.selected
        assert rid and rid.startswith("chat-")
        expected = engine.generate(
            prompt=chat_text(engine, [{"role": "user", "content": question}]),
            sampling_params={"max_new_tokens": app.chat_max_new_tokens, "temperature": 0.0},
        )["text"]
        assert app.last_answer == expected and expected.strip()
        answer = plain_text(app.query_one("#answer", Static).content, 200)
        assert expected.strip()[:30] in " ".join(answer.split())
        await wait_for(lambda: app.model.state.requests.get(rid) and app.model.state.requests[rid].done, 30)
        app.refresh_panels(force=True)
        await pilot.pause()
        detail = plain_text(app.query_one("#detail-body", Static).content, 200)
        assert detail.startswith(rid) and "finished" in detail
        # its TTFT in parts that add up to it, each part named on screen
        b = app.model.state.ttft_parts(rid)
        assert not b.partial and sum(p.ns for p in b.parts) == b.ttft_ns
        assert f"TTFT {fmt_s(b.ttft)} = the parts below" in detail
        assert all(p.label in detail for p in b.parts) and "first token" in detail
        await pilot.press("escape")
        await pilot.press("q")


def _lock_counts(tree_text: str) -> list[int]:
    import re

    return [int(m) for m in re.findall(r" lock (\d+)", tree_text)]


async def test_tree_is_never_stale_and_one_evictable_figure(engine):
    """#15: while stepping, the radix tree is republished at every step boundary where locks or hits
    changed (at most once per step), so its lock counts change between two consecutive steps in which
    a request finished, even when the finish inserts nothing new (same prompt, same greedy answer:
    only the locks move); the tree's title and the KV panel show the same evictable count, and the
    KV panel follows every step."""
    import re
    import threading

    from workbench.core.trace import events as ev
    from workbench.tui.workload import chat_text, make_prompts

    app = _app(engine, layout="grid")
    c = app.controller
    trees_per_step: dict[int, int] = {}
    real_drain = c.drain

    def drain(max_items=None):
        out = real_drain(max_items)
        for e in out:
            if type(e) is ev.CacheTree and e.step >= 0:
                trees_per_step[e.step] = trees_per_step.get(e.step, 0) + 1
        return out

    c.drain = drain
    prompt = chat_text(engine, next(make_prompts("shared-prefix")))
    rids = [f"nostale-{i}" for i in range(2)]
    threads = [
        threading.Thread(
            target=engine.generate,
            daemon=True,
            kwargs=dict(prompt=prompt, rid=rid, sampling_params={"max_new_tokens": 3, "temperature": 0.0}),
        )
        for rid in rids
    ]
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(app.ready.is_set, 30)
        st = app.model.state
        await pilot.press("p")
        await wait_for(lambda: app.control_results == 1 and c.paused, 30)

        seen = []  # per step: (step, finished rids, lock counts drawn, tree evictable, KV evictable)

        async def step_and_look():
            results = app.control_results
            await pilot.press("s")
            await wait_for(lambda: app.control_results == results + 1, 60)
            step = app.last_step_result
            await wait_for(
                lambda: st.steps and st.steps[-1].step == step and st.kv is not None and st.kv.step == step, 30
            )
            await pilot.pause(0.3)  # the finished events come from the tokenizer, a hop later
            app.refresh_panels(force=True)
            await pilot.pause()
            tree_text = plain_text(app.query_one("#tree-body", Static).content, 200)
            kv_text = plain_text(app.query_one("#kv-body", Static).content, 120)
            title = str(app.panels["tree"].border_title)
            tree_ev = re.search(r"evictable (\S+)", title).group(1)
            kv_ev = re.search(r"cached\s+(\S+) \(", kv_text).group(1)
            kv_used = re.search(r"held\s+(\S+) \(", kv_text).group(1)
            assert kv_used == fmt_count(st.kv.used), (kv_text, st.kv)  # KV follows every step
            seen.append(
                (
                    step,
                    {r for r in rids if r in st.requests and st.requests[r].done},
                    _lock_counts(tree_text),
                    tree_ev,
                    kv_ev,
                    st.steps[-1].mode,
                )
            )

        # A starts; once it has decoded, B (same prompt, same length) enters: A finishes one step
        # before B, and B's finish inserts nothing (A cached the very same tokens): only locks move.
        a, b = threads
        a.start()
        await wait_for(lambda: rids[0] in st.requests and st.requests[rids[0]].state == "queued", 60)
        # a request that arrived while paused counts as waiting, and its row comes first
        await pilot.pause(0.2)
        app.refresh_panels(force=True)
        await pilot.pause()
        assert st.queue_counts()["waiting"] == 1
        table = app.query_one("#queues-table", DataTable)
        assert str(table.get_row_at(0)[1]) == rids[0] and str(table.get_row_at(0)[0]) == "waiting"
        for _ in range(10):
            if st.requests[rids[0]].output_tokens >= 2:
                break
            await step_and_look()
        b.start()
        await wait_for(lambda: rids[1] in st.requests and st.requests[rids[1]].state == "queued", 60)
        for _ in range(30):
            if all(st.requests[r].done for r in rids):
                break
            await step_and_look()
        assert all(st.requests[r].done for r in rids)

        # one evictable figure: the tree's title and the KV panel agree at every step
        for step, _, _, tree_ev, kv_ev, _ in seen:
            assert tree_ev == kv_ev, (step, tree_ev, kv_ev)
        # at most one tree snapshot per step
        assert trees_per_step and max(trees_per_step.values()) == 1, trees_per_step
        # between two consecutive steps in which a request finished, the lock counts drawn changed
        finish = [i for i in range(1, len(seen)) if len(seen[i][1]) > len(seen[i - 1][1])]
        pairs = [(i, j) for i, j in zip(finish, finish[1:]) if j == i + 1]
        assert pairs, seen
        for i, j in pairs:
            assert seen[i][2] != seen[j][2], (seen[i], seen[j])
        assert seen[-1][2] == []  # everyone finished: no lock left on screen
        await pilot.press("p")
        await pilot.press("q")
    for t in threads:
        t.join(30)


async def test_last_step_line_names_what_one_step_did(engine):
    """#15 item 1: after `p` and one `s`, the 'last step' line names what the step admitted, its token
    budget and the KV it allocated, and why the other request still waits; Queues highlights the
    admitted request."""
    import threading

    from rich.text import Text
    from workbench.tui.workload import chat_text

    app = _app(engine, layout="grid")
    c = app.controller
    rids = ["narrate-a", "narrate-b"]
    words = {"narrate-a": "alpha", "narrate-b": "omega"}
    threads = [
        threading.Thread(
            target=engine.generate,
            daemon=True,
            kwargs=dict(
                prompt=chat_text(
                    engine, [{"role": "user", "content": " ".join(f"{words[rid]} {i}" for i in range(50))}]
                ),
                rid=rid,
                sampling_params={"max_new_tokens": 3, "temperature": 0.0},
            ),
        )
        for rid in rids
    ]
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(app.ready.is_set, 30)
        st = app.model.state
        await pilot.press("p")
        await wait_for(lambda: app.control_results == 1 and c.paused, 30)
        for rid, t in zip(rids, threads):  # in this order: a is first in the queue
            t.start()
            await wait_for(lambda: rid in st.requests and st.requests[rid].state == "queued", 60)
        assert st.requests[rids[0]].prompt_tokens > 100
        results = app.control_results
        await pilot.press("s")
        await wait_for(lambda: app.control_results == results + 1, 60)
        step = app.last_step_result
        await wait_for(lambda: st.steps and st.steps[-1].step == step and st.steps[-1].decision is not None, 30)
        await pilot.pause(0.3)
        app.refresh_panels(force=True)
        await pilot.pause()
        sv = st.steps[-1]
        d = sv.decision
        line = " ".join(plain_text(app.query_one("#laststep", Static).content, 200).split())
        assert line.startswith(f"last step step {step} extend: admitted 1 from waiting ({rids[0]})"), line
        n = -(-(st.requests[rids[0]].prompt_tokens - sv.reqs[0].cached) // 64)
        assert n > 1 and f"{rids[0]} chunk 1/{n}" in line, line  # a's prompt is cut at the budget
        assert "budget 64/64" in line, line
        # + counts new slots and cached prefixes locked by the admission (#40 item 1)
        assert f"KV +{d.kv_alloc + max(d.kv_reused, 0)}" in line and d.kv_alloc == sv.prefill_tokens == 64, (line, d)
        assert f"1 waiting: token budget ({rids[1]} next)" in line, line
        table = app.query_one("#queues-table", DataTable)
        cells = {str(table.get_row_at(i)[1]): table.get_row_at(i)[1] for i in range(table.row_count)}
        assert isinstance(cells[rids[0]], Text) and "reverse" in str(cells[rids[0]].style)
        assert "reverse" not in str(cells[rids[1]].style)
        states = {str(table.get_row_at(i)[1]): str(table.get_row_at(i)[2]) for i in range(table.row_count)}
        assert states[rids[1]] == "queued: budget", states  # why b still waits
        await pilot.press("p")
        await wait_for(lambda: all(st.requests[r].done for r in rids), 120)
        await pilot.press("q")
    for t in threads:
        t.join(30)
