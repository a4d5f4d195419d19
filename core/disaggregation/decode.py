"""The decode side of disaggregated serving: reserve, pull, decode.

A decode server (`--disaggregation-mode decode`) never prefills a new prompt. A request reaches it with
the bootstrap address of the prefill server computing it and a room naming it on both sides, and moves
through two queues of its own (SGLang's PreallocQueue and TransferQueue) before the running batch:

    prealloc     waiting for room: a request row and one KV slot per prompt token are reserved first
                 (as SGLang's decode side pre-allocates), so a transfer never lands in a full pool
    transfer     the reserved request pulls its prompt's KV from the prefill server's bootstrap port
                 (transfer.KVReceiver, per layer, on a background thread) while the batch decodes
    install      the KV is written into the reserved slots, the prefill's first token becomes the first
                 output token (streamed to the client: TTFT), the prompt is published to the radix cache,
                 and the request joins the running batch as if it had been prefilled here

A transfer that fails (prefill unreachable or dead, timeout, a room in use, a different model) aborts its
request with the reason and frees its reservation; the rest of the batch goes on. A decode request the
scheduler later retracts under memory pressure is recomputed here like any retracted request.
"""

from __future__ import annotations

from workbench.core.disaggregation import transfer_event
from workbench.core.disaggregation.backends import make_receiver
from workbench.core.disaggregation.transfer import KVLayout, KVReceiver, RoomInUseError, TransferStatus
from workbench.core.managers.schedule_batch import FinishReason
from workbench.core.trace import events as ev


class DecodeTransferQueue:
    """Composed into the Scheduler as `scheduler.disagg` on a decode server."""

    mode = "decode"

    def __init__(self, scheduler, receiver: KVReceiver | None = None):
        self.scheduler = scheduler
        # None on a runner without KV tensors (the simulator's): nothing to write at install
        self.kv_pool = getattr(scheduler.tp_worker.model_runner, "token_to_kv_pool", None)
        self.receiver = receiver if receiver is not None else make_receiver(scheduler.server_args)
        self.prealloc: list = []  # admitted, waiting for a row and slots
        self.transferring: dict[int, object] = {}  # room -> request whose KV is on its way
        self.received_bytes_total = 0
        self.transfers_total = 0
        self.failed_total = 0

    # ---- requests in --------------------------------------------------------------------
    def admit(self, req, recv) -> str | None:
        if recv.bootstrap_room is None or recv.bootstrap_host is None or recv.bootstrap_port is None:
            return (
                "this is a decode server (--disaggregation-mode decode): it takes requests through a PD router "
                "(python -m sglang_router.launch_router --pd-disaggregation ...), which adds bootstrap_host, "
                "bootstrap_port and bootstrap_room"
            )
        room = recv.bootstrap_room
        if room in self.transferring or any(r.bootstrap_room == room for r in self.prealloc):
            return f"bootstrap room {room} is already in use on this decode server: each request needs its own room"
        req.bootstrap_room = room
        req.bootstrap_addr = (recv.bootstrap_host, recv.bootstrap_port)
        if self.scheduler.tracer.enabled:  # the room joins this request to its prefill in the views
            self.scheduler.tracer.emit(ev.PDBootstrap(rid=req.rid, room=room, role="decode"))
        return None

    def takes(self, req) -> bool:
        """A decode request waits in the prealloc queue, not the waiting queue (nothing to prefill)."""
        self.prealloc.append(req)
        tracer = self.scheduler.tracer
        if tracer.enabled:
            tracer.emit(
                ev.ReqQueued(rid=req.rid, prompt_tokens=len(req.origin_input_ids), queue_len=len(self.prealloc))
            )
        return True

    def abort(self, rid: str) -> None:
        """Abort queued or transferring requests ("" = all): reservations freed, the client told."""
        for req in [r for r in self.prealloc if rid in ("", r.rid)]:
            self.prealloc.remove(req)
            self._fail(req, "aborted", status=0)
        for room, req in list(self.transferring.items()):
            if rid in ("", req.rid):
                self.receiver.cancel(room)
                del self.transferring[room]
                self._fail(req, "aborted", status=0)

    def on_prefilled(self, req) -> None:
        """Only a retracted request is prefilled here (recomputed): nothing to hand over."""

    def on_finished(self, req) -> None:
        pass

    # ---- each step ------------------------------------------------------------------------
    def step(self) -> None:
        """Install finished transfers, then reserve for as many queued requests as fit (FIFO)."""
        for status in self.receiver.poll():
            req = self.transferring.pop(status.room, None)
            if req is None:
                continue  # cancelled meanwhile
            self._trace(req, status)
            if status.ok:
                self._install(req, status)
            else:
                self._fail(req, status.error or "the KV transfer failed")
        while self.prealloc and self._reserve(self.prealloc[0]):
            self.prealloc.pop(0)

    def _reserve(self, req) -> bool:
        """A request row and one KV slot per prompt token, then the pull starts; False: not yet (no room)."""
        s = self.scheduler
        alloc, tree, rows = s.token_to_kv_pool_allocator, s.tree_cache, s.req_to_token_pool
        n = len(req.origin_input_ids)
        holders = len(s.running_batch.reqs) + len(self.transferring)
        if holders >= s.max_running_requests or rows.available_size() < 1:
            return False
        # Leave every running request (and those arriving) one token of room for the next step: the
        # retraction path handles the rest, as for requests prefilled here.
        if alloc.available_size() + tree.evictable_size() < n + holders + 1:
            return False
        if alloc.available_size() < n:
            tree.evict(n - alloc.available_size())
        slots = alloc.alloc(n)
        if slots is None:
            return False
        row = rows.alloc(1)[0]
        rows.req_to_token[row, :n] = slots.to(rows.req_to_token.dtype)
        req.req_pool_idx, req.kv_len = row, n  # held: the KV check counts these slots as the request's
        host, port = req.bootstrap_addr
        pool = self.kv_pool
        layout = (
            KVLayout(n, pool.layer_num, pool.head_num, pool.head_dim, str(pool.dtype))
            if pool is not None
            else KVLayout.none(n)  # no KV tensors (a simulated server): the room's meta alone travels
        )
        try:
            self.receiver.submit(req.bootstrap_room, host, port, layout)
        except RoomInUseError as e:
            self._fail(req, str(e), status=400)
            return True
        self.transferring[req.bootstrap_room] = req
        if s.tracer.enabled:  # the end of the decode queue in the views' TTFT parts
            s.tracer.emit(ev.PDReserved(rid=req.rid, room=req.bootstrap_room, tokens=n))
        return True

    def _install(self, req, status: TransferStatus) -> None:
        s = self.scheduler
        assert status.meta is not None
        n = len(req.origin_input_ids)
        pool = self.kv_pool
        if pool is not None:  # a pool without KV tensors (the simulator's) has nothing to write
            assert status.k is not None and status.v is not None
            slots = s.req_to_token_pool.req_to_token[req.req_pool_idx, :n].to(pool.k_buffer[0].device)
            for layer, (k, v) in enumerate(zip(status.k, status.v)):
                pool.k_buffer[layer][slots] = k.to(pool.k_buffer[layer].device, pool.dtype)
                pool.v_buffer[layer][slots] = v.to(pool.v_buffer[layer].device, pool.dtype)
        req.output_ids.append(status.meta.first_token)
        if req.return_logprob:
            req.output_token_logprobs.append(
                status.meta.first_logprob if status.meta.first_logprob is not None else 0.0
            )
            if req.top_logprobs_num > 0:
                req.output_top_logprobs.append([])  # the prefill side's top logprobs do not travel
        if req.grammar is not None and not req.grammar.accept_token(int(status.meta.first_token)):
            req.to_abort = "the prefill server's first token does not fit the request's grammar"
        req.check_finished(s._decode_tail)
        req.fill_ids = list(req.origin_input_ids)
        if req.finished():
            s.tree_cache.cache_finished_req(req)
        else:
            s.tree_cache.cache_unfinished_req(req)  # the prompt's KV is the tree's now, locked for this request
            s.running_batch.merge_batch(s._new_batch([req]))
        if s.tracer.enabled:
            s.tracer.emit(ev.ReqScheduled(rid=req.rid, prefix_hit=0, extend_len=0))
        s.stream_output([req])

    def _fail(self, req, message: str, status: int = 502) -> None:
        """End a request held here with an error (502: its KV did not come; 0: a plain abort), its
        reservation freed."""
        s = self.scheduler
        if req.req_pool_idx is not None:
            n = req.kv_len
            s.token_to_kv_pool_allocator.free(s.req_to_token_pool.req_to_token[req.req_pool_idx, :n].clone())
            s.req_to_token_pool.free(req.req_pool_idx)
            req.req_pool_idx, req.kv_len = None, 0
        req.finished_reason = FinishReason("abort", message=message, status=status)
        s.stream_output([req])

    def _trace(self, req, status: TransferStatus) -> None:
        self.transfers_total += 1
        if status.ok:
            self.received_bytes_total += status.nbytes
        else:
            self.failed_total += 1
        tracer = self.scheduler.tracer
        if tracer.enabled:
            tracer.emit(transfer_event(status, rid=req.rid, role="decode", tokens=len(req.origin_input_ids)))

    # ---- what the loop and the checks read ---------------------------------------------------
    def has_pending(self) -> bool:
        """Requests here: the loop keeps polling (briefly) and the idle KV check waits for them."""
        return bool(self.prealloc or self.transferring)

    def held_reqs(self) -> list:
        """Requests holding a row and reserved slots while their KV is on its way (for the KV check)."""
        return list(self.transferring.values())

    def fill_state(self, state: dict) -> None:
        state.update(
            disaggregation_mode="decode",
            pd_prealloc=len(self.prealloc),
            pd_transferring=len(self.transferring),
            pd_transfers_total=self.transfers_total,
            pd_failed_total=self.failed_total,
            pd_received_bytes_total=self.received_bytes_total,
        )

    def close(self) -> None:
        self.receiver.close()
