"""A mixture of experts in the trace: each step's `moe.routing` event against the step it belongs to,
the reducer's expert load against the events, and the tokens' routing against the model's router.

The end-to-end tests of this module are in tests/e2e/test_moe_trace_e2e.py.
"""

from __future__ import annotations

from workbench.core.trace import events as ev
from workbench.core.trace.experts import ExpertLoad, imbalance


def test_imbalance_and_a_new_model_resets_the_load():
    assert imbalance([2, 2, 2, 2]) == 1.0 and imbalance([8, 0, 0, 0]) == 4.0 and imbalance([0, 0]) == 0.0
    load = ExpertLoad(max_requests=1)
    load.apply(
        ev.MoeRouting(num_experts=2, top_k=1, layers=[0], counts=[[3, 1]], reqs=[ev.ExpertRoute("a", [[0, 3, 1, 1]])])
    )
    load.apply(ev.MoeRouting(num_experts=2, top_k=1, layers=[0], counts=[[0, 2]], reqs=[ev.ExpertRoute("b", [[1, 2]])]))
    assert load.total == [[3, 3]] and load.last == [[0, 2]] and load.request("a") is None  # capped at 1
    assert load.request("b") == [[0, 2]]
    load.apply(ev.MoeRouting(num_experts=4, top_k=2, layers=[1, 3], counts=[[1, 1, 0, 0], [0, 0, 1, 1]]))
    assert load.layers == [1, 3] and load.total == [[1, 1, 0, 0], [0, 0, 1, 1]] and load.steps == 1
