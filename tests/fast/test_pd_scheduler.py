"""Disaggregated prefill/decode on the real Scheduler, in-process (issue #38): a prefill harness and a decode
harness (tests/scheduler_harness.py's stand-in worker, whose "KV" is the token id written in each slot)
joined by the real TCP transport on loopback. The decode side computes its tokens from the KV it received,
so the outputs equal the single-engine reference only if every prompt slot crossed into the right place.
After every step of both schedulers the KV integrity check runs (reserved slots count as held)."""

from __future__ import annotations

import random
import time

import pytest
from scheduler_harness import SchedulerHarness, expected_tokens
from workbench.core.entrypoints.server_process import free_port
from workbench.core.io_struct import AbortReq, TokenizedGenerateReqInput
from workbench.core.sampling.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)


def _pair(decode_tokens: int = 4096, timeout: float = 20.0, chunk: int = 16, backend: str = "tcp"):
    port = free_port()
    p = SchedulerHarness(
        disaggregation_mode="prefill",
        disaggregation_bootstrap_port=port,
        disaggregation_transfer_timeout=timeout,
        disaggregation_transfer_backend=backend,
        chunked_prefill_size=chunk,
    )
    d = SchedulerHarness(
        disaggregation_mode="decode",
        disaggregation_transfer_timeout=timeout,
        disaggregation_transfer_backend=backend,
        max_total_tokens=decode_tokens,
    )
    return p, d, port


def _mooncake_error() -> str | None:
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except (ImportError, OSError) as exc:
        from workbench.core.disaggregation.mooncake import INSTALL_HINT

        return f"mooncake.engine does not import ({exc}): {INSTALL_HINT}"
    return None


BACKENDS = [
    "tcp",
    pytest.param("mooncake", marks=pytest.mark.skipif(_mooncake_error() is not None, reason=_mooncake_error() or "")),
]


def _req(rid: str, prompt: list[int], n: int, port: int, room: int) -> TokenizedGenerateReqInput:
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return TokenizedGenerateReqInput(
        rid=rid,
        input_text="",
        input_ids=list(prompt),
        sampling_params=params,
        bootstrap_host="127.0.0.1",
        bootstrap_port=port,
        bootstrap_room=room,
    )


def _run(p: SchedulerHarness, d: SchedulerHarness, done, limit_s: float = 60.0) -> None:
    """Step both schedulers until `done()`; transfers run on threads, so give them a moment when idle."""
    deadline = time.monotonic() + limit_s
    while not done():
        assert time.monotonic() < deadline, f"not done: prefill {p.finish}, decode {d.finish}"
        busy = p.step() is not None
        busy = d.step() is not None or busy
        if not busy:
            time.sleep(0.002)


def _close(*hs: SchedulerHarness) -> None:
    for h in hs:
        h.s.disagg.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_outputs_equal_the_single_engine_reference_after_the_handover(backend):
    p, d, port = _pair(backend=backend)
    rng = random.Random(0)
    shared = [rng.randrange(3, 1000) for _ in range(24)]
    prompts = {
        f"r{i}": (shared if i % 2 else []) + [rng.randrange(3, 1000) for _ in range(rng.randrange(3, 40))]
        for i in range(8)
    }
    try:
        for rid, prompt in prompts.items():
            room = rng.getrandbits(62)
            p.send(_req(rid, prompt, 6, port, room))
            d.send(_req(rid, prompt, 6, port, room))
        _run(p, d, lambda: len(d.finish) == len(prompts) and len(p.finish) == len(prompts))
        for rid, prompt in prompts.items():
            want = expected_tokens(prompt, 6)
            assert p.tokens(rid) == want[:1], rid  # the prefill samples the first token only
            assert d.finish[rid] == "length" and d.tokens(rid) == want, rid
        # the decode side never prefilled: every pass there was a decode
        assert not d.extend_batches()
        # chunked on the prefill side (chunk 16), shared prefixes hit its radix cache
        assert any(len(b) and any(n == 16 for _, n in b) for b in p.extend_batches())
        assert any(c > 0 for c in p.cached.values())
        _run(p, d, lambda: p.s.disagg.sender.pending() == 0, 10)
        p.run_until_idle()
        d.run_until_idle()
        p.assert_idle_and_clean()
        d.assert_idle_and_clean()
        state = d.s.get_internal_state().disaggregation
        assert state["pd_transfers_total"] == len(prompts) and state["pd_failed_total"] == 0
        assert state["pd_received_bytes_total"] == 2 * 8 * sum(len(x) for x in prompts.values())  # int64 k and v
    finally:
        _close(p, d)


def test_a_small_decode_pool_holds_requests_in_prealloc_until_slots_free():
    p, d, port = _pair(decode_tokens=96)
    rng = random.Random(1)
    prompts = {f"r{i}": [rng.randrange(3, 1000) for _ in range(30)] for i in range(6)}
    try:
        for rid, prompt in prompts.items():
            room = rng.getrandbits(62)
            p.send(_req(rid, prompt, 8, port, room))
            d.send(_req(rid, prompt, 8, port, room))
        most_waiting = 0
        deadline = time.monotonic() + 60
        while len(d.finish) < len(prompts):
            assert time.monotonic() < deadline, d.finish
            p.step()
            d.step()
            most_waiting = max(most_waiting, len(d.s.disagg.prealloc))
            time.sleep(0.001)
        assert most_waiting >= 3  # 96 slots hold at most two 30-token prompts with room to decode
        for rid, prompt in prompts.items():
            assert d.tokens(rid) == expected_tokens(prompt, 8), rid
        d.run_until_idle()
        d.assert_idle_and_clean()
    finally:
        _close(p, d)


def test_a_reservation_that_evicts_while_nothing_runs_gets_its_kv():
    """One request at a time through a 64-slot decode pool: each reservation evicts the last one's cached
    prompt while no batch runs, and its KV is installed into those slots outside any pass (CI once caught
    the harness poisoning such slots after the install; the order here makes it happen every time)."""
    p, d, port = _pair(decode_tokens=64)
    rng = random.Random(3)
    try:
        for i in range(3):
            prompt = [rng.randrange(3, 1000) for _ in range(40)]
            room = rng.getrandbits(62)
            p.send(_req(f"r{i}", prompt, 4, port, room))
            d.send(_req(f"r{i}", prompt, 4, port, room))
            _run(p, d, lambda i=i: f"r{i}" in d.finish)
            assert d.tokens(f"r{i}") == expected_tokens(prompt, 4), i
        d.run_until_idle()
        d.assert_idle_and_clean()
    finally:
        _close(p, d)


def test_aborts_and_prefill_failures_free_the_reservation_and_say_why():
    p, d, port = _pair(timeout=2.0)
    rng = random.Random(2)
    prompt = [rng.randrange(3, 1000) for _ in range(20)]
    try:
        # 1. aborted on the decode side while its pull waits for a prefill that never comes
        d.send(_req("gone", prompt, 4, port, 11))
        _run(p, d, lambda: d.s.disagg.transferring)
        d.send(AbortReq(rid="gone"))
        _run(p, d, lambda: "gone" in d.finish)
        assert d.finish["gone"] == "abort" and not d.s.disagg.transferring
        d.assert_idle_and_clean()
        # the prefill computes room 11 later: nobody pulls it, it expires after the transfer timeout
        p.send(_req("gone", prompt, 4, port, 11))
        _run(p, d, lambda: "gone" in p.finish)
        _run(p, d, lambda: p.s.disagg.sender.pending() == 0, 10)
        p.step()  # the step that polls the sender's finished rooms
        assert p.s.get_internal_state().disaggregation["pd_failed_total"] == 1

        # 2. aborted on the prefill side before it ran: the decode side hears the reason at once
        d.send(_req("cut", prompt, 4, port, 12))
        p.send(_req("cut", prompt, 4, port, 12))
        p.send(AbortReq(rid="cut"))
        _run(p, d, lambda: "cut" in d.finish, 10)
        assert d.finish["cut"] == "abort" and "could not compute this prompt" in d.errors["cut"]

        # 3. a room reused on one side is refused; 4. a decode request without the router's fields too
        d.send(_req("a", prompt, 4, port, 13))
        d.send(_req("b", prompt, 4, port, 13))
        d.send(TokenizedGenerateReqInput(rid="c", input_text="", input_ids=prompt, sampling_params=SamplingParams()))
        _run(p, d, lambda: "b" in d.finish and "c" in d.finish)
        assert "already in use" in d.errors["b"] and "PD router" in d.errors["c"]
        p.send(_req("a", prompt, 4, port, 13))
        _run(p, d, lambda: "a" in d.finish)
        assert d.tokens("a") == expected_tokens(prompt, 4)

        # 5. a timeout: no prefill ever computes room 14
        d.send(_req("late", prompt, 4, port, 14))
        _run(p, d, lambda: "late" in d.finish, 20)
        assert "within" in d.errors["late"]
        for h in (p, d):
            h.run_until_idle()
            h.assert_idle_and_clean()
    finally:
        _close(p, d)
