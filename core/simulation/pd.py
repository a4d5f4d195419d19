"""Disaggregated prefill/decode (PD) on the simulated clock (issue #38 item 5).

    sim = PDSimulator("llama-3.1-70b", "h100", prefill_replicas=2, decode_replicas=4,
                      prefill_tp_size=8, decode_tp_size=8)
    print(sim.run(poisson_workload(rate=20, n=1000)).summary())

Each replica is the real Scheduler over a `SimWorker`, as in the co-located `Simulator`, with the real
PD pieces composed in: a prefill replica's `PrefillBootstrap` (one token sampled, the prompt's KV put on
its sender) and a decode replica's `DecodeTransferQueue` (prealloc queue reserving a row and slots, the
transfer queue, install into the running batch). Only their transport is simulated: `SimKVLink` hands
out a sender per prefill replica and a receiver per decode replica with KVSender's and KVReceiver's
methods; it carries no tensors and completes a room `bytes / bandwidth + latency` after both sides are
ready (the prefill has put the room, the decode side has reserved and asked), on the simulated clock.

The bytes are the prompt's whole KV (every layer, every KV head, the model's dtype: ModelSpec's
kv_bytes_per_token). Each device of the smaller side has a link of its own (`link_bw`, one direction):
a transfer between TP groups of 8 moves its 8 shards in parallel, at 8 x link_bw. The transfers out of one
prefill replica share its links, one after another (a room starts when the links are free).

A request goes, as behind SGLang's router in PD mode, to one prefill replica and one decode replica at
once (each side's `LoadBalancer` picks), with one bootstrap room (request i: room i, rid "r<i>" on the
decode side, "r<i>.prefill" on the prefill side, as two servers name it each their own way); the client
reads the decode replica's tokens (the prefill's one-token answer is dropped, as the router drops it; it
is still traced, as a prefill server's tokenizer manager traces it). TTFT is then

    prefill wait (trip in, queue) + prefill (its passes, chunks and all) + transfer wait (the prefill
    replica's links busy) + transfer + decode wait (the next poll, the first token out)

and `PDResult.ttft_parts` holds those parts per request; they sum to the TTFT exactly.

Traces: replica k traces as "scheduler.dp<k>" (prefill replicas first, then decode replicas), so the
replica views show every scheduler side by side; `pd.bootstrap`, `pd.reserved` and `pd.transfer` carry
the room and the role (core/trace/pd.py joins them).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from workbench.core.disaggregation.decode import DecodeTransferQueue
from workbench.core.disaggregation.prefill import PrefillBootstrap
from workbench.core.disaggregation.transfer import KVLayout, RoomInUseError, TransferMeta, TransferStatus
from workbench.core.io_struct import BatchTokenIDOut, TokenizedGenerateReqInput
from workbench.core.managers.data_parallel_controller import replica_proc_name
from workbench.core.managers.scheduler_contract import ListIO
from workbench.core.sampling.sampling_params import SamplingParams
from workbench.core.simulation.hardware import get_hardware
from workbench.core.simulation.model_specs import ModelSpec, model_spec
from workbench.core.simulation.sim_worker import SimClock
from workbench.core.simulation.simulator import SimFrontEnd, SimRequest, SimResult, Simulator, request_prompt

INF = float("inf")


def parse_pd(text: str) -> tuple[int, int]:
    """'2P4D' (the xPyD notation of PD deployment write-ups) -> (2, 4)."""
    t = text.strip().upper()
    p, sep, d = t.partition("P")
    if not sep or not d.endswith("D") or not p.isdigit() or not d[:-1].isdigit() or int(p) < 1 or int(d[:-1]) < 1:
        raise ValueError(f"--pd {text!r}: write xPyD, e.g. 1P1D or 2P4D (prefill replicas, then decode replicas)")
    return int(p), int(d[:-1])


@dataclass
class _Room:
    tokens: int = 0
    nbytes: int = 0
    put_at: float | None = None  # the prefill put its KV (after its prefill pass)
    submit_at: float | None = None  # the decode side reserved slots and asked
    start: float | None = None  # the bytes started moving
    done: float | None = None  # ... and arrived
    meta: TransferMeta | None = None
    error: str | None = None
    sender: SimKVSender | None = None
    receiver: SimKVReceiver | None = None
    sender_polled: bool = False
    receiver_polled: bool = False


class SimKVLink:
    """The simulated network between the prefill and decode replicas: rooms in flight, their times."""

    def __init__(self, bytes_per_token: int, link_bw: float, lanes: int, latency_s: float):
        if link_bw <= 0:
            raise ValueError(f"the PD link's bandwidth must be above 0, not {link_bw}")
        self.bytes_per_token = bytes_per_token
        self.lanes = lanes
        self.bw = link_bw * lanes  # bytes/s between a prefill replica and a decode replica
        self.latency_s = latency_s
        self.rooms: dict[int, _Room] = {}
        self.log: dict[int, _Room] = {}  # every room that completed (ttft_parts, tests)

    def transfer_s(self, tokens: int) -> float:
        """Seconds to move `tokens` tokens' KV once the links are free: bytes / bandwidth + latency."""
        return tokens * self.bytes_per_token / self.bw + self.latency_s

    def sender(self, clock: SimClock) -> SimKVSender:
        return SimKVSender(self, clock)

    def receiver(self, clock: SimClock) -> SimKVReceiver:
        return SimKVReceiver(self, clock)

    def _room(self, room: int) -> _Room:
        return self.rooms.setdefault(room, _Room())

    def _ready(self, r: _Room) -> None:
        """Both sides are there: the room's bytes go when the sender's links are free."""
        if r.put_at is None or r.submit_at is None or r.done is not None:
            return
        if r.error is not None:  # failed by the prefill: the decode side hears at once
            r.start = r.done = max(r.put_at, r.submit_at)
            return
        assert r.sender is not None
        r.start = max(r.put_at, r.submit_at, r.sender.links_free)
        r.done = r.start + self.transfer_s(r.tokens)
        r.sender.links_free = r.done - self.latency_s  # the next room's bytes follow these

    def _forget(self, room: int, r: _Room) -> None:
        if r.sender_polled and r.receiver_polled:
            self.rooms.pop(room, None)
            if r.error is None:
                self.log[room] = r

    def next_done(self, side) -> float:
        """When the next room of this sender or receiver completes (inf: none is under way)."""
        key = "sender" if isinstance(side, SimKVSender) else "receiver"
        polled = key + "_polled"
        return min(
            (
                r.done
                for r in self.rooms.values()
                if getattr(r, key) is side and r.done is not None and not getattr(r, polled)
            ),
            default=INF,
        )


def pd_link(
    spec: ModelSpec,
    hw,
    dtype_bytes: int,
    prefill_tp: int,
    decode_tp: int,
    link_gbps: float | None = None,
    link_latency_us: float | None = None,
) -> SimKVLink:
    """The link model between a prefill replica of `prefill_tp` devices and a decode replica of `decode_tp`
    on hardware `hw`: the model's KV bytes per token (every layer, every KV head, `dtype_bytes`), one link
    per device of the smaller side at `link_gbps` gigabits/s (default: the hardware's `pd_link_bw`) and
    `link_latency_us` per transfer (default: `pd_link_latency_s`). Offline (PDSimulator) and live
    (pd_live.py) PD time their transfers with it."""
    bw = hw.pd_link_bw if link_gbps is None else link_gbps * 1e9 / 8
    latency = hw.pd_link_latency_s if link_latency_us is None else link_latency_us * 1e-6
    return SimKVLink(spec.kv_bytes_per_token(dtype_bytes), bw, min(prefill_tp, decode_tp), latency)


class SimKVSender:
    """KVSender's methods (put, fail, poll, pending, close) on the simulated clock of a prefill replica."""

    port = 0  # no socket: what fill_state reports

    def __init__(self, link: SimKVLink, clock: SimClock):
        self.link, self.clock = link, clock
        self.links_free = 0.0

    def put(self, room: int, meta: TransferMeta, k, v) -> None:
        r = self.link._room(room)
        r.put_at, r.meta, r.sender = self.clock.now, meta, self
        self.link._ready(r)

    def fail(self, room: int, message: str) -> None:
        r = self.link._room(room)
        r.put_at, r.error, r.sender = self.clock.now, message, self
        self.link._ready(r)

    def poll(self) -> list[TransferStatus]:
        out = []
        for room, r in list(self.link.rooms.items()):
            if r.sender is self and not r.sender_polled and r.done is not None and r.done <= self.clock.now:
                r.sender_polled = True
                assert r.start is not None and r.put_at is not None
                out.append(_status(room, r, (r.start - r.put_at) * 1000))
                self.link._forget(room, r)
        return out

    def pending(self) -> int:
        return sum(1 for r in self.link.rooms.values() if r.sender is self and not r.sender_polled)

    def close(self) -> None:
        pass


class SimKVReceiver:
    """KVReceiver's methods (submit, cancel, poll, in_flight, close) on a decode replica's simulated clock."""

    def __init__(self, link: SimKVLink, clock: SimClock):
        self.link, self.clock = link, clock

    def submit(self, room: int, host: str, port: int, layout: KVLayout) -> None:
        r = self.link._room(room)
        if r.receiver is not None:
            raise RoomInUseError(f"bootstrap room {room} is already being pulled")
        r.receiver, r.submit_at, r.tokens = self, self.clock.now, layout.num_tokens
        r.nbytes = layout.num_tokens * self.link.bytes_per_token
        self.link._ready(r)

    def cancel(self, room: int) -> None:
        r = self.link.rooms.get(room)
        if r is not None and r.receiver is self:
            r.receiver_polled = True
            self.link._forget(room, r)

    def poll(self) -> list[TransferStatus]:
        out = []
        for room, r in list(self.link.rooms.items()):
            if r.receiver is self and not r.receiver_polled and r.done is not None and r.done <= self.clock.now:
                r.receiver_polled = True
                assert r.start is not None and r.submit_at is not None
                out.append(_status(room, r, (r.start - r.submit_at) * 1000))
                self.link._forget(room, r)
        return out

    def in_flight(self) -> int:
        return sum(1 for r in self.link.rooms.values() if r.receiver is self and not r.receiver_polled)

    def close(self) -> None:
        pass


def _status(room: int, r: _Room, wait_ms: float) -> TransferStatus:
    assert r.start is not None and r.done is not None
    ok = r.error is None
    return TransferStatus(
        room, ok, r.nbytes if ok else 0, (r.done - r.start) * 1000, error=r.error, meta=r.meta, wait_ms=wait_ms
    )


@dataclass
class PDResult(SimResult):
    """SimResult of a PD deployment, with each request's TTFT in parts (seconds)."""

    pd: str = ""  # "2P4D (prefill 2 x tp 8, decode 4 x tp 8), link 400 Gb/s per device"
    ttft_parts: dict[str, dict[str, float]] = field(default_factory=dict)
    transferred_bytes: int = 0

    @property
    def deployment(self) -> str:
        return f"{self.hardware} {self.pd}"

    def summary(self) -> str:
        text = super().summary()
        parts = list(self.ttft_parts.values())
        if parts:
            mean = {k: 1000 * sum(p[k] for p in parts) / len(parts) for k in parts[0]}
            text += "; mean TTFT parts " + ", ".join(f"{k} {v:.1f} ms" for k, v in mean.items())
        return text + f"; {self.transferred_bytes / 1e9:.2f} GB of KV moved"


class _StampedIO(ListIO):
    """ListIO that notes the replica's simulated time of each message it sends: a decode replica streams
    a first token when its KV is installed, before the step's pass, and the client sees it then."""

    def __init__(self, clock: SimClock):
        super().__init__()
        self.clock = clock
        self.stamps: list[float] = []

    def send(self, msg) -> None:
        super().send(msg)
        self.stamps.append(self.clock.now)


class PDSimulator:
    """A PD deployment that is not there: `prefill_replicas` schedulers of `prefill_tp_size` devices and
    `decode_replicas` of `decode_tp_size`, on `hardware`, joined by links of `link_gbps` gigabits/s per
    device (default: the hardware's `pd_link_bw`) and `link_latency_us` per transfer. The rest are
    Simulator's arguments (ServerArgs fields included), the same for both sides."""

    def __init__(
        self,
        model: str | ModelSpec,
        hardware: str,
        prefill_replicas: int = 1,
        decode_replicas: int = 1,
        prefill_tp_size: int = 1,
        decode_tp_size: int = 1,
        link_gbps: float | None = None,
        link_latency_us: float | None = None,
        seed: int = 0,
        trace_sink=None,
        load_balance_method: str = "round_robin",
        **kw,
    ):
        if prefill_replicas < 1 or decode_replicas < 1:
            raise ValueError("a PD deployment needs at least one prefill and one decode replica")
        spec = model if isinstance(model, ModelSpec) else model_spec(model)
        hw = get_hardware(hardware)
        procs = [replica_proc_name(k) for k in range(prefill_replicas + decode_replicas)]

        def side(n, tp, names, offset):
            return Simulator(
                spec,
                hardware,
                tp_size=tp,
                seed=seed + offset,
                trace_sink=trace_sink,
                dp_size=n,
                load_balance_method=load_balance_method,
                replica_procs=names,
                **kw,
            )

        self.prefill = side(prefill_replicas, prefill_tp_size, procs[:prefill_replicas], 0)
        self.decode = side(decode_replicas, decode_tp_size, procs[prefill_replicas:], 104729)
        self.spec, self.hw, self.seed, self.trace_sink = spec, hw, seed, trace_sink
        self.link = pd_link(
            spec, hw, self.prefill.cost.dtype_bytes, prefill_tp_size, decode_tp_size, link_gbps, link_latency_us
        )
        self.link_bw = self.link.bw / self.link.lanes
        for rep in self.prefill.replicas + self.decode.replicas:
            rep.io = rep.scheduler.io = _StampedIO(rep.clock)
        for rep in self.prefill.replicas:
            rep.worker.first_pass = {}  # when each prompt's first pass began (ttft_parts' prefill_wait)
            rep.scheduler.disagg = PrefillBootstrap(rep.scheduler, sender=self.link.sender(rep.clock))
        for rep in self.decode.replicas:
            rep.scheduler.disagg = DecodeTransferQueue(rep.scheduler, receiver=self.link.receiver(rep.clock))
        self.shape = (
            f"{prefill_replicas}P{decode_replicas}D (prefill {prefill_replicas} x tp {prefill_tp_size}, decode "
            f"{decode_replicas} x tp {decode_tp_size}), link {self.link_bw * 8 / 1e9:g} Gb/s per device"
        )
        self.front_end: SimFrontEnd | None = None

    def run(self, workload: list[SimRequest], progress=None) -> PDResult:
        """Run every request to the end; returns the simulated-time metrics and TTFT parts."""
        t0 = time.perf_counter()
        pre, dec = self.prefill, self.decode
        reps = pre.replicas + dec.replicas
        decoders = {id(r) for r in dec.replicas}
        order = sorted(range(len(workload)), key=lambda i: workload[i].arrival)
        front = self.front_end = SimFrontEnd(self.trace_sink, pre.args.trace_token_ids)
        # The prefill servers' own front: the request under its prefill-side rid, answered with one token
        # (traced as a real prefill server's tokenizer manager would; the router drops the answer).
        self.prefill_front = SimFrontEnd(self.trace_sink)
        prefill_res = SimResult(self.hw.name, self.spec.name, pre.tp_size, 0, 0.0, 0.0)
        replayed: set[str] = set()
        res = PDResult(
            self.hw.name,
            self.spec.name,
            pre.tp_size,
            sum(r.runner.max_total_num_tokens for r in reps),
            0.0,
            0.0,
            dp_size=len(reps),
            pd=self.shape,
        )
        at, last = {}, -INF
        for i in order:
            last = at[i] = max(workload[i].arrival + pre.tm_in_s, last + pre.tm_gap_s)
        nxt = sent = 0
        ids: dict[int, list[int]] = {}

        def send_until(t: float) -> None:
            nonlocal sent
            while sent < len(order) and workload[order[sent]].arrival <= t:
                i = order[sent]
                sent += 1
                ids[i] = request_prompt(i, workload[i], self.seed, self.spec.vocab)
                front.send(f"r{i}", workload[i].arrival, ids[i], workload[i].output_len)
                self.prefill_front.send(prefill_rid(i), workload[i].arrival, ids[i], workload[i].output_len)

        def wake(rep) -> float:
            """When this replica has something to do: now with work to run; else when its next transfer ends."""
            s = rep.scheduler
            if rep.io.inbox or s.has_batch_work():
                return rep.clock.now
            side = s.disagg.receiver if id(rep) in decoders else s.disagg.sender
            if (s.disagg.has_pending() or id(rep) not in decoders) and side is not None:
                return max(rep.clock.now, self.link.next_done(side))
            return INF

        while True:
            t_arrival = at[order[nxt]] if nxt < len(order) else INF
            t, rep = min(((wake(r), k) for k, r in enumerate(reps)), default=(INF, -1))
            if t_arrival <= t and nxt < len(order):
                i = order[nxt]
                nxt += 1
                send_until(at[i])
                self._deliver(i, workload[i], ids.pop(i), at[i], res, replayed)
                continue
            if t == INF:
                if any(r.busy() for r in dec.replicas):
                    raise RuntimeError("the PD simulation stalled: decode requests wait for KV that never comes")
                break
            r = reps[rep]
            r.clock.now = t
            send_until(t)
            r.step()
            res.steps += 1
            res.peak_kv_used = max(res.peak_kv_used, sum(x.kv_used() for x in reps))
            side = dec if id(r) in decoders else pre
            io = r.io
            assert isinstance(io, _StampedIO)
            for msg, stamp in zip(io.outbox, io.stamps):
                if not isinstance(msg, BatchTokenIDOut):
                    continue
                if side.balancer is not None:
                    for j, rid in enumerate(msg.rids):
                        side.balancer.on_output(rid, msg.new_token_ids[j], msg.finished_reasons[j] is not None)
                # the client reads the decode side; the router drops the prefill's one token
                (
                    front.take(msg, stamp + pre.tm_out_s, res, replayed)
                    if side is dec
                    else self.prefill_front.take(msg, stamp + pre.tm_out_s, prefill_res, set())
                )
            io.outbox.clear()
            io.stamps.clear()
            if progress is not None and res.steps % 500 == 0:
                progress(len(res.latency), len(workload), r.clock.now)
        res.output_tokens = sum(front.counts.values())
        res.retracted = sum(r.scheduler.num_retracted_total for r in reps)
        res.per_replica_requests = [r.requests for r in reps]
        start = min((r.arrival for r in workload), default=0.0)
        res.sim_s = max(r.clock.now for r in reps) + pre.tm_out_s - start
        res.transferred_bytes = sum(r.nbytes for r in self.link.log.values())
        first_pass: dict[str, float] = {}
        for rep in pre.replicas:
            first_pass.update(rep.worker.first_pass or {})
        for i, r in enumerate(workload):
            room = self.link.log.get(i)
            rid = f"r{i}"
            if room is None or rid not in front.first:
                continue
            assert room.put_at is not None and room.start is not None and room.done is not None
            began = first_pass.get(prefill_rid(i), r.arrival)
            res.ttft_parts[rid] = {
                "prefill_wait": began - r.arrival,
                "prefill": room.put_at - began,
                "transfer_wait": room.start - room.put_at,
                "transfer": room.done - room.start,
                "decode_wait": front.first[rid] - room.done,
            }
        res.wall_s = time.perf_counter() - t0
        return res

    def _deliver(self, i: int, r: SimRequest, ids: list[int], at: float, res: PDResult, replayed: set[str]) -> None:
        """Request i reaches the router at `at`: it goes to a prefill and a decode replica, bootstrap room i."""
        if r.output_ids:
            replayed.add(f"r{i}")
        res.prompt_tokens += len(ids)
        p_rank = 0
        for side in (self.prefill, self.decode):
            rid = prefill_rid(i) if side is self.prefill else f"r{i}"
            rank = side.balancer.choose(rid, ids).dp_rank if side.balancer is not None else 0
            rep = side.replicas[rank]
            rep.clock.now = max(rep.clock.now, at)
            rep.requests += 1
            if side is self.prefill:
                p_rank = rank
            params = SamplingParams(max_new_tokens=r.output_len, temperature=0.0, ignore_eos=True)
            rep.io.inbox.append(
                TokenizedGenerateReqInput(
                    rid=rid,
                    input_text="",
                    input_ids=list(ids),
                    sampling_params=params,
                    forced_output_ids=list(r.output_ids) if r.output_ids else None,
                    bootstrap_host=f"sim-prefill-{p_rank}",
                    bootstrap_port=1,
                    bootstrap_room=i,
                )
            )


def prefill_rid(i: int) -> str:
    """Request i's rid on its prefill replica (each server names a request its own way; the room joins them)."""
    return f"r{i}.prefill"


def pd_ttft_check(res: PDResult) -> float:
    """The largest |sum of a request's TTFT parts - its TTFT| (seconds): 0 up to rounding."""
    return max((abs(sum(p.values()) - res.ttft[rid]) for rid, p in res.ttft_parts.items()), default=math.nan)
