"""The overlap event loop (`disable_overlap_schedule=False`) against the normal loop, real model, float32.

Same greedy tokens for mixed concurrent requests, for chunked prefill of long prompts and under
KV pressure (retraction); no KV leak afterwards; abort (also of a half-prefilled prompt); the step
gate; and the trace's batch.step events.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import time

import pytest
from conftest import chat_ids
from pipeline_helpers import assert_no_kv_leak, drain_events
from reliability_helpers import wait_for
from workbench.core.engine import Engine
from workbench.core.trace import events as ev

TOPICS = [
    "the ocean",
    "volcanoes",
    "a robot",
    "tea",
    "chess",
    "winter",
    "bees",
    "the moon",
    "a library",
    "trains",
    "jazz",
    "mountains",
    "bread",
    "a lighthouse",
    "maps",
    "clocks",
]
LONG = (
    "The river carried the boats past the old mill, where the miller counted sacks of grain "
    "and sang to the turning wheel. "
) * 12
PRESSURE_NEW = 40
BEE = 11426  # " bee" in SmolLM2's vocabulary
# One intra-op thread in every engine: both loops then run the same kernels (same numerics), and
# a 2-thread OpenMP team on a busy 2-core machine can be many times slower than one thread.
ENGINE = {"dtype": "float32", "show_progress": False, "num_threads": 1}


def _assert_no_leak(engine, timeout: float = 30.0) -> None:
    """Idle means every KV slot is free or held (evictable) by the radix cache, before and after a flush.

    (`assert_no_kv_leak` alone looks only after the flush, which clears the pools.)
    """
    deadline = time.monotonic() + timeout
    while True:
        s = engine.get_internal_state()
        if s["num_waiting"] == 0 and s["num_running"] == 0 and s["kv_used"] == 0:
            break
        assert time.monotonic() < deadline, f"KV slots leaked or engine not idle: {s}"
        time.sleep(0.05)
    assert s["kv_free"] + s["kv_evictable"] == s["kv_total"] and s["req_slots_free"] == s["req_slots_total"], s
    assert_no_kv_leak(engine)


def _mixed_calls(prompts: list[list[int]]) -> list[dict]:
    """16 different generate calls: lengths, EOS, stops, logprobs, seeded sampling, penalties.

    prompts[16] makes the model say " bee" from its 3rd token on. Two calls on it sample from their
    output history (the overlap loop runs their batches synchronously); a history one token short
    would change their tokens: frequency_penalty counts every " bee", and with min_new_tokens=2 the
    " bee" stop token is allowed exactly when the model first wants it (one step later if the
    sampler saw one output token too few).
    """
    calls = []
    for i, p in enumerate(prompts[:16]):
        sp = {"max_new_tokens": (1, 2, 3, 5, 8, 13, 21, 30)[i % 8], "temperature": 0.0}
        call = {"input_ids": p, "sampling_params": sp}
        if i % 3 == 0:
            sp["ignore_eos"] = True
        if i == 4:
            call.update(return_logprob=True, top_logprobs_num=2)
        if i == 5:  # seeded: the same draws whatever else shares the batch
            sp.update(temperature=0.8, top_k=20, seed=11, max_new_tokens=12)
        if i == 6:
            call["input_ids"] = prompts[16]
            sp.update(frequency_penalty=0.6, max_new_tokens=12)
        if i == 7:
            call["input_ids"] = prompts[16]
            sp.update(stop_token_ids=[BEE], min_new_tokens=2, max_new_tokens=12)
        if i == 9:
            sp["stop"] = ["."]
        calls.append(call)
    return calls


def _decoded_per_rid(events) -> dict[str, int]:
    decoded: dict[str, int] = {}
    for s in events:
        if isinstance(s, ev.BatchStep):
            for r in s.reqs:
                decoded[r.rid] = decoded.get(r.rid, 0) + r.decode
    return decoded


def _all_decodes_traced(events, outs: list[dict]) -> bool:
    """Every request's decode tokens have a batch.step (or the trace says it dropped some)."""
    if any(isinstance(x, ev.TraceDropped) for x in events):
        return True
    decoded = _decoded_per_rid(events)
    return all(decoded.get(o["meta_info"]["id"], 0) >= o["meta_info"]["completion_tokens"] - 1 for o in outs)


def _run_concurrently(engine, calls: list[dict]) -> list[dict]:
    with cf.ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda c: engine.generate(**c), calls))


def _summary(out: dict) -> tuple:
    return out["output_ids"], out["meta_info"]["finish_reason"]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [chat_ids(tokenizer, f"Write two sentences about {t}.") for t in TOPICS] + [
        chat_ids(tokenizer, "Write the word 'bee' twenty times: bee bee bee bee")
    ]


@pytest.fixture(scope="module")
def long_prompts(tokenizer):
    return [chat_ids(tokenizer, f"{LONG} Question {i}: what did the miller do?") for i in range(3)]


@pytest.fixture(scope="module")
def pressure_prompts(tokenizer):
    return [chat_ids(tokenizer, f"Say something about the number {i}.") for i in range(16)]


@pytest.fixture(scope="module")
def normal_results(default_prepared, prompts, long_prompts, pressure_prompts):
    """Every workload of this file through the normal loop (plenty of KV, default chunking)."""
    sp = {"max_new_tokens": PRESSURE_NEW, "temperature": 0.0, "ignore_eos": True}
    with Engine(max_total_tokens=8192, disable_overlap_schedule=True, **ENGINE) as e:
        mixed = _run_concurrently(e, _mixed_calls(prompts))
        long = e.generate(
            input_ids=long_prompts, sampling_params={"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        )
        pressure = _run_concurrently(e, [{"input_ids": p, "sampling_params": sp} for p in pressure_prompts])
        _assert_no_leak(e)
    return {"mixed": mixed, "long": long, "pressure": pressure}


@pytest.fixture(scope="module")
def overlap_engine(default_prepared):
    # With two or more cores, one compute thread leaves a core free and the default picks the
    # overlap loop by itself (cpu_threads.overlap_by_default); on one core it is asked for.
    spare = len(os.sched_getaffinity(0)) >= 2
    ask = {} if spare else {"disable_overlap_schedule": False}
    with Engine(max_total_tokens=8192, **ask, **ENGINE) as e:
        assert "overlap loop" in e.scheduler_info["threads"], e.scheduler_info["threads"]
        yield e


def test_mixed_requests_match_normal_loop(overlap_engine, prompts, normal_results):
    e = overlap_engine
    sub = e.subscribe(with_snapshot=False)
    try:
        outs = _run_concurrently(e, _mixed_calls(prompts))
        # The last steps' batch.step events may still be on their way to the bus.
        events = drain_events(sub, until=lambda got: _all_decodes_traced(got, outs))
    finally:
        sub.close()
    ref = normal_results["mixed"]
    assert [_summary(o) for o in outs] == [_summary(o) for o in ref]
    lp, lp_ref = outs[4]["meta_info"]["output_token_logprobs"], ref[4]["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lp] == [t for _, t, _ in lp_ref]
    assert all(abs(a[0] - b[0]) < 1e-4 for a, b in zip(lp, lp_ref))
    assert outs[3]["meta_info"]["completion_tokens"] == 5 and outs[8]["meta_info"]["completion_tokens"] == 1
    assert ref[7]["output_ids"][-1] == BEE and ref[7]["meta_info"]["completion_tokens"] == 3
    # Alone (no penalized neighbour forcing synchronous steps) min_new_tokens must still see it all.
    assert _summary(e.generate(**_mixed_calls(prompts)[7])) == _summary(ref[7])
    _assert_no_leak(e)

    steps = [x for x in events if isinstance(x, ev.BatchStep)]
    assert any(s.mode == "extend" for s in steps) and any(s.mode == "decode" and s.batch_size > 1 for s in steps)
    assert all(s.forward_ms > 0 for s in steps)
    # Overlap really happened: some decode launches carried rows of requests that had finished in
    # the batch before (counted in batch_size, not reported as work).
    assert any(s.mode == "decode" and s.batch_size > len(s.reqs) for s in steps)
    if not any(isinstance(x, ev.TraceDropped) for x in events):
        # Each request decodes every token after its first exactly once: rows computed for a
        # request that had already finished (launched before its end was known) are not reported.
        rid_of = {o["meta_info"]["id"]: o for o in outs}
        decoded = _decoded_per_rid(steps)
        decoded = {rid: decoded.get(rid, 0) for rid in rid_of}
        assert decoded == {rid: o["meta_info"]["completion_tokens"] - 1 for rid, o in rid_of.items()}


def test_abort_mid_generation(overlap_engine, prompts):
    e = overlap_engine
    stream = e.generate(
        input_ids=prompts[1], sampling_params={"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}, stream=True
    )
    got = []
    for chunk in stream:
        got.append(chunk)
        if len(chunk["output_ids"]) >= 3:
            e.abort_request(chunk["meta_info"]["id"])
    assert got[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(got[-1]["output_ids"]) < 400
    _assert_no_leak(e)


def test_step_gate_runs_one_iteration_per_step(overlap_engine, prompts):
    e = overlap_engine
    e.step_gate("pause")
    try:
        fut = cf.ThreadPoolExecutor(1).submit(
            e.generate, input_ids=prompts[2], sampling_params={"max_new_tokens": 5, "temperature": 0}
        )
        # Step only once the request is queued: a step with nothing to run is answered at once.
        wait_for(lambda: e.get_internal_state()["num_waiting"] == 1, 30, "the request to reach the scheduler")
        first = e.step_gate("step")
        second = e.step_gate("step")
        assert second["step"] == first["step"] + 1 and second["paused"]
        state = e.get_internal_state()
        assert state["num_running"] == 1 and state["step"] == second["step"]
    finally:
        e.step_gate("resume")
    assert fut.result(timeout=120)["meta_info"]["completion_tokens"] == 5
    _assert_no_leak(e)


@pytest.fixture(scope="module")
def pressure_engine(default_prepared):
    # ~16 * (35 + 40) tokens wanted at peak; the pool holds far fewer. Prompts are cut in 64s.
    with Engine(max_total_tokens=640, chunked_prefill_size=64, disable_overlap_schedule=False, **ENGINE) as e:
        yield e


def test_chunked_prefill_matches_normal_loop(pressure_engine, long_prompts, normal_results):
    e = pressure_engine
    assert all(len(p) > 200 for p in long_prompts)
    sub = e.subscribe(with_snapshot=False)
    try:
        outs = e.generate(
            input_ids=long_prompts, sampling_params={"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        )
        events = drain_events(sub)
    finally:
        sub.close()
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in normal_results["long"]]
    chunks = [x for x in events if isinstance(x, ev.ReqScheduled)]
    assert max(c.extend_len for c in chunks) <= 64
    assert max(c.chunk_index for c in chunks) >= 3  # the prompts really were cut
    _assert_no_leak(e)


def test_kv_pressure_retracts_and_matches_normal_loop(pressure_engine, pressure_prompts, normal_results):
    e = pressure_engine
    sp = {"max_new_tokens": PRESSURE_NEW, "temperature": 0.0, "ignore_eos": True}
    sub = e.subscribe(with_snapshot=False)
    try:
        outs = _run_concurrently(e, [{"input_ids": p, "sampling_params": sp} for p in pressure_prompts])
        events = drain_events(sub)
    finally:
        sub.close()
    assert any(isinstance(x, ev.ReqRetracted) for x in events), "expected retraction under KV pressure"
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in normal_results["pressure"]]
    _assert_no_leak(e)


def test_abort_half_prefilled_prompt(pressure_engine, long_prompts):
    """Stopped between chunks with the step gate, then aborted: its chunks' KV must come back."""
    e = pressure_engine
    e.step_gate("pause")
    try:
        fut = cf.ThreadPoolExecutor(1).submit(
            e.generate,
            input_ids=long_prompts[0],
            rid="half-prefilled",
            sampling_params={"max_new_tokens": 4, "temperature": 0},
        )
        deadline = time.monotonic() + 30
        while e.get_internal_state()["num_waiting"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        e.step_gate("step", steps=2)  # two 64-token chunks of a ~300-token prompt
        e.abort_request("half-prefilled")
    finally:
        e.step_gate("resume")
    out = fut.result(timeout=120)
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["output_ids"] == []
    _assert_no_leak(e)
