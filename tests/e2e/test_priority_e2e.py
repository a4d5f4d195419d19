"""Priority scheduling through the real pipeline: one Engine (default model, float32) with
--enable-priority-scheduling, one running slot and a preemption threshold of 10, served over HTTP.

- A late request of priority 10 overtakes queued priority-0 ones (a difference of 10 is not more
  than the threshold: it waits for the running one, then goes first).
- A request of priority 100 preempts the running priority-0 one, which is prefilled again later and
  still finishes with its full output.
- Every greedy output equals the same prompt run alone without a priority; the KV invariant check
  finds nothing wrong.
- `priority` is taken on /generate and, as an extra body field, by the official openai client.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from pipeline_helpers import served_engine

pytestmark = pytest.mark.usefixtures("default_prepared")


def greedy(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


def prompt(k: int) -> list[int]:
    return [1] + [400 + 37 * k + (i * (k + 3)) % 300 for i in range(20)]


LONG, SHORT = 64, 6


@pytest.fixture(scope="module")
def served():
    with served_engine(
        dtype="float32",
        max_running_requests=1,
        enable_priority_scheduling=True,
        priority_scheduling_preemption_threshold=10,
        enable_kv_invariant_check=True,
    ) as pair:
        yield pair


@pytest.fixture(scope="module")
def reference(served):
    """Each prompt alone, no priority: the outputs every scenario must reproduce."""
    engine = served[0]
    return {
        k: engine.generate(input_ids=prompt(k), sampling_params=greedy(LONG if k in (0, 4) else SHORT))["output_ids"]
        for k in range(6)
    }


async def _scenario(engine, plan) -> tuple[list[str], dict]:
    """Run `plan` [(name, k, max_new_tokens, priority, wait-before-sending)]; returns the order the
    requests finished in and their outputs."""
    done: list[str] = []
    outs: dict = {}

    async def one(name, k, n, prio):
        outs[name] = await engine.async_generate(input_ids=prompt(k), sampling_params=greedy(n), priority=prio)
        done.append(name)

    tasks = []
    for name, k, n, prio, wait in plan:
        if wait is not None:
            await _until(engine, wait)
        tasks.append(asyncio.ensure_future(one(name, k, n, prio)))
        await asyncio.sleep(0.02)
    await asyncio.gather(*tasks)
    return done, outs


async def _until(engine, cond, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        state = await asyncio.to_thread(engine.get_internal_state)
        if cond(state):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the engine never reached the state waited for: {state}")


def test_late_priority_request_overtakes_queued_ones(served, reference):
    engine = served[0]
    plan = [
        ("a", 0, LONG, 0, None),
        ("b", 1, SHORT, 0, lambda s: s["num_running"] == 1),
        ("c", 2, SHORT, 0, None),
        ("urgent", 3, SHORT, 10, lambda s: s["num_waiting"] == 2),
    ]
    before = engine.get_internal_state()["retracted_total"]
    done, outs = asyncio.run(_scenario(engine, plan))
    assert done == ["a", "urgent", "b", "c"]
    assert engine.get_internal_state()["retracted_total"] == before  # no preemption: 10 is not > 10
    for name, k, *_ in plan:
        assert outs[name]["output_ids"] == reference[k], name


def test_urgent_request_preempts_the_running_one_which_finishes_in_full(served, reference):
    engine = served[0]
    before = engine.get_internal_state()["retracted_total"]
    plan = [
        ("low", 4, LONG, 0, None),
        ("urgent", 5, SHORT, 100, lambda s: s["num_running"] == 1),
    ]
    done, outs = asyncio.run(_scenario(engine, plan))
    state = engine.get_internal_state()
    assert done == ["urgent", "low"]
    assert state["retracted_total"] == before + 1
    assert outs["low"]["output_ids"] == reference[4]  # its full output, as if never interrupted
    assert outs["urgent"]["output_ids"] == reference[5]
    assert not state.get("kv_check_error"), state.get("kv_check_error")


def test_priority_on_generate_and_on_chat_through_the_openai_client(served, reference):
    openai = pytest.importorskip("openai")
    engine, url = served
    r = httpx.post(url + "/generate", json={"input_ids": prompt(1), "sampling_params": greedy(SHORT), "priority": 5})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == reference[1]
    bad = httpx.post(url + "/generate", json={"input_ids": prompt(1), "sampling_params": greedy(2), "priority": "x"})
    assert bad.status_code == 422, bad.text  # a field of the wrong type, as every route answers it
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Hi"}]
    ref = engine.generate(input_ids=engine.apply_chat_template(msgs), sampling_params=greedy(SHORT))
    chat = client.chat.completions.create(
        model="smollm2-135m",
        messages=msgs,
        max_tokens=SHORT,
        temperature=0,
        extra_body={"priority": 7, "ignore_eos": True},
    )
    assert chat.choices[0].message.content == ref["text"]
    comp = client.completions.create(
        model="smollm2-135m", prompt="The sky is", max_tokens=3, temperature=0, extra_body={"priority": 3}
    )
    assert comp.choices[0].text
