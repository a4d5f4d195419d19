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
