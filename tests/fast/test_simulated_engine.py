"""A deployment that is not there, served live (core/simulation/live.py): the real tokenizer manager,
scheduler process and detokenizer over a simulated worker, every stamp on the shared simulated clock
(trace/clock.py). Checked: each pass moves simulated time by exactly the cost model's prediction and,
at --sim-speed 1, takes that long on the wall clock; a workload replayed through the whole pipeline at
--sim-speed 0 (as fast as this host can) and 10 gives every request the TTFT and latency the offline
`Simulator` gives it, in less wall time than simulated time; the TUI's workload runner keeps its rate in
simulated time; data-parallel replicas behind the real controller run side by side in simulated time
and agree with the offline Simulator request by request, as does speculative decoding (NGRAM and a
costed STANDALONE draft model); the SIMULATED badge in the trace's header, the recorder, the live TUI's
status line and every /metrics series; bad combinations refused with what to do instead.

The end-to-end tests of this module are in tests/e2e/test_simulated_engine_e2e.py.
"""

from __future__ import annotations

import pytest
from workbench.core.args import ServerArgs
from workbench.core.simulation import live

pytestmark = pytest.mark.timeout(300)

SIM = dict(simulate="h100", model_path="llama-3.1-70b", tp_size=8, show_progress=False)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(simulate="tpu9"), "--simulate must be one of"),
        (dict(tp_size=1), "does not fit"),
        (dict(nnodes=2, dist_init_addr="127.0.0.1:5000"), "workbench sim run"),
        (dict(speculative_algorithm="NGRAM"), "--speculative-accept-rate"),
        (dict(model_path="no-such-model"), "neither a known model"),
    ],
)
def test_bad_combinations_say_what_to_do(changes, message):
    with pytest.raises(ValueError, match=message):
        live.sized_args(ServerArgs(**{**SIM, **changes}))


def test_sizes_follow_the_hardware_unless_given():
    sa = live.sized_args(ServerArgs(**SIM))
    assert sa.chunked_prefill_size == 8192 and sa.max_running_requests == 256 and sa.disable_overlap_schedule
    mine = live.sized_args(ServerArgs(**SIM, chunked_prefill_size=1024, max_total_tokens=5000, max_running_requests=64))
    assert (mine.chunked_prefill_size, mine.max_total_tokens, mine.max_running_requests) == (1024, 5000, 64)


def test_the_serving_path_has_no_simulation_branch():
    """A simulated deployment is a Deployment handed to the engine (core/deployment.py resolves it once):
    the engine, the tokenizer manager, the HTTP server, the data-parallel controller, io_struct and the
    scheduler neither read --simulate nor import core.simulation."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "core"
    serving = ["engine.py", "entrypoints/http_server.py", "io_struct.py", "managers/tokenizer_manager.py"]
    serving += ["managers/data_parallel_controller.py", "managers/scheduler.py", "managers/scheduler_contract.py"]
    found = []
    for name in serving:
        for node in ast.walk(ast.parse((root / name).read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("simulate", "sim_speed"):
                found.append(f"{name}:{node.lineno}: reads .{node.attr}")
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            modules += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            found += [
                f"{name}:{node.lineno}: imports {m}" for m in modules if m.startswith("workbench.core.simulation")
            ]
    assert not found, "\n".join(found)
    # ... and the edge that picks the deployment does read it
    assert "simulate" in (root / "deployment.py").read_text()


def test_the_simulated_deployment_is_a_factory_and_a_badge():
    from workbench.core.deployment import resolve_deployment
    from workbench.core.managers.scheduler_contract import Deployment

    sa, d = resolve_deployment(ServerArgs(**SIM))
    assert d.scheduler_factory is live.scheduler_parts and not d.loads_weights and d.shared_clock
    assert (
        d.one_process_per_replica and d.badge == "SIMULATED h100x8" and dict(d.metric_labels) == {"simulated": "h100x8"}
    )
    assert sa.max_total_tokens == live._cost_model(sa).kv_pool_tokens()  # sized as the real runner would be
    real_args = ServerArgs(show_progress=False)
    assert resolve_deployment(real_args) == (real_args, Deployment())
