"""Demo scenarios (issue #15 item 5), fast tier: the adaptive arrival rule as a pure function (and
on a toy server whose speed spans a slow laptop to a fast workstation), rate formatting, the
scenario table and how its engine settings meet the user's flags, and a runner's pause.

The real engine runs the scenarios in tests/test_scenarios_e2e.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from workbench.scenarios import SCENARIOS, Sightings, get_scenario, runner_status
from workbench.workloads import MAX_RATE, MIN_RATE, WorkloadRunner, adapt_rate, fmt_rate

# ---- the rule ------------------------------------------------------------------------


def test_at_the_target_the_rate_is_what_the_machine_completes():
    assert adapt_rate(2.2, done_per_s=2.0, in_flight=12, target_in_flight=12) == pytest.approx(2.0)
    assert adapt_rate(0.3, done_per_s=0.25, in_flight=5, target_in_flight=5) == pytest.approx(0.25)


def test_a_pile_up_slows_arrivals_below_throughput_and_room_speeds_them_up():
    # The seen failure: 111 requests in flight on a busy machine. Arrivals must drop below what
    # completes, so the pile drains.
    assert adapt_rate(2.0, done_per_s=2.0, in_flight=111, target_in_flight=12) < 2.0 * 0.6
    assert adapt_rate(2.0, done_per_s=2.0, in_flight=3, target_in_flight=12) > 2.0 * 1.5
    # further from the target, a stronger pull (until the cap)
    assert adapt_rate(2.0, 2.0, 20, 12) > adapt_rate(2.0, 2.0, 40, 12)


def test_before_any_completion_the_rate_ramps_from_where_it_is():
    assert adapt_rate(1.0, done_per_s=0.0, in_flight=0, target_in_flight=12) == pytest.approx(2.0)
    assert adapt_rate(1.0, done_per_s=0.0, in_flight=6, target_in_flight=12) == pytest.approx(2**0.5)
    # nothing completed yet (a slow machine's first long requests): at most the gap to the target per
    # second, so the ramp-up never overshoots it blind; at the target, wait for the machine's speed
    assert adapt_rate(6.0, done_per_s=0.0, in_flight=10, target_in_flight=12) == pytest.approx(2.0)
    assert adapt_rate(8.0, done_per_s=0.0, in_flight=12, target_in_flight=12) == MIN_RATE


def test_one_update_moves_the_rate_at_most_max_change_and_stays_in_bounds():
    assert adapt_rate(1.0, done_per_s=40.0, in_flight=0, target_in_flight=12) == pytest.approx(2.0)
    assert adapt_rate(4.0, done_per_s=0.1, in_flight=12, target_in_flight=12) == pytest.approx(2.0)
    assert adapt_rate(MIN_RATE, 0.0, 500, 4) == MIN_RATE
    assert adapt_rate(MAX_RATE, 1000.0, 0, 4) == MAX_RATE


@pytest.mark.parametrize("capacity", [0.3, 3.0, 30.0])  # requests/s: a busy laptop .. a GPU box
def test_on_a_toy_server_of_any_speed_the_load_settles_at_the_target(capacity):
    """A server that completes `capacity` requests per second while it has work, driven once a second
    by the rule with its measured completions: the in-flight count converges to the target and the
    rate to the capacity, from a start far too slow, from a scenario's usual start (2/s, nothing in
    flight) and from one too fast with twice the target already in flight (a pile can only drain
    as fast as the server completes, hence the long run)."""
    target = 12.0
    for start_rate, start_in_flight in ((0.05, 0.0), (2.0, 0.0), (4 * capacity, 2 * target)):
        rate, n, seen = start_rate, start_in_flight, []
        for _ in range(400):
            n += rate  # arrivals in the last second
            done = min(n, capacity)  # completions in the last second
            n -= done
            rate = adapt_rate(rate, done, round(n), target)
            seen.append(n)
        settled = seen[-30:]
        assert max(settled) < 2 * target, (capacity, start_rate, settled)
        assert abs(sum(settled) / len(settled) - target) < 0.35 * target, (capacity, start_rate, settled)
        assert rate == pytest.approx(capacity, rel=0.35), (capacity, start_rate, rate)


def test_rates_read_like_rates():
    assert fmt_rate(1 / 1.5) == "0.67"  # `+ - -` once showed '0.666667/s'
    assert fmt_rate(2.25 * 1.5) == "3.4"
    assert fmt_rate(12.7) == "13"
    assert fmt_rate(0.05) == "0.05"


# ---- the scenarios --------------------------------------------------------------------


def test_the_promised_scenarios_exist_and_unknown_names_say_the_choices():
    assert {"shared-prefix", "kv-pressure", "chunked-prefill", "burst"} <= set(SCENARIOS)
    with pytest.raises(ValueError, match="kv-pressure"):
        get_scenario("no-such")


def test_kv_pressure_asks_for_more_kv_than_its_pool_holds():
    from workbench.core.managers.scheduler import INIT_NEW_TOKEN_RATIO

    s = get_scenario("kv-pressure")
    pool, prompt = s.engine["max_total_tokens"], 40  # its chat prompts: 35-40 tokens
    # The requests kept in flight need more than the pool: some wait for KV room.
    assert s.target_in_flight * (prompt + s.max_new_tokens) > 2 * pool
    # Admission reserves only INIT_NEW_TOKEN_RATIO of a request's future tokens, and every request
    # decodes all of max_new_tokens (ignore_eos): those admitted outgrow the pool, so some are retracted.
    admitted = pool // (prompt + INIT_NEW_TOKEN_RATIO * s.max_new_tokens)
    assert s.ignore_eos and admitted * (prompt + s.max_new_tokens) > pool
    assert admitted < s.engine["max_running_requests"]  # KV, not the running limit, decides
    # ... while each one alone fits (the engine refuses a request that never could).
    assert prompt + s.max_new_tokens < pool // 2


def test_burst_queues_at_the_running_limit_and_sends_the_next_burst_only_once_drained():
    s = get_scenario("burst")
    assert s.burst_size > s.engine["max_running_requests"]
    assert s.max_in_flight - s.burst_size < s.engine["max_running_requests"]


def test_engine_settings_apply_where_the_user_kept_the_default():
    from workbench.core.args import ServerArgs

    s = get_scenario("kv-pressure")
    sa = s.server_args(ServerArgs())
    assert sa.max_total_tokens == s.engine["max_total_tokens"]
    assert sa.max_running_requests == s.engine["max_running_requests"]
    mine = s.server_args(ServerArgs(max_total_tokens=2048, chunked_prefill_size=32))
    assert mine.max_total_tokens == 2048 and mine.chunked_prefill_size == 32
    assert mine.max_running_requests == s.engine["max_running_requests"]
    assert s.engine_kwargs() == s.engine and s.engine_kwargs() is not s.engine


def test_chunked_prefill_sends_a_long_prompt_every_fifth_request():
    s = get_scenario("chunked-prefill")
    items = [next(p) for p in [s.prompts()] for _ in range(10)]
    longs = [i for i, item in enumerate(items, 1) if item["rid_prefix"] == "long"]
    assert longs == [5, 10]
    long_text = items[4]["messages"][-1]["content"]
    short_text = items[0]["messages"][-1]["content"]
    assert len(long_text) > 10 * len(short_text)
    assert "kv-pressure" in get_scenario("kv-pressure").describe() and "Watch:" in s.describe()


def test_the_cli_offers_the_scenarios_to_tui_and_record():
    from workbench.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["tui", "--scenario", "kv-pressure"])
    assert args.scenario == "kv-pressure" and args.rate is None
    args = parser.parse_args(["record", "--scenario", "burst", "-o", "x.jsonl", "--duration", "5"])
    assert args.scenario == "burst" and args.duration == 5
    with pytest.raises(SystemExit):
        parser.parse_args(["tui", "--scenario", "kv-pressure", "--workload", "chat"])


def test_sightings_count_the_hard_cases():
    from workbench.core.trace import events as ev

    s = Sightings()
    s([ev.QueueState(waiting=["a", "b"], running=[], chunked=[])])
    assert not s.hard_cases_seen()
    s(
        [
            ev.CacheEvict(node_ids=[3], tokens=40),
            ev.ReqRetracted(rid="a", output_tokens=5),
            ev.StepDecision(mode="decode"),
        ]
    )
    assert s.hard_cases_seen() and s.max_waiting == 2 and s.evicted_tokens == 40 and s.decisions == 1
    fin = dict(prompt_tokens=4, completion_tokens=2, cached_tokens=0, ttft=0.1, tpot=0.01, e2e=0.2)
    s([ev.ReqFinished(rid="a", reason="abort", **fin), ev.ReqFinished(rid="b", reason="stop", **fin)])
    assert s.finished == 1  # an aborted request is not a finished one


# ---- the runner ---------------------------------------------------------------------------


class _StubServer:
    """Answers each request after `delay` seconds (a stand-in for an engine's async_generate)."""

    def __init__(self, delay: float = 0.05):
        self.delay = delay
        self.tokenizer = None
        self.aborted: list[str] = []

    async def async_generate(self, rid=None, **kwargs):
        end = time.monotonic() + self.delay
        while time.monotonic() < end:
            if rid in self.aborted:
                raise RuntimeError("aborted")
            await asyncio.sleep(0.01)
        return {"text": "ok"}

    def abort_request(self, rid):
        self.aborted.append(rid)


def _wait(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_a_paused_runner_sends_nothing_until_resumed_and_counts_no_paused_time():
    runner = WorkloadRunner(
        _StubServer(),
        "chat",
        rate=20,
        prompts=iter(["hi"] * 1000),
        paused=True,
        adaptive=True,
        target_in_flight=2,
        label="t",
    )
    runner.start()
    try:
        time.sleep(0.5)
        assert runner.sent == 0 and "paused" in runner_status(runner)
        runner.resume()
        assert _wait(lambda: runner.completed >= 3)
        runner.pause()
        time.sleep(0.2)  # let a send already decided go out
        sent = runner.sent
        time.sleep(0.5)
        assert runner.sent == sent
    finally:
        runner.stop()


def test_a_burst_goes_whole_or_waits_and_stop_reports_what_it_aborted():
    server = _StubServer(delay=30.0)  # nothing completes while the test looks
    runner = WorkloadRunner(server, "burst", rate=50, burst_size=4, max_in_flight=6, prompts=iter(["hi"] * 100))
    runner.start()
    try:
        assert _wait(lambda: runner.sent >= 4)
        time.sleep(0.3)
        assert runner.sent == 4 and runner.in_flight == 4  # a second burst of 4 would pass 6
    finally:
        assert runner.stop() == 4
    assert sorted(server.aborted) == sorted(f"burst-{i}" for i in range(1, 5))


def test_auto_rate_says_measuring_only_until_the_first_completion():
    # #40 item 4: under KV pressure a 10 s window can pass with no completion; the status then said
    # `auto: measuring` for minutes, as if the measurement never ended.
    runner = WorkloadRunner(_StubServer(), "chat", rate=1.0, adaptive=True, target_in_flight=4)
    assert "auto: measuring" in runner_status(runner)
    runner.completed = 3  # three done, none in the last window
    assert "measuring" not in runner_status(runner) and "none done in 10 s" in runner_status(runner)
    runner.measured_per_s = 2.0
    assert "auto: 2.0 done/s" in runner_status(runner)
