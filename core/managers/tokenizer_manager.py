"""TokenizerManager: the front door, in the main process, on an asyncio loop.

For each request it tokenizes (applying the chat template upstream), checks the
input, creates a `ReqState`, and sends a `TokenizedGenerateReqInput` to the
scheduler. A background task receives `BatchStrOut` from the detokenizer and
wakes the waiting coroutines. It also measures what a client feels: time to
first token (TTFT), time per output token (TPOT) and end-to-end latency (E2E),
with the same monotonic clock the trace uses.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from workbench.core.constrained.grammar import GrammarBackend, grammar_of
from workbench.core.io_struct import (
    AbortReq,
    BatchStrOut,
    DestroyWeightsUpdateGroupReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    GetWeightsByNameReq,
    GetWeightsByNameReqOutput,
    InitWeightsUpdateGroupReq,
    InitWeightsUpdateGroupReqOutput,
    LoadLoRAAdapterReq,
    LoRAUpdateOutput,
    Msg,
    SetTraceReq,
    StepGateReq,
    StepGateReqOutput,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReq,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDistributedReq,
    UpdateWeightsFromTensorReq,
    UpdateWeightsReqOutput,
    decode_msg,
    encode_msg,
)
from workbench.core.ipc import PortArgs
from workbench.core.sampling.sampling_params import SamplingParams
from workbench.core.trace import clock as trace_clock
from workbench.core.trace import events as ev

logger = logging.getLogger(__name__)


WEIGHTS_UPDATE_TIMEOUT_S = 1800.0  # a distributed push or a big checkpoint can take long


def _no_text(token_id: int) -> None:
    return None


class EngineDeadError(RuntimeError):
    """A child process died: the engine can no longer serve."""


class RequestFailedError(RuntimeError):
    """The scheduler ended a request with an error before any output (a PD transfer that failed, a
    bootstrap room in use, ...); `status_code` is the HTTP status the server answers with."""

    def __init__(self, message: str, status_code: int):
        super().__init__(message)
        self.status_code = status_code


@dataclass
class GenerateReqInput:
    """One request as the TokenizerManager receives it (after batch/n expansion)."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | None = None
    # Tokens to emit instead of sampling, in turn, where the worker honours them (a worker that does
    # not compute: a recorded run's output replayed); None: sample.
    forced_output_ids: list[int] | None = None
    # ... and, with speculative decoding on, drafts to propose instead of drafting: output length -> drafts.
    forced_drafts: dict[int, list[int]] | None = None
    # When the request arrived, on the trace clock; None: now. A driver replaying a workload sets it:
    # the request arrived mid-step.
    arrival_ns: int | None = None
    # Disaggregated serving: where the prefill side of this request hands its KV over (the PD router sets them).
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    # Priority scheduling: the request's priority (SGLang's `priority`; None: the least urgent).
    priority: int | None = None
    # Multi-LoRA (--enable-lora): the adapter to run under, by name (SGLang's `lora_path`); None: the base model.
    lora_path: str | None = None


@dataclass
class ReqState:
    """What the main process knows about one in-flight request."""

    rid: str
    prompt_tokens: int
    stream: bool
    created_ns: int
    event: asyncio.Event
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: dict | None = None
    first_token_ns: int = 0
    finished_ns: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_token_logprobs: list | None = None
    input_top_logprobs: list | None = None  # per prompt position: [[logprob, id, text], ...] or None
    # Logprobs in SGLang's shape: [logprob, token_id, text or None]; prompt positions from
    # logprob_start_len on (input_ids kept for their ids only when prompt logprobs were asked for).
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    logprob_start_len: int = -1
    input_ids: list[int] | None = None
    pending_delta: str = ""
    error: str | None = None
    sent_s: float = 0.0  # time.monotonic() when it went to the scheduler (stall_s)


class TokenizerManager:
    def __init__(
        self,
        server_args,
        port_args: PortArgs,
        tokenizer,
        context_len: int,
        max_total_tokens: int,
        tracer,
        loop: asyncio.AbstractEventLoop,
        clock: trace_clock.TraceClock | None = None,
    ):
        self.server_args = server_args
        # Every stamp (meta_info latencies, req.* events): the engine's clock (trace/clock.py): the host's
        # monotonic clock, or the one the engine's processes share.
        self.clock = clock if clock is not None else trace_clock.current()
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.max_total_tokens = max_total_tokens
        self.tracer = tracer
        self.loop = loop
        self.ctx = zmq.asyncio.Context(1)
        self.send_to_scheduler = self.ctx.socket(zmq.PUSH)
        self.send_to_scheduler.setsockopt(zmq.LINGER, 0)
        self.send_to_scheduler.setsockopt(zmq.SNDHWM, 0)
        self.send_to_scheduler.connect(port_args.scheduler_input_ipc_name)
        self.recv_from_detokenizer = self.ctx.socket(zmq.PULL)
        self.recv_from_detokenizer.setsockopt(zmq.LINGER, 0)
        self.recv_from_detokenizer.setsockopt(zmq.RCVHWM, 0)
        self.recv_from_detokenizer.bind(port_args.tokenizer_ipc_name)
        self.rid_to_state: dict[str, ReqState] = {}
        self.dead_reason: str | None = None
        # Control replies come back in order on the same socket; one waiter per type.
        self._control_waiters: dict[type, list[asyncio.Future]] = {}
        self._control_lock = asyncio.Lock()
        self._join_lock = asyncio.Lock()  # one weight-group join at a time (their answers are matched in order)
        # Progress of the scheduler as seen from here (stall_s): when it last sent anything, and whether
        # it was paused on purpose (the step gate).
        self.last_receive_s = time.monotonic()
        self.scheduler_paused = False
        # Weight updates: one at a time; while one runs, new requests wait on the gate.
        self._weights_update_lock = asyncio.Lock()
        self._weights_gate = asyncio.Event()
        self._weights_gate.set()
        self.num_held_requests = 0  # new requests waiting for a weight update to end
        self.num_requests_total = 0
        self._grammar_check: GrammarBackend | None = None  # structured outputs: a GrammarBackend made at the first use
        self.handle_loop_task = loop.create_task(self.handle_loop())

    # ==== requests ===================================================================
    async def generate_request(self, obj: GenerateReqInput) -> AsyncIterator[dict]:
        """Yield result dicts for one request: chunks when streaming, else one final dict."""
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        # A shared clock stops here, and the scheduler will not step before this request is in: this
        # host's trip is not the deployment's (trace/clock.py). A no-op on the host's clock.
        clock = self.clock
        clock.note_sent()
        try:
            created = obj.arrival_ns if obj.arrival_ns is not None else clock.now_ns()
            if not self._weights_gate.is_set():
                await self._hold_for_weights_update()
            rid = obj.rid or uuid.uuid4().hex
            if rid in self.rid_to_state:
                raise ValueError(f"request id {rid!r} is already in use")
            if self.tracer.enabled:
                preview = (obj.text or "")[:80]
                self.tracer.emit(ev.ReqArrived(rid=rid, prompt_preview=preview, ts=created))
            input_ids = self._tokenize(obj)
            sp = obj.sampling_params
            self._validate(input_ids, sp, obj)
            try:
                # Encoded before the state exists: a value msgpack cannot carry is a bad request, not a leak.
                wire = encode_msg(
                    TokenizedGenerateReqInput(
                        rid=rid,
                        input_text=(obj.text or "")[:200],
                        input_ids=input_ids,
                        sampling_params=sp,
                        return_logprob=obj.return_logprob,
                        top_logprobs_num=obj.top_logprobs_num,
                        logprob_start_len=obj.logprob_start_len,
                        stream=obj.stream,
                        arrival_ts=created,
                        forced_output_ids=obj.forced_output_ids,
                        forced_drafts=obj.forced_drafts,
                        bootstrap_host=obj.bootstrap_host,
                        bootstrap_port=obj.bootstrap_port,
                        bootstrap_room=obj.bootstrap_room,
                        priority=obj.priority,
                        lora_path=obj.lora_path,
                    )
                )
            except (OverflowError, TypeError, msgspec.EncodeError) as e:
                raise ValueError(f"a request parameter cannot be represented: {e}") from None
            state = ReqState(
                rid=rid,
                prompt_tokens=len(input_ids),
                stream=obj.stream,
                created_ns=created,
                event=asyncio.Event(),
                return_logprob=obj.return_logprob,
                return_text_in_logprobs=obj.return_text_in_logprobs,
                logprob_start_len=obj.logprob_start_len,
                input_ids=input_ids if obj.return_logprob and obj.logprob_start_len >= 0 else None,
            )
        except BaseException:
            clock.note_unsent()  # never sent: the scheduler must not wait for it
            raise
        self.rid_to_state[rid] = state
        self.num_requests_total += 1
        if self.tracer.enabled:
            ids = list(input_ids) if self.server_args.trace_token_ids else None
            self.tracer.emit(
                ev.ReqTokenized(rid=rid, prompt_tokens=len(input_ids), max_new_tokens=sp.max_new_tokens, input_ids=ids)
            )
            self.tracer.flush()
        try:
            state.sent_s = time.monotonic()
            await self.send_to_scheduler.send(wire)
            async for out in self._wait_one(state, obj.stream):
                yield out
        finally:
            if not state.finished:
                # The consumer went away (client disconnect, cancelled task): free the request's KV.
                await self.abort_request(rid)
            self.rid_to_state.pop(rid, None)

    def _tokenize(self, obj: GenerateReqInput) -> list[int]:
        if obj.input_ids is not None:
            ids = list(obj.input_ids)
            vocab = len(self.tokenizer)
            if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in ids):
                raise ValueError(f"input_ids must be integers in [0, {vocab})")
            return ids
        if obj.text is None:
            raise ValueError("either a prompt (text) or input_ids is required")
        return self.tokenizer.encode(obj.text, add_special_tokens=False) if obj.text else []

    def _validate(self, input_ids: list[int], sp: SamplingParams, obj: GenerateReqInput) -> None:
        if not input_ids:
            raise ValueError("the prompt is empty")
        sp.normalize()
        sp.verify(vocab_size=len(self.tokenizer))
        grammar = grammar_of(sp)
        if grammar is not None:
            # A grammar xgrammar cannot read is the caller's error: say so here (a 400), not as an
            # aborted request. Compiled grammars are cached, so a repeated one costs a lookup.
            if self._grammar_check is None:
                self._grammar_check = GrammarBackend(self.tokenizer, len(self.tokenizer))
            self._grammar_check.compile(*grammar)
        if len(input_ids) + sp.max_new_tokens > self.context_len:
            raise ValueError(
                f"this model's maximum context length is {self.context_len} tokens; the prompt has "
                f"{len(input_ids)} tokens and max_new_tokens is {sp.max_new_tokens}: shorten the prompt "
                f"or lower max_new_tokens"
            )
        if len(input_ids) + sp.max_new_tokens > self.max_total_tokens:
            raise ValueError(
                f"prompt ({len(input_ids)} tokens) + max_new_tokens ({sp.max_new_tokens}) exceeds the KV pool "
                f"({self.max_total_tokens} tokens); raise --max-total-tokens or shorten the request"
            )
        if obj.lora_path is not None and not self.server_args.enable_lora:
            raise ValueError(
                f"lora_path {obj.lora_path!r} names a LoRA adapter, but this server runs without LoRA: "
                "restart it with --enable-lora (and --lora-paths NAME=PATH)"
            )
        if obj.top_logprobs_num < 0 or obj.top_logprobs_num > self.server_args.max_top_logprobs:
            raise ValueError(f"top_logprobs_num must be in [0, {self.server_args.max_top_logprobs}]")

    async def _wait_one(self, state: ReqState, stream: bool) -> AsyncIterator[dict]:
        while True:
            try:
                await asyncio.wait_for(state.event.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                if self.dead_reason:
                    raise EngineDeadError(self.dead_reason) from None
                continue
            state.event.clear()
            if state.error and not state.finished:
                raise EngineDeadError(state.error)
            fr = state.finish_reason or {}
            if state.finished and fr.get("status_code") and not state.output_ids:
                # Failed before any output (a PD transfer, a room in use): an error, not an empty answer.
                raise RequestFailedError(fr.get("message", "the request failed"), fr["status_code"])
            if stream:
                delta, state.pending_delta = state.pending_delta, ""
                yield self._result(state, delta)
            if state.finished:
                if not stream:
                    yield self._result(state, None)
                return

    def _result(self, state: ReqState, delta: str | None) -> dict:
        meta: dict[str, Any] = {
            "id": state.rid,
            "prompt_tokens": state.prompt_tokens,
            "completion_tokens": state.completion_tokens,
            "cached_tokens": state.cached_tokens,
            "finish_reason": state.finish_reason,
            "e2e_latency": ((state.finished_ns or self.clock.now_ns()) - state.created_ns) / 1e9,
            "ttft": (state.first_token_ns - state.created_ns) / 1e9 if state.first_token_ns else None,
        }
        if state.return_logprob:  # SGLang: present (maybe []) whenever logprobs were asked for
            meta["output_token_logprobs"] = state.output_token_logprobs
            meta["output_top_logprobs"] = state.output_top_logprobs
        if state.input_token_logprobs is not None:
            meta["input_token_logprobs"] = state.input_token_logprobs
            meta["input_top_logprobs"] = state.input_top_logprobs or []  # SGLang: [] without top_logprobs_num
        out = {"text": state.text, "output_ids": list(state.output_ids), "meta_info": meta}
        if delta is not None:
            out["delta"] = delta
        return out

    async def abort_request(self, rid: str) -> None:
        if self.dead_reason:
            return
        await self.send_to_scheduler.send(encode_msg(AbortReq(rid=rid)))

    # ==== receiving ====================================================================
    async def handle_loop(self) -> None:
        while True:
            data = await self.recv_from_detokenizer.recv()
            self.last_receive_s = time.monotonic()
            try:
                msg = decode_msg(data)
            except Exception:
                logger.warning("tokenizer manager: dropped an undecodable message")
                continue
            if isinstance(msg, BatchStrOut):
                self._handle_batch_output(msg)
            else:
                waiters = self._control_waiters.get(type(msg))
                if waiters:
                    fut = waiters.pop(0)
                    if not fut.done():
                        fut.set_result(msg)

    def _handle_batch_output(self, out: BatchStrOut) -> None:
        # On a clock this host's delays do not move, tokens are out when their step ends (the scheduler's
        # stamp), not after the trip through the detokenizer. On the host's clock: on arrival here.
        now = out.ts if out.ts and not self.clock.counts_host_delays else self.clock.now_ns()
        tracing = self.tracer.enabled
        for i, rid in enumerate(out.rids):
            state = self.rid_to_state.get(rid)
            if state is None:
                continue  # aborted and already released
            new_ids = out.new_token_ids[i]
            if new_ids and not state.first_token_ns:
                state.first_token_ns = now
                if tracing:
                    self.tracer.emit(ev.ReqFirstToken(rid=rid, ts=now))
            delta = out.text_deltas[i]
            state.text += delta
            state.pending_delta += delta
            state.output_ids.extend(new_ids)
            state.completion_tokens = out.completion_tokens[i]
            state.cached_tokens = out.cached_tokens[i]
            if out.output_token_logprobs is not None:
                lps = out.output_token_logprobs[i]
                text_of = self._token_text if state.return_text_in_logprobs else _no_text
                state.output_token_logprobs.extend([lp, tid, text_of(tid)] for lp, tid in zip(lps, new_ids))
                tops = out.output_top_logprobs[i] if out.output_top_logprobs else []
                state.output_top_logprobs.extend([[v, t, text_of(t)] for t, v in row] for row in tops)
                prompt_lps = out.input_token_logprobs[i] if out.input_token_logprobs is not None else None
                if prompt_lps is not None:
                    state.input_token_logprobs = self._prompt_logprobs(state, prompt_lps, text_of)
                prompt_tops = out.input_top_logprobs[i] if out.input_top_logprobs is not None else None
                if prompt_tops is not None:
                    state.input_top_logprobs = self._prompt_top_logprobs(state, prompt_tops, text_of)
            if tracing and delta:
                self.tracer.emit(ev.ReqText(rid=rid, delta=delta))
            reason = out.finished_reasons[i]
            if reason is not None:
                state.finished = True
                state.finished_ns = now
                matched = out.matched_stops[i]
                fr: dict[str, Any] = {"type": reason}
                if reason == "abort":
                    fr["message"] = matched or "aborted"
                    status = out.error_status[i] if out.error_status else 0
                    if status:
                        fr["status_code"] = status  # SGLang's key: the server answers with this error
                else:
                    fr["matched"] = matched
                state.finish_reason = fr
                if tracing:
                    self._emit_finished(state, reason, now)
            state.event.set()
        if tracing:
            self.tracer.flush()

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    @staticmethod
    def _prompt_logprobs(state: ReqState, by_position: list, text_of) -> list:
        """The scheduler's per-position prompt logprobs -> SGLang's entries for positions
        logprob_start_len.. : [logprob (None for position 0, which nothing predicts), id, text]."""
        ids = state.input_ids or []
        start = max(state.logprob_start_len, 0)
        return [
            [by_position[p] if p < len(by_position) else None, ids[p], text_of(ids[p])] for p in range(start, len(ids))
        ]

    @staticmethod
    def _prompt_top_logprobs(state: ReqState, by_position: list, text_of) -> list:
        """The scheduler's per-position top (id, logprob) pairs -> SGLang's input_top_logprobs for
        positions logprob_start_len..: a list of [logprob, id, text] per position, None where unscored."""
        start = max(state.logprob_start_len, 0)
        n = len(state.input_ids or [])
        out: list = []
        for p in range(start, n):
            row = by_position[p] if p < len(by_position) else None
            out.append([[v, t, text_of(t)] for t, v in row] if row else None)
        return out

    def _emit_finished(self, state: ReqState, reason: str, now: int) -> None:
        ttft = (state.first_token_ns - state.created_ns) / 1e9 if state.first_token_ns else 0.0
        e2e = (now - state.created_ns) / 1e9
        n = state.completion_tokens
        tpot = (now - state.first_token_ns) / 1e9 / (n - 1) if n > 1 and state.first_token_ns else 0.0
        self.tracer.emit(
            ev.ReqFinished(
                rid=state.rid,
                reason=reason,
                prompt_tokens=state.prompt_tokens,
                completion_tokens=n,
                cached_tokens=state.cached_tokens,
                ttft=ttft,
                tpot=tpot,
                e2e=e2e,
                ts=now,
                output_ids=list(state.output_ids) if self.server_args.trace_token_ids else None,
            )
        )

    # ==== control =====================================================================
    async def _control(self, req: Msg, reply_type: type, timeout: float = 60.0, exclusive: bool = True):
        """Send `req` and wait for its answer (the next `reply_type` message).

        exclusive=False: the lock covers the send only, so other control requests go on while this
        one waits (for a reply type only this request produces, e.g. a weight-group join's)."""
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        async with self._control_lock:
            fut = self.loop.create_future()
            self._control_waiters.setdefault(reply_type, []).append(fut)
            await self.send_to_scheduler.send(encode_msg(req))
            if exclusive:
                return await asyncio.wait_for(fut, timeout)
        return await asyncio.wait_for(fut, timeout)

    def stall_s(self) -> tuple[float, int]:
        """(seconds, n): for how long the scheduler has sent nothing while n requests sent to it are unfinished.

        (0, 0) when none are, or while the step gate pauses it on purpose. Anything from the scheduler
        (a token, a control answer) is progress; the clock starts at the later of its last message and
        the oldest unfinished request's send, so an idle engine that receives a request starts at 0.
        """
        if self.scheduler_paused:
            return 0.0, 0
        sent = [s.sent_s for s in self.rid_to_state.values() if s.sent_s and not s.finished]
        if not sent:
            return 0.0, 0
        return time.monotonic() - max(self.last_receive_s, min(sent)), len(sent)

    async def flush_cache(self) -> FlushCacheReqOutput:
        return await self._control(FlushCacheReq(), FlushCacheReqOutput)

    async def get_internal_state(self) -> GetInternalStateReqOutput:
        return await self._control(GetInternalStateReq(), GetInternalStateReqOutput)

    async def step_gate(self, action: str, steps: int = 1) -> StepGateReqOutput:
        out = await self._control(StepGateReq(action=action, steps=steps), StepGateReqOutput, timeout=300)
        self.scheduler_paused = out.paused
        return out

    async def set_trace(self, enabled: bool) -> None:
        await self.send_to_scheduler.send(encode_msg(SetTraceReq(enabled=enabled)))

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> GetWeightsByNameReqOutput:
        return await self._control(
            GetWeightsByNameReq(name=name, truncate_size=truncate_size), GetWeightsByNameReqOutput
        )

    # ==== LoRA adapters ================================================================
    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> LoRAUpdateOutput:
        return await self._control(LoadLoRAAdapterReq(lora_name=lora_name, lora_path=lora_path), LoRAUpdateOutput)

    async def unload_lora_adapter(self, lora_name: str) -> LoRAUpdateOutput:
        return await self._control(UnloadLoRAAdapterReq(lora_name=lora_name), LoRAUpdateOutput)

    # ==== weight updates ===============================================================
    async def update_weights_from_disk(
        self, model_path: str, abort_all_requests: bool = False, flush_cache: bool = True
    ) -> UpdateWeightsReqOutput:
        return await self._update_weights(
            UpdateWeightsFromDiskReq(model_path=model_path, flush_cache=flush_cache), abort_all_requests
        )

    async def update_weights_from_tensor(
        self, req: UpdateWeightsFromTensorReq, abort_all_requests: bool = False
    ) -> UpdateWeightsReqOutput:
        return await self._update_weights(req, abort_all_requests)

    async def update_weights_from_distributed(
        self, req: UpdateWeightsFromDistributedReq, abort_all_requests: bool = False
    ) -> UpdateWeightsReqOutput:
        return await self._update_weights(req, abort_all_requests)

    async def init_weights_update_group(self, req: InitWeightsUpdateGroupReq) -> UpdateWeightsReqOutput:
        # The scheduler joins beside its loop and answers when the group has formed or failed (after up to
        # timeout_s for the store and again for the group's handshake); serving and other control go on.
        async with self._join_lock:
            return await self._control(
                req, InitWeightsUpdateGroupReqOutput, timeout=2 * req.timeout_s + 60, exclusive=False
            )

    async def destroy_weights_update_group(self, group_name: str) -> UpdateWeightsReqOutput:
        return await self._control(DestroyWeightsUpdateGroupReq(group_name=group_name), UpdateWeightsReqOutput)

    async def _update_weights(self, req: Msg, abort_all_requests: bool) -> UpdateWeightsReqOutput:
        """Hold new requests, let the in-flight ones finish (or abort them), then update."""
        async with self._weights_update_lock:
            self._weights_gate.clear()
            try:
                if abort_all_requests and self.rid_to_state:
                    await self.abort_request("")
                await self._wait_inflight_finished()
                return await self._control(req, UpdateWeightsReqOutput, timeout=WEIGHTS_UPDATE_TIMEOUT_S)
            finally:
                self._weights_gate.set()

    async def _wait_inflight_finished(self) -> None:
        # Polled: request states finish from _handle_batch_output, which has no hook to signal us.
        while any(not s.finished for s in self.rid_to_state.values()):
            if self.dead_reason:
                raise EngineDeadError(self.dead_reason)
            await asyncio.sleep(0.005)

    async def _hold_for_weights_update(self) -> None:
        self.num_held_requests += 1
        try:
            await self._weights_gate.wait()
        finally:
            self.num_held_requests -= 1
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)

    # ==== failure =====================================================================
    def fail_all(self, reason: str) -> None:
        """A child died: every waiting request fails now, and new ones are refused."""
        self.dead_reason = reason
        for state in list(self.rid_to_state.values()):
            state.error = reason
            state.event.set()
        for waiters in self._control_waiters.values():
            for fut in waiters:
                if not fut.done():
                    fut.set_exception(EngineDeadError(reason))
            waiters.clear()

    async def close(self) -> None:
        self.handle_loop_task.cancel()
        try:
            await self.handle_loop_task
        except (asyncio.CancelledError, Exception):
            pass
        self.send_to_scheduler.close(0)
        self.recv_from_detokenizer.close(0)
        self.ctx.term()
