"""Disaggregated prefill/decode (PD) served live by simulated engines (issue #38 item 5):

    workbench serve --simulate h100 --model llama-3.1-70b --tp-size 8 --disaggregation-mode prefill \\
        --disaggregation-bootstrap-port 8998 --port 30001
    workbench serve --simulate h100 --model llama-3.1-70b --tp-size 8 --disaggregation-mode decode --port 30002
    workbench tui --disaggregation --simulate h100 --model llama-3.1-70b --tp-size 8

Each role is a simulated engine (live.py: the real tokenizer manager, scheduler and detokenizer over a
worker that computes nothing, on a simulated clock) with the real PD pieces composed in: the prefill
server's `PrefillBootstrap`, the decode server's `DecodeTransferQueue`, and the real TCP transport
between them. The simulated runner has no KV tensors, so the transport carries each room's meta only
(`KVLayout.none`); what the KV would cost on the deployment's links is the link model's business
(`pd.pd_link`, the one the offline `PDSimulator` times its transfers with):

- the decode side (`LinkTimedReceiver`) holds each pull that came in until its simulated clock has passed
  `tokens x kv bytes per token / (link bandwidth x lanes) + latency` after it came in (and after the
  transfer before it from the same prefill server: they share its links), then hands it to the
  DecodeTransferQueue with the modelled bytes and ms: its `pd.transfer` event says what the deployment
  would have moved, and the first token waits for it;
- the prefill side (`LinkTimedSender`) reports the same modelled bytes and ms for its end of the room.

Each engine keeps its own simulated clock. Both are paced to the wall clock at the same --sim-speed
(hence a positive one: ServerArgs refuses 0), and an idle PD server's clock catches up with the line
`speed x this host's monotonic time` (live.py LiveSimClock's follow_wall), so the servers agree on time
as two real servers on one host share its monotonic clock; `align_clocks` lines them up at once (tui/pd.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from workbench.core.args import ServerArgs
from workbench.core.disaggregation.backends import make_receiver, make_sender
from workbench.core.disaggregation.decode import DecodeTransferQueue
from workbench.core.disaggregation.prefill import PrefillBootstrap
from workbench.core.disaggregation.transfer import KVLayout, KVReceiver, KVSender, TransferMeta, TransferStatus
from workbench.core.simulation.cost_model import CostModel
from workbench.core.simulation.pd import SimKVLink, pd_link


class LinkTimedReceiver:
    """KVReceiver's methods (submit, cancel, poll, in_flight, close) over a real receiver: a finished pull
    is held until `now()` (simulated seconds) passes the link model's time for its room's tokens, counted
    from the poll that saw it come in, or from the end of the transfer before it from the same prefill
    server (they share its links). Failed pulls pass at once. The statuses it returns carry the modelled
    bytes and ms, and `wait_ms` from the submit to the modelled start."""

    def __init__(self, inner: KVReceiver, link: SimKVLink, now: Callable[[], float]):
        self.inner, self.link, self.now = inner, link, now
        self._asked: dict[int, tuple[float, int, tuple[str, int]]] = {}  # room -> (submitted, tokens, prefill)
        self._held: dict[int, tuple[float, TransferStatus]] = {}  # room -> (due, status as modelled)
        self._links_free: dict[tuple[str, int], float] = {}  # prefill address -> when its links are free

    def submit(self, room: int, host: str, port: int, layout: KVLayout) -> None:
        self.inner.submit(room, host, port, layout)
        self._asked[room] = (self.now(), layout.num_tokens, (host, port))

    def cancel(self, room: int) -> None:
        self.inner.cancel(room)
        self._asked.pop(room, None)
        self._held.pop(room, None)

    def poll(self) -> list[TransferStatus]:
        now = self.now()
        out: list[TransferStatus] = []
        for status in self.inner.poll():
            asked, tokens, addr = self._asked.get(status.room, (now, 0, ("", 0)))
            if not status.ok:
                self._asked.pop(status.room, None)
                out.append(status)
                continue
            if status.meta is not None and status.meta.num_tokens:
                tokens = status.meta.num_tokens
            start = max(now, self._links_free.get(addr, now))
            due = start + self.link.transfer_s(tokens)
            self._links_free[addr] = due - self.link.latency_s  # the next room's bytes follow these
            self._held[status.room] = (
                due,
                dataclasses.replace(
                    status,
                    nbytes=tokens * self.link.bytes_per_token,
                    ms=(due - start) * 1e3,
                    wait_ms=max(0.0, start - asked) * 1e3,
                ),
            )
        for room, (due, status) in list(self._held.items()):
            if due <= now:
                del self._held[room]
                self._asked.pop(room, None)
                out.append(status)
        return out

    def next_due(self) -> float | None:
        """When the next held transfer is released (simulated seconds), or None."""
        return min((due for due, _ in self._held.values()), default=None)

    def in_flight(self) -> int:
        return self.inner.in_flight() + len(self._held)

    def close(self) -> None:
        self._held.clear()
        self.inner.close()


class LinkTimedSender:
    """KVSender's methods (put, fail, poll, pending, close, port) over a real sender; each room it reports
    sent carries the link model's bytes and ms for the prompt's tokens (TransferMeta.num_tokens)."""

    def __init__(self, inner: KVSender, link: SimKVLink):
        self.inner, self.link = inner, link

    @property
    def port(self) -> int:
        return self.inner.port

    def put(self, room: int, meta: TransferMeta, k, v) -> None:
        self.inner.put(room, meta, k, v)

    def fail(self, room: int, message: str) -> None:
        self.inner.fail(room, message)

    def poll(self) -> list[TransferStatus]:
        out = []
        for status in self.inner.poll():
            if status.ok and status.meta is not None:
                n = status.meta.num_tokens
                status = dataclasses.replace(
                    status, nbytes=n * self.link.bytes_per_token, ms=self.link.transfer_s(n) * 1e3
                )
            out.append(status)
        return out

    def pending(self) -> int:
        return self.inner.pending()

    def close(self) -> None:
        self.inner.close()


def simulated_pd_part(sa: ServerArgs, cost: CostModel, now: Callable[[], float]) -> Callable | None:
    """The `SchedulerParts.disaggregation` factory of a simulated PD server (None when `sa` serves both
    phases): the real prefill or decode side over the real transport (`sa`'s backend), timed by the link
    model of `cost`'s model and hardware. Both servers are taken to have `sa.tp_size` devices (the link
    has that many lanes); `workbench sim run --pd` sizes the two sides apart."""
    if sa.disaggregation_mode == "null":
        return None
    link = pd_link(cost.model, cost.hw, cost.dtype_bytes, sa.tp_size, sa.tp_size)
    if sa.disaggregation_mode == "prefill":
        return lambda scheduler: PrefillBootstrap(scheduler, sender=LinkTimedSender(make_sender(sa), link))
    return lambda scheduler: DecodeTransferQueue(scheduler, receiver=LinkTimedReceiver(make_receiver(sa), link, now))


def align_clocks(clocks: list, speed: float) -> None:
    """Line simulated engines' clocks up (each a SharedClock, idle): every one jumps to the latest's now
    and runs on at `speed`, so the servers of a PD deployment stamp comparable times from here on."""
    late = max(c.now_ns() for c in clocks)
    for c in clocks:
        c.jump_to(late)
        c.run(speed)
