"""Shared by the reliability suite (load, faults, fuzz, security).

- `STATS`: the figures printed at the end of the run by `pytest_terminal_summary`
  in conftest.py (requests sent, faults injected, fuzz cases, unexpected outcomes).
- References: a greedy or seeded continuation fetched from the server's own
  `/generate` (token ids, exact), and what a shorter request must then return.
- HTTP helpers that read a whole response or SSE stream into plain data.
- `assert_server_clean`: over HTTP, once idle every KV slot and request row is
  free, no request state is left in the TokenizerManager, and a cache flush
  empties the pool.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

# Figures for the end-of-run summary; every reliability test adds to them.
STATS: dict[str, int] = {"requests": 0, "faults": 0, "fuzz_cases": 0, "unexpected": 0}

RELIABILITY_FILES = (
    "test_reliability_load.py",
    "test_reliability_faults.py",
    "test_fuzz_http.py",
    "test_security.py",
    "test_security_e2e.py",
)


def count(key: str, n: int = 1) -> None:
    STATS[key] = STATS.get(key, 0) + n


# ---------------------------------------------------------------- references


@dataclass(frozen=True)
class Reference:
    """A request's full continuation at `max_new_tokens` (token ids and how it ended)."""

    output_ids: tuple[int, ...]
    finish: str  # "stop" or "length"
    max_new_tokens: int

    def expect(self, k: int) -> tuple[list[int], str]:
        """What the same request with max_new_tokens=k (k <= max_new_tokens) must return.

        When the k-th token is also the stop token, the length limit wins (as in SGLang:
        check_finished tests max_new_tokens first), so "stop" needs k > len(output_ids)."""
        assert k <= self.max_new_tokens
        if self.finish == "stop" and k > len(self.output_ids):
            return list(self.output_ids), "stop"
        return list(self.output_ids[:k]), "length"


def fetch_reference(
    client: httpx.Client, input_ids: list[int], sampling: dict[str, Any], headers: dict | None = None
) -> Reference:
    """The server's own /generate answer for `input_ids` (non-streaming)."""
    r = client.post(
        "/generate", json={"input_ids": input_ids, "sampling_params": sampling}, headers=headers, timeout=300
    )
    assert r.status_code == 200, r.text
    body = r.json()
    finish = body["meta_info"]["finish_reason"]["type"]
    assert finish in ("stop", "length"), body
    return Reference(tuple(body["output_ids"]), finish, sampling["max_new_tokens"])


# ---------------------------------------------------------------- HTTP


@dataclass
class Outcome:
    """One HTTP exchange as plain data."""

    status: int
    body: Any = None  # parsed JSON (non-streaming)
    events: list[Any] = field(default_factory=list)  # parsed SSE events (streaming), [DONE] excluded
    done: bool = False  # the stream ended with [DONE]
    error: str | None = None  # transport error, if any


async def post(client: httpx.AsyncClient, path: str, body: Any, stream: bool, **kw) -> Outcome:
    """POST `body`; a stream is read to its end (SSE events parsed as JSON)."""
    count("requests")
    try:
        if not stream:
            r = await client.post(path, json=body, **kw)
            try:
                parsed = r.json()
            except ValueError:
                parsed = r.text
            return Outcome(r.status_code, body=parsed)
        async with client.stream("POST", path, json=body, **kw) as r:
            if r.status_code != 200:
                await r.aread()
                return Outcome(r.status_code, body=r.json())
            out = Outcome(200)
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    out.done = True
                else:
                    out.events.append(json.loads(data))
            return out
    except httpx.HTTPError as e:
        return Outcome(0, error=f"{type(e).__name__}: {e}")


def stream_errors(events: list[Any]) -> list[dict]:
    """In-band error events of an SSE stream."""
    return [e["error"] for e in events if isinstance(e, dict) and "error" in e]


def openai_text(kind: str, out: Outcome) -> tuple[str, str | None, int | None]:
    """(text, finish_reason, completion_tokens or None) of a chat/completions answer, streamed or not."""
    if out.events or out.done:
        text, finish, usage = "", None, None
        for ev in out.events:
            if ev.get("usage"):
                usage = ev["usage"]["completion_tokens"]
            for ch in ev.get("choices", []):
                piece = ch["delta"].get("content") if kind == "chat" else ch.get("text")
                text += piece or ""
                finish = ch.get("finish_reason") or finish
        return text, finish, usage
    ch = out.body["choices"][0]
    text = ch["message"]["content"] if kind == "chat" else ch["text"]
    return text, ch["finish_reason"], out.body["usage"]["completion_tokens"]


def generate_result(out: Outcome) -> tuple[list[int], str | None]:
    """(output_ids, finish type) of a native /generate answer, streamed or not."""
    final = out.events[-1] if out.events else out.body
    fr = final["meta_info"]["finish_reason"]
    return list(final["output_ids"]), fr["type"] if fr else None


# ---------------------------------------------------------------- server state


def server_info(url: str, headers: dict | None = None) -> dict:
    r = httpx.get(url + "/get_server_info", headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(cond, timeout: float = 60.0, what: str = "condition", interval: float = 0.1):
    """Poll until cond() is truthy (a bound on the wait, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def assert_server_clean(url: str, headers: dict | None = None, timeout: float = 60.0) -> dict:
    """Idle: no request state left, every request row free, every KV slot free or cached;
    after /flush_cache every KV slot is free."""

    def idle():
        info = server_info(url, headers)
        st = info["internal_state"]
        return (
            info if info["num_inflight_requests"] == 0 and st["num_running"] == 0 and st["num_waiting"] == 0 else None
        )

    info = wait_for(idle, timeout, "the server to go idle")
    st = info["internal_state"]
    assert st["kv_free"] + st["kv_evictable"] == st["kv_total"], f"KV slots leaked: {st}"
    assert st["req_slots_free"] == st["req_slots_total"], f"request rows leaked: {st}"
    r = httpx.post(url + "/flush_cache", headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    st = server_info(url, headers)["internal_state"]
    assert st["kv_free"] == st["kv_total"] and st["kv_used"] == 0, f"KV slots leaked: {st}"
    return st


def gather_bounded(coros, limit: int):
    """Run coroutines with at most `limit` in flight; results in order."""
    sem = asyncio.Semaphore(limit)

    async def one(c):
        async with sem:
            return await c

    return asyncio.gather(*(one(c) for c in coros))


class BackgroundLoad:
    """Send `specs` ((path, body, stream, ...) each) all at once from a thread, so the test can
    inject a fault meanwhile; `join(timeout)` returns the outcomes in spec order (None if the
    requests are still running: they hung)."""

    def __init__(self, url: str, specs: list[tuple]):
        self._outs: list[Outcome] | None = None

        async def send_all():
            async with httpx.AsyncClient(base_url=url, timeout=600) as client:
                return await asyncio.gather(*(post(client, *s[:3]) for s in specs))

        def run():
            self._outs = asyncio.run(send_all())

        self._thread = threading.Thread(target=run, name="background-load")
        self._thread.start()

    def join(self, timeout: float) -> list[Outcome] | None:
        self._thread.join(timeout)
        return None if self._thread.is_alive() else self._outs
