"""The prefill side of disaggregated serving: compute the prompt, hand its KV over, forget it.

A prefill server (`--disaggregation-mode prefill`) runs the ordinary scheduler (radix cache, chunked
prefill, batching) on requests that carry a bootstrap room. What changes, in SGLang's order:

    admit      the request's max_new_tokens becomes 1: the prefill samples the first token and stops
    ship       when its prefill finishes, the prompt's KV (every layer, every prompt token) is copied
               out of the pool and put on the bootstrap port (transfer.KVSender) with the first token;
               the pool's copy goes into the radix tree as usual, so later prompts still hit it
    poll       each step, transfers the decode side finished (or that failed or expired) are traced
               and their rooms freed for reuse

A request that ends without a prefill (bad input, aborted, a grammar refusal) fails its room, so the
decode server waiting on it gets the reason instead of a timeout. The HTTP response of the prefill
server (one token) is what SGLang's router discards: the client reads the decode server's.
"""

from __future__ import annotations

import msgspec
from workbench.core.disaggregation import transfer_event
from workbench.core.disaggregation.backends import make_sender
from workbench.core.disaggregation.transfer import KVSender, TransferMeta, TransferStatus
from workbench.core.trace import events as ev


class PrefillBootstrap:
    """Composed into the Scheduler as `scheduler.disagg` on a prefill server."""

    mode = "prefill"

    def __init__(self, scheduler, sender: KVSender | None = None):
        args = scheduler.server_args
        self.scheduler = scheduler
        # None on a runner without KV tensors (the simulator's): the handover then moves no tensors
        self.kv_pool = getattr(scheduler.tp_worker.model_runner, "token_to_kv_pool", None)
        self.sender = sender if sender is not None else make_sender(args)  # tcp or mooncake
        self.rooms: dict[int, str] = {}  # room -> rid: admitted here and not yet picked up, failed or expired
        self.tokens: dict[int, int] = {}  # room -> prompt tokens shipped (for the trace)
        self.sent_bytes_total = 0
        self.transfers_total = 0
        self.failed_total = 0

    # ---- requests in --------------------------------------------------------------------
    def admit(self, req, recv) -> str | None:
        """Take a new request: None, or why it cannot be served (the scheduler aborts it)."""
        room = recv.bootstrap_room
        if room is None:
            return None  # no PD router in front (a health check, a direct call): served as one engine would
        if room in self.rooms:
            return (
                f"bootstrap room {room} is already in use on this prefill server (by {self.rooms[room]}): "
                "each request needs its own room (the router draws a random one per request)"
            )
        req.bootstrap_room = room
        self.rooms[room] = req.rid
        if self.scheduler.tracer.enabled:  # the room joins this request to its decode in the views
            self.scheduler.tracer.emit(ev.PDBootstrap(rid=req.rid, room=room, role="prefill"))
        # The prefill samples the first token only; the decode server makes the rest.
        req.sampling_params = msgspec.structs.replace(req.sampling_params, max_new_tokens=1)
        return None

    def takes(self, req) -> bool:
        """Whether the request waits here instead of the waiting queue (never, on the prefill side)."""
        return False

    # ---- the handover ---------------------------------------------------------------------
    def on_prefilled(self, req) -> None:
        """Hand a prefilled request's prompt KV over (those with a room that did not end in an abort)."""
        fr = req.finished_reason
        if req.bootstrap_room is not None and fr is not None and fr.type != "abort":
            self.ship(req)

    def ship(self, req) -> None:
        """Copy a prefilled request's prompt KV out of the pool and offer it on the bootstrap port.

        Called when its prefill batch's result is processed, before the KV goes to the radix cache: the
        row still maps every prompt token to its slot. The copy is the sender's own (host memory), so the
        pool's slots may be evicted or reused as soon as this returns; the bytes leave on the sender's
        thread while the next batch computes."""
        room = req.bootstrap_room
        n = len(req.origin_input_ids)
        k, v = [], []  # a pool without KV tensors (the simulator's): only the room's timing travels
        if self.kv_pool is not None:
            table = self.scheduler.req_to_token_pool.req_to_token
            slots = table[req.req_pool_idx, :n].to(self.kv_pool.k_buffer[0].device)
            k = [buf.index_select(0, slots).cpu() for buf in self.kv_pool.k_buffer]
            v = [buf.index_select(0, slots).cpu() for buf in self.kv_pool.v_buffer]
        logprob = req.output_token_logprobs[0] if req.return_logprob and req.output_token_logprobs else None
        self.sender.put(
            room,
            TransferMeta(rid=req.rid, first_token=int(req.output_ids[0]), first_logprob=logprob, num_tokens=n),
            k,
            v,
        )
        self.tokens[room] = n
        req.kv_shipped = True

    def on_finished(self, req) -> None:
        """A request's end reached the output: a room never shipped is failed, so the decode side hears why."""
        room = getattr(req, "bootstrap_room", None)
        if room is None or getattr(req, "kv_shipped", False) or room not in self.rooms:
            return
        fr = req.finished_reason
        reason = fr.message if fr is not None and fr.type == "abort" and fr.message else "the prefill ended early"
        self.sender.fail(room, f"the prefill server could not compute this prompt: {reason}")
        req.kv_shipped = True  # failed: nothing more to send

    def abort(self, rid: str) -> None:
        """Nothing waits here outside the scheduler's queues; their abort path ends in on_finished."""

    # ---- each step ------------------------------------------------------------------------
    def step(self) -> None:
        for status in self.sender.poll():
            self._done(status)

    def _done(self, status: TransferStatus) -> None:
        rid = self.rooms.pop(status.room, "")
        tokens = self.tokens.pop(status.room, 0)
        self.transfers_total += 1
        if status.ok:
            self.sent_bytes_total += status.nbytes
        else:
            self.failed_total += 1
        tracer = self.scheduler.tracer
        if tracer.enabled:
            tracer.emit(
                transfer_event(
                    status, rid=rid or (status.meta.rid if status.meta else ""), role="prefill", tokens=tokens
                )
            )

    def has_pending(self) -> bool:
        """Prefill holds no pool slots for a transfer: the idle loop and the KV check need not wait."""
        return False

    def held_reqs(self) -> list:
        return []

    def fill_state(self, state: dict) -> None:
        state.update(
            disaggregation_mode="prefill",
            pd_rooms=len(self.rooms),
            pd_held=self.sender.pending(),
            pd_transfers_total=self.transfers_total,
            pd_failed_total=self.failed_total,
            pd_sent_bytes_total=self.sent_bytes_total,
            pd_bootstrap_port=self.sender.port,
        )

    def close(self) -> None:
        self.sender.close()


def kv_bytes(kv_pool, num_tokens: int) -> int:
    """The KV bytes of num_tokens tokens in this pool (what one prompt's handover moves)."""
    return num_tokens * kv_pool.bytes_per_token()
