"""DataParallelController: one front end, N scheduler replicas (`--dp-size N`).

With `dp_size > 1` the Engine starts this process plus N ordinary Scheduler processes
(replicas), each with its own model copy, KV pool and radix cache:

    TokenizerManager --PUSH--> controller --PUSH--> scheduler.dp0 ... scheduler.dp{N-1}
                                   ^                      |  (BatchTokenIDOut, control replies)
                                   +------- PULL ---------+
    controller --PUSH--> DetokenizerManager --> TokenizerManager (as with one scheduler)

The controller binds the socket the TokenizerManager already pushes to, so the front end
does not know DP exists. Replicas send their output to the controller (one socket per
replica, so it knows who spoke) and the controller forwards it, untouched, to the one
detokenizer. Seeing every output is how it learns when requests finish: `shortest_queue`
counts in-flight requests per replica from dispatch to finish, exactly.

Control messages: aborts go to the replica that holds the request (all replicas for
"abort everything" or an unknown rid); flush_cache, get_internal_state, step-gate, trace
switches and weight updates go to every replica, and their replies are merged into the
one reply the TokenizerManager waits for (see `merge_replies`).

Load-balance methods (`--load-balance-method`):
  round_robin     replica 0, 1, ..., N-1, 0, ...
  shortest_queue  the replica with the fewest in-flight requests (ties: lowest rank)
  prefix_aware    the replica whose radix cache most likely holds the longest prefix of the
                  prompt (`ApproxPrefixIndex`, a controller-side guess), unless that would
                  unbalance the replicas too much; otherwise shortest_queue.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import zmq
from workbench.core.args import ServerArgs
from workbench.core.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    DestroyWeightsUpdateGroupReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    GetWeightsByNameReq,
    GetWeightsByNameReqOutput,
    InitWeightsUpdateGroupReq,
    InitWeightsUpdateGroupReqOutput,
    Msg,
    SetTraceReq,
    StepGateReq,
    StepGateReqOutput,
    TokenizedGenerateReqInput,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDistributedReq,
    UpdateWeightsFromTensorReq,
    UpdateWeightsReqOutput,
    decode_msg,
)
from workbench.core.ipc import PortArgs, get_zmq_socket, send_msg
from workbench.core.managers.scheduler_contract import Deployment, SchedulerFactory
from workbench.core.trace import clock as trace_clock
from workbench.core.trace import events as ev
from workbench.core.trace.tracer import Tracer

logger = logging.getLogger(__name__)

PROC_NAME = "dp_controller"
PREFIX_BLOCK = 16  # prefix-index granularity in tokens (a cheap page size)
DEFAULT_INDEX_TOKENS = 65536  # per-replica index capacity when --max-total-tokens is unset
# prefix_aware gives up on cache affinity when the chosen replica would carry this many more
# in-flight requests than the least loaded one, and this many times as many.
BALANCE_ABS_THRESHOLD = 4
BALANCE_REL_THRESHOLD = 1.5

# The reply each broadcast control request produces (one per replica, merged into one).
_REPLY_TYPE: dict[type, type] = {
    FlushCacheReq: FlushCacheReqOutput,
    GetInternalStateReq: GetInternalStateReqOutput,
    StepGateReq: StepGateReqOutput,
    GetWeightsByNameReq: GetWeightsByNameReqOutput,
    UpdateWeightsFromDiskReq: UpdateWeightsReqOutput,
    UpdateWeightsFromTensorReq: UpdateWeightsReqOutput,
    UpdateWeightsFromDistributedReq: UpdateWeightsReqOutput,
    InitWeightsUpdateGroupReq: InitWeightsUpdateGroupReqOutput,  # answered when the join ends (weight_sync.py)
    DestroyWeightsUpdateGroupReq: UpdateWeightsReqOutput,
}


def replica_proc_name(dp_rank: int) -> str:
    """The trace `proc` of replica `dp_rank` (what views group by)."""
    return f"scheduler.dp{dp_rank}"


def replica_input_endpoint(port_args: PortArgs, dp_rank: int) -> str:
    return port_args.endpoint(f"scheduler_dp{dp_rank}")


def replica_output_endpoint(port_args: PortArgs, dp_rank: int) -> str:
    return port_args.endpoint(f"dp_out{dp_rank}")


def replica_port_args(port_args: PortArgs, dp_rank: int) -> PortArgs:
    """A replica's view of the sockets: its own input, and output to the controller."""
    return dataclasses.replace(
        port_args,
        scheduler_input_ipc_name=replica_input_endpoint(port_args, dp_rank),
        detokenizer_ipc_name=replica_output_endpoint(port_args, dp_rank),
    )


# ==== choosing a replica ==================================================================


class ApproxPrefixIndex:
    """A cheap guess at which prompt prefixes one replica's radix cache holds.

    Approximate by design: prompts are cut into PREFIX_BLOCK-token blocks and each block
    boundary is remembered by a chained hash of everything before it, so a lookup walks the
    prompt block by block until a boundary is unknown. It is bounded LRU-style by the
    replica's KV capacity and cleared when the caches are flushed, but it does not see the
    replica's own evictions (it may promise a prefix that is gone) nor partial blocks (it
    may under-count by up to a block). Good enough to send shared-prefix requests to the
    same replica, which is all a router needs.
    """

    def __init__(self, capacity_tokens: int, block: int = PREFIX_BLOCK):
        self.block = block
        self.max_keys = max(1, capacity_tokens // block)
        self._keys: OrderedDict[int, None] = OrderedDict()

    def block_keys(self, ids: list[int]) -> list[int]:
        """Chained hashes of the prompt's full blocks (compute once, look up in every replica)."""
        keys, h, b = [], 0, self.block
        for i in range(0, len(ids) - b + 1, b):
            h = hash((h, tuple(ids[i : i + b])))
            keys.append(h)
        return keys

    def match(self, keys: list[int]) -> int:
        """Tokens of the longest prefix this replica probably has cached."""
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            n += 1
        return n * self.block

    def insert(self, keys: list[int]) -> None:
        for k in keys:
            self._keys[k] = None
            self._keys.move_to_end(k)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def clear(self) -> None:
        self._keys.clear()

    def __len__(self) -> int:
        return len(self._keys)


@dataclass
class Decision:
    dp_rank: int
    matched_tokens: int = 0  # prefix_aware: the index's guess for the chosen replica


class LoadBalancer:
    """Chooses a replica per request and keeps the controller's model of each replica's load.

    Pure bookkeeping (no sockets), so every method is testable in-process.
    `load[r]` is the number of requests dispatched to replica r and not yet finished.
    """

    def __init__(self, dp_size: int, method: str, index_capacity_tokens: int = DEFAULT_INDEX_TOKENS):
        if method not in ("round_robin", "shortest_queue", "prefix_aware"):
            raise ValueError(f"unknown load-balance method {method!r}: use round_robin, shortest_queue or prefix_aware")
        self.dp_size = dp_size
        self.method = method
        self.load = [0] * dp_size
        self.dispatched = [0] * dp_size  # requests ever sent to each replica
        self.rid_to_rank: dict[str, int] = {}
        self._rr = 0
        self.indexes = [ApproxPrefixIndex(index_capacity_tokens) for _ in range(dp_size)]
        # prefix_aware learns each finished request's whole sequence (the radix cache keeps
        # prompt + output), so a follow-up turn that extends it finds its replica.
        self._seqs: dict[str, list[int]] = {}

    def choose(self, rid: str, input_ids: list[int]) -> Decision:
        """Pick a replica for a new request and count it as in flight there."""
        if self.method == "round_robin":
            d = Decision(self._rr)
            self._rr = (self._rr + 1) % self.dp_size
        elif self.method == "shortest_queue":
            d = Decision(self._least_loaded())
        else:
            d = self._prefix_aware(input_ids)
        r = d.dp_rank
        self.load[r] += 1
        self.dispatched[r] += 1
        self.rid_to_rank[rid] = r
        if self.method == "prefix_aware":
            self._seqs[rid] = list(input_ids)
        return d

    def _least_loaded(self) -> int:
        return min(range(self.dp_size), key=lambda r: (self.load[r], r))

    def _prefix_aware(self, input_ids: list[int]) -> Decision:
        keys = self.indexes[0].block_keys(input_ids)
        matched = [idx.match(keys) for idx in self.indexes]
        best = max(range(self.dp_size), key=lambda r: (matched[r], -self.load[r], -r))
        least = self._least_loaded()
        lo, hi = self.load[least], self.load[best]
        unbalanced = hi - lo >= BALANCE_ABS_THRESHOLD and hi >= BALANCE_REL_THRESHOLD * max(lo, 1)
        r = best if matched[best] > 0 and not unbalanced else least
        self.indexes[r].insert(keys)
        return Decision(r, matched[r])

    def on_output(self, rid: str, new_token_ids: list[int], finished: bool) -> None:
        """A replica's output for `rid`: follow its sequence; a finish ends it in flight."""
        seq = self._seqs.get(rid)
        if seq is not None:
            seq.extend(new_token_ids)
        if not finished:
            return
        r = self.rid_to_rank.pop(rid, None)
        if r is None:
            return
        self.load[r] = max(0, self.load[r] - 1)
        seq = self._seqs.pop(rid, None)
        if seq is not None:
            index = self.indexes[r]
            index.insert(index.block_keys(seq))

    def rank_of(self, rid: str) -> int | None:
        return self.rid_to_rank.get(rid)

    def clear_prefix_indexes(self) -> None:
        for idx in self.indexes:
            idx.clear()


# ==== merging control replies ================================================================


def merge_replies(replies: list[Msg]) -> Msg:
    """One reply from the N replicas' replies (in rank order) to a broadcast control request."""
    first = replies[0]
    if isinstance(first, FlushCacheReqOutput):
        flushed = _all_of_kind(replies, FlushCacheReqOutput)
        ok = all(r.success for r in flushed)
        failed = [i for i, r in enumerate(flushed) if not r.success]
        return FlushCacheReqOutput(success=ok, message="" if ok else f"replicas {failed} were busy")
    if isinstance(first, GetInternalStateReqOutput):
        return _merge_internal_state(_all_of_kind(replies, GetInternalStateReqOutput))
    if isinstance(first, StepGateReqOutput):
        gates = _all_of_kind(replies, StepGateReqOutput)
        return StepGateReqOutput(paused=all(r.paused for r in gates), step=max(r.step for r in gates))
    if isinstance(first, UpdateWeightsReqOutput):
        updates = _all_of_kind(replies, UpdateWeightsReqOutput)
        ok = all(r.success for r in updates)
        message = (
            first.message if ok else "; ".join(f"dp{i}: {r.message}" for i, r in enumerate(updates) if not r.success)
        )
        # type(first): a join's answer keeps its own type (the TokenizerManager waits for that type).
        return type(first)(success=ok, message=message, version=max(r.version for r in updates))
    if isinstance(first, GetWeightsByNameReqOutput):
        # Every replica should hold the same weights; if not (a half-applied update), say so.
        if any(r.values != first.values for r in _all_of_kind(replies, GetWeightsByNameReqOutput)[1:]):
            return GetWeightsByNameReqOutput(
                values=None,
                message=(
                    "the data-parallel replicas hold different values for this weight (a weight update reached "
                    "only some of them); update the weights again"
                ),
            )
        return first
    return first  # a reply type newer than this controller: replica 0 speaks for all


_Reply = TypeVar("_Reply", bound=Msg)


def _all_of_kind(replies: list[Msg], kind: type[_Reply]) -> list[_Reply]:
    """The replies typed as `kind`: every replica answers a broadcast request with the same reply
    type, so one of another type is a bug worth a loud error rather than a wrong merge."""
    typed = [r for r in replies if isinstance(r, kind)]
    if len(typed) != len(replies):
        raise TypeError(f"replicas answered with {[type(r).__name__ for r in replies]}, expected {kind.__name__}")
    return typed


_SUMMED = (
    "num_waiting",
    "num_running",
    "kv_total",
    "kv_free",
    "kv_evictable",
    "kv_used",
    "req_slots_free",
    "req_slots_total",
    "max_total_num_tokens",
    "max_running_requests",
    "last_gen_throughput",
    "trace_ms",
    "spec_verified",
    "spec_proposed",
    "spec_accepted",
    "retracted_total",
    "received_total",
)


def _merge_internal_state(replies: list[GetInternalStateReqOutput]) -> GetInternalStateReqOutput:
    # Counts and capacities add up over replicas (so a leak check on the sums checks every
    # replica); max_req_input_len is per request, so the smallest; per_replica keeps detail.
    merged = {name: sum(getattr(r, name) for r in replies) for name in _SUMMED}
    return GetInternalStateReqOutput(
        **merged,
        step=max(r.step for r in replies),
        kv_used_peak=max(r.kv_used_peak for r in replies),  # kept on a shared clock: each reports the whole
        max_req_input_len=min(r.max_req_input_len for r in replies),
        kv_check_error="; ".join(f"dp{i}: {r.kv_check_error}" for i, r in enumerate(replies) if r.kv_check_error),
        per_replica=[{name: getattr(r, name) for name in _SUMMED + ("step",)} for r in replies],
        hicache=_merge_hicache([r.hicache for r in replies]),
    )


def _merge_hicache(states: list[dict[str, int | float] | None]) -> dict[str, int | float] | None:
    """HiCache's counters over replicas: summed (bytes_per_token is the same on each: kept)."""
    given = [s for s in states if s]
    if not given:
        return None
    return {k: given[0][k] if k == "bytes_per_token" else sum(s.get(k, 0) for s in given) for k in given[0]}


@dataclass
class _PendingReply:
    reply_type: type
    replies: dict[int, Msg] = field(default_factory=dict)


# ==== the process ================================================================================


class DataParallelController:
    """Dispatches tokenized requests to N replicas and funnels their output to the detokenizer."""

    def __init__(self, server_args: ServerArgs, port_args: PortArgs):
        self.server_args = server_args
        self.dp_size = server_args.dp_size
        self.tp_size = server_args.tp_size
        capacity = server_args.max_total_tokens or DEFAULT_INDEX_TOKENS
        self.balancer = LoadBalancer(self.dp_size, server_args.load_balance_method, capacity)
        self.tracer = Tracer(PROC_NAME, endpoint=port_args.trace_ipc_name)
        self.ctx = zmq.Context(1)
        self.recv_from_tokenizer = get_zmq_socket(self.ctx, zmq.PULL, port_args.scheduler_input_ipc_name, bind=True)
        self.send_to_detokenizer = get_zmq_socket(self.ctx, zmq.PUSH, port_args.detokenizer_ipc_name, bind=False)
        self.send_to_replica = [
            get_zmq_socket(self.ctx, zmq.PUSH, replica_input_endpoint(port_args, r), bind=False)
            for r in range(self.dp_size)
        ]
        self.recv_from_replica = [
            get_zmq_socket(self.ctx, zmq.PULL, replica_output_endpoint(port_args, r), bind=True)
            for r in range(self.dp_size)
        ]
        self.poller = zmq.Poller()
        self.poller.register(self.recv_from_tokenizer, zmq.POLLIN)
        self._sock_rank: dict[zmq.Socket, int] = {}
        for r, sock in enumerate(self.recv_from_replica):
            self.poller.register(sock, zmq.POLLIN)
            self._sock_rank[sock] = r
        # Broadcast control requests awaiting replies, oldest first. Each replica answers its
        # requests in order, so a reply belongs to the oldest entry of its type it has not answered.
        self.pending: list[_PendingReply] = []
        self.outputs_seen = [0] * self.dp_size  # token outputs received from each replica
        # A clock the replicas share publishes the token outputs each has sent (SharedClock.outputs_of).
        clock = trace_clock.current()
        self.replica_clock = clock if getattr(clock, "replicas", 1) > 1 else None

    # ---- the loop --------------------------------------------------------------------------
    def event_loop(self, parent_alive: Callable[[], bool] = lambda: True) -> None:
        while True:
            events = dict(self.poller.poll(1000))
            if not events:
                if not parent_alive():
                    return
                continue
            # Outputs first: finishes lower the load counts before the next dispatch decision.
            for sock, r in self._sock_rank.items():
                if sock in events:
                    self._drain(sock, functools.partial(self.handle_replica_output, r))
            if self.recv_from_tokenizer in events:
                self._drain(self.recv_from_tokenizer, self.handle_tokenizer_message)
            if self.tracer.enabled:
                self.tracer.flush()

    @staticmethod
    def _drain(sock: zmq.Socket, handle: Callable[[bytes], None]) -> None:
        while True:
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            handle(data)

    # ---- from the tokenizer manager -----------------------------------------------------------
    def handle_tokenizer_message(self, data: bytes) -> None:
        try:
            msg = decode_msg(data)
        except Exception:  # malformed frames are skipped, as the scheduler does; msgpack runs no code
            logger.warning("dp controller: dropped an undecodable message")
            return
        if isinstance(msg, TokenizedGenerateReqInput):
            self.dispatch(msg, data)
        elif isinstance(msg, AbortReq):
            r = self.balancer.rank_of(msg.rid) if msg.rid else None
            targets = [r] if r is not None else range(self.dp_size)
            for t in targets:
                self.send_to_replica[t].send(data, copy=False)
        elif isinstance(msg, SetTraceReq):
            self.tracer.set_enabled(msg.enabled)
            self._broadcast(data)
        elif isinstance(msg, InitWeightsUpdateGroupReq):
            # Each replica's TP ranks take their own ranks in the trainer's group.
            self.pending.append(_PendingReply(InitWeightsUpdateGroupReqOutput))
            for r, sock in enumerate(self.send_to_replica):
                send_msg(sock, msgspec.structs.replace(msg, rank_offset=msg.rank_offset + r * self.tp_size))
        elif type(msg) in _REPLY_TYPE:
            if isinstance(
                msg,
                (FlushCacheReq, UpdateWeightsFromDiskReq, UpdateWeightsFromTensorReq, UpdateWeightsFromDistributedReq),
            ):
                # Replicas reset their caches (weight updates flush too): forget what they held.
                # A refused flush leaves them full; the index then under-promises, which is harmless.
                self.balancer.clear_prefix_indexes()
            self.pending.append(_PendingReply(_REPLY_TYPE[type(msg)]))
            self._broadcast(data)
        else:
            # A message this controller does not know (newer than it): every replica gets it,
            # and replies are forwarded unmerged.
            self._broadcast(data)

    def dispatch(self, req: TokenizedGenerateReqInput, data: bytes) -> None:
        if self.replica_clock is not None:
            self._catch_up(self.replica_clock)
        d = self.balancer.choose(req.rid, req.input_ids)
        self.send_to_replica[d.dp_rank].send(data, copy=False)
        if self.tracer.enabled:
            self.tracer.emit(
                ev.ReqDispatched(
                    rid=req.rid,
                    dp_rank=d.dp_rank,
                    method=self.balancer.method,
                    matched_tokens=d.matched_tokens,
                    loads=list(self.balancer.load),
                )
            )

    def _catch_up(self, clock) -> None:
        """On a clock the replicas share: take in every output their finished passes sent before routing,
        so the load counts are those of the clock's moment, not of this host's socket timing (each
        pass's outputs are seen as it ends). Gives up after a wall second."""
        deadline = time.monotonic() + 1.0
        for r, sock in enumerate(self.recv_from_replica):
            while time.monotonic() < deadline:
                sent = clock.outputs_of(r)
                if sent is not None and self.outputs_seen[r] >= sent:
                    break
                if sock.poll(1):
                    self._drain(sock, functools.partial(self.handle_replica_output, r))

    def _broadcast(self, data: bytes) -> None:
        for sock in self.send_to_replica:
            sock.send(data, copy=False)

    # ---- from the replicas ----------------------------------------------------------------------
    def handle_replica_output(self, rank: int, data: bytes) -> None:
        try:
            msg = decode_msg(data)
        except Exception:
            logger.warning("dp controller: dropped an undecodable message from replica %d", rank)
            return
        if isinstance(msg, BatchTokenIDOut):
            self.outputs_seen[rank] += 1
            for rid, new_ids, reason in zip(msg.rids, msg.new_token_ids, msg.finished_reasons):
                self.balancer.on_output(rid, new_ids, reason is not None)
            self.send_to_detokenizer.send(data, copy=False)
            return
        entry = next((p for p in self.pending if p.reply_type is type(msg) and rank not in p.replies), None)
        if entry is None:
            self.send_to_detokenizer.send(data, copy=False)
            return
        entry.replies[rank] = msg
        if len(entry.replies) == self.dp_size:
            self.pending.remove(entry)
            send_msg(self.send_to_detokenizer, merge_replies([entry.replies[r] for r in range(self.dp_size)]))

    def close(self) -> None:
        self.tracer.close()
        for sock in (
            self.recv_from_tokenizer,
            self.send_to_detokenizer,
            *self.send_to_replica,
            *self.recv_from_replica,
        ):
            sock.close(linger=0)
        self.ctx.term()


# ==== launching ================================================================================


def replica_role(dp_rank: int) -> str:
    """The Engine's role name for a replica process. Replica 0 is "scheduler", so the Engine reads
    the model's limits from it (every replica has the same ones)."""
    return "scheduler" if dp_rank == 0 else f"scheduler-dp{dp_rank}"


def launch_data_parallel(
    ctx,
    server_args: ServerArgs,
    port_args: PortArgs,
    procs: dict,
    readers: dict,
    deployment: Deployment | None = None,
) -> None:
    """Start the controller and the N replicas; fills the Engine's `procs` and `readers` by role.

    Every process reports ready through its pipe, as a lone scheduler does. Each replica gets an
    equal share of the CPU threads unless --num-threads says otherwise. `deployment` says how a
    replica's scheduler is made (None: the real one).
    """
    deployment = deployment if deployment is not None else Deployment()
    dp = server_args.dp_size
    if server_args.tp_size > 1 and not deployment.one_process_per_replica:
        raise ValueError("--dp-size > 1 together with --tp-size > 1 is not supported yet: use one of them")
    if server_args.nnodes > 1:
        raise ValueError("--dp-size > 1 across several nodes (--nnodes > 1) is not supported yet")
    threads = server_args.num_threads or max(1, (os.cpu_count() or 1) // dp)
    replica_args = dataclasses.replace(server_args, num_threads=threads)
    factory = deployment.scheduler_factory
    # (role, process target, its leading arguments, its keyword arguments)
    specs: list[tuple[str, Callable[..., None], tuple[Any, ...], dict[str, Any]]]
    specs = [(PROC_NAME, run_data_parallel_controller_process, (server_args, port_args), {})]
    specs += [
        (replica_role(r), run_dp_scheduler_process, (replica_args, port_args, r), {"scheduler_factory": factory})
        for r in range(dp)
    ]
    for role, target, args, kwargs in specs:
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=target, args=(*args, writer), kwargs=kwargs, name=f"workbench-{role}", daemon=True)
        proc.start()
        writer.close()
        procs[role] = proc
        readers[role] = reader


def run_dp_scheduler_process(
    server_args: ServerArgs,
    port_args: PortArgs,
    dp_rank: int,
    pipe_writer,
    scheduler_factory: SchedulerFactory | None = None,
) -> None:
    """Spawn target of replica `dp_rank`: an ordinary Scheduler on the replica's sockets."""
    from workbench.core.managers.scheduler import run_scheduler_process

    run_scheduler_process(
        server_args,
        replica_port_args(port_args, dp_rank),
        pipe_writer,
        proc_name=replica_proc_name(dp_rank),
        dp_rank=dp_rank,
        scheduler_factory=scheduler_factory,
    )


def run_data_parallel_controller_process(server_args: ServerArgs, port_args: PortArgs, pipe_writer) -> None:
    """Spawn target: bind the sockets, report ready, dispatch until SIGTERM or the parent dies."""
    from workbench.core.managers.detokenizer_manager import parent_watch

    parent_alive = parent_watch()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    signal.signal(signal.SIGTERM, _raise_system_exit)
    trace_clock.attach(port_args.extra.get(trace_clock.SHARED_CLOCK_KEY))  # the engine's clock, if it shares one
    controller = None
    try:
        try:
            controller = DataParallelController(server_args, port_args)
        except Exception as exc:
            pipe_writer.send({"status": "error", "role": PROC_NAME, "error": f"{type(exc).__name__}: {exc}"})
            raise SystemExit(1)
        controller.tracer.set_enabled(True)
        controller.tracer.emit(ev.ProcStarted(pid=os.getpid(), role=PROC_NAME, ts=trace_clock.now_ns()))
        controller.tracer.flush()
        controller.tracer.set_enabled(False)
        pipe_writer.send({"status": "ready", "role": PROC_NAME, "pid": os.getpid()})
        controller.event_loop(parent_alive)
    finally:
        if controller is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            controller.close()


def _raise_system_exit(signum, frame):
    raise SystemExit(0)
