"""Issue #40 item 11: on a simulated 70B on 8 H100s (a 1.2M-token pool) the radix tree said
`lock 1 · protected 36 t` while the KV pool said 0% used and drew no held cell. The counts agree
(the pool's held slots include every locked node's, checked here at every step of a simulated run);
what was wrong was the view rounding 36 of 1.2M slots to `0%` and to no cell of the gauge."""

from __future__ import annotations

from workbench.core.simulation.simulator import Simulator, poisson_workload
from workbench.core.trace import events as ev
from workbench.core.trace.state import TraceState
from workbench.tui.model import TuiModel
from workbench.tui.panels.kv import render_kv
from workbench.tui.status import status_segments

TOTAL = 1_229_538  # llama-3.1-70b on 8 simulated H100s


def _state_with_one_locked_request() -> TraceState:
    st = TraceState()
    st.apply_many(
        [
            ev.CacheTree(
                ts=1,
                proc="scheduler",
                nodes=[ev.TreeNode(0, -1, 0, "", 1, 0, 0), ev.TreeNode(1, 0, 36, "hello", 1, 0, 0)],
                evictable_size=0,
                protected_size=36,
            ),
            ev.KVUsage(ts=1, proc="scheduler", used=40, evictable=0, free=TOTAL - 40, total=TOTAL),
        ]
    )
    return st


def test_a_few_held_slots_of_a_big_pool_never_read_as_none():
    st = _state_with_one_locked_request()
    assert st.tree_protected_size == 36 and st.kv.used == 40  # the tree's lock is part of the pool's held
    text = render_kv(TuiModel(st), width=40).plain
    held_line = next(line for line in text.splitlines() if "held" in line)
    assert "(<1%)" in held_line and "(0%)" not in held_line, held_line
    gauge = text.splitlines()[0]
    assert gauge.count("█") == 1 and len(gauge) == 40, gauge  # one cell at least, and still 40 wide
    _, figures = status_segments(st, now_ns=2, paused=False)
    assert any("KV <1% held" in text for _, text, _ in figures), figures


def test_held_slots_cover_the_locked_tree_at_every_step_of_a_simulated_70b():
    """The simulator's pool accounting and the reducer agree: after every step, kv.usage's held
    slots are at least the tree's locked tokens (protected_size and the nodes with lock > 0)."""
    events: list = []
    sim = Simulator("llama-3.1-70b", "h100", tp_size=8, trace_sink=events.extend)
    sim.run(poisson_workload(rate=26, n=60, prompt_len=(30, 90), output_len=(8, 40), seed=1, groups=4, prefix_len=32))
    st = TraceState()
    checked = 0

    def check() -> None:
        tree = st.trees.get(st.tree_proc) or {}
        locked = sum(n.tokens for n in tree.values() if n.lock_ref > 0 and n.parent_id != -1)
        assert st.kv is not None and st.kv.used >= st.tree_protected_size == locked, (st.kv, locked)

    prev = None
    for e in events:
        if prev is not None and e.step != prev and e.step >= 0 and e.proc.startswith("scheduler"):
            check()  # the previous step is complete: its kv.usage and its cache.tree are both in
            checked += 1
        st.apply(e)
        if e.proc.startswith("scheduler") and e.step >= 0:
            prev = e.step
    check()
    assert checked > 50 and st.kv.used == 0 and st.tree_protected_size == 0  # all done: nothing held
