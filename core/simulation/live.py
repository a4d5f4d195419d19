"""A deployment that is not there, served live (issue #19):

    workbench serve --simulate h100 --model llama-3.1-70b --tp-size 8 [--sim-speed 10]
    workbench tui --simulate h100 --model llama-3.1-70b --tp-size 8 [--sim-speed 10]
    workbench sim run --live --simulate h100 --model llama-3.1-70b --tp-size 8 --rate 20
    Engine(simulate="h100", model_path="llama-3.1-70b", tp_size=8, sim_speed=0)

The tokenizer manager, the scheduler process and the detokenizer are the real ones, joined by ZMQ as
always, so the TUI, the Dashboard, the recorder, /metrics and the HTTP API work unchanged. The
deployment is a `Deployment` (scheduler_contract.py) whose scheduler factory (`scheduler_parts`)
hands the real Scheduler other collaborators: a worker that computes nothing and samples its tokens
from a seeded generator (`WarpSimWorker`) and a step clock that keeps simulated time (`LiveSimClock`);
every process stamps with that one clock (trace/clock.py `SharedClock`):

- the clock stands still while the scheduler works and moves by each pass's predicted duration
  (`CostModel`, which counts the deployment's per-pass host overhead), so a request's TTFT is the
  deployment's, whatever this host's Python costs;
- with `--sim-speed X` a pass also takes 1/X of its duration on the wall clock, and idle time runs X
  times faster: the deployment plays X times faster than real time (1: real time, the default);
- with `--sim-speed 0` passes take only what this host needs, and a driver that announces its next
  arrival (`replay`, `workbench sim run --live`) has the idle gaps skipped: a whole workload runs
  through the real pipeline as fast as this host can, stamped in simulated time;
- the scheduler does not start a pass while a request the tokenizer manager sent has not reached it
  or an announced arrival is due, so arrivals land between the same passes as in `Simulator.run`,
  which steps the same Scheduler offline (the two agree request by request: tests).

The weights are not there, so neither is the simulated model's tokenizer: the default model's stands
in (prompts are tokenized with it, and the sampled ids are drawn from its vocabulary so the text
decodes); a prompt's length and cost are what the cost model sees. Every view carries a
`SIMULATED h100x8` badge (`badge`), as does the trace's header and each /metrics series. Without
--model the default model is simulated, by its spec (`DEFAULT_MODEL`), as a real engine serves it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import time

from workbench.core.args import ServerArgs
from workbench.core.io_struct import BatchTokenIDOut, GetInternalStateReqOutput, TokenizedGenerateReqInput
from workbench.core.ipc import PortArgs
from workbench.core.managers.schedule_batch import ModelWorkerBatch, ScheduleBatch
from workbench.core.managers.scheduler import ZmqSchedulerIO, load_fast_tokenizer
from workbench.core.managers.scheduler_contract import (
    Deployment,
    GenerationBatchResult,
    SchedulerIO,
    SchedulerParts,
    SchedulerState,
)
from workbench.core.managers.tokenizer_manager import GenerateReqInput
from workbench.core.sampling.sampling_params import SamplingParams
from workbench.core.simulation import calibration as calibrations
from workbench.core.simulation.cost_model import CostModel
from workbench.core.simulation.hardware import HARDWARE, get_hardware
from workbench.core.simulation.model_specs import model_spec
from workbench.core.simulation.sim_worker import SimClock, SimWorker, make_drafter, sim_runner
from workbench.core.simulation.simulator import SimRequest, SimResult, default_dtype_bytes, request_prompt
from workbench.core.trace import clock as trace_clock

# What `--simulate` serves without --model: the default model (SmolLM2-135M-Instruct), by its spec.
DEFAULT_MODEL = "smollm2-135m"


def deployment(server_args: ServerArgs) -> str:
    """'h100x8': the simulated hardware and how many devices serve the model (all replicas')."""
    return f"{server_args.simulate}x{server_args.tp_size * server_args.dp_size}"


def badge(server_args: ServerArgs) -> str:
    """What every view and the trace's header say of a simulated engine ('' for a real one)."""
    if not server_args.simulate:
        return ""
    dp = f" (dp {server_args.dp_size} x tp {server_args.tp_size})" if server_args.dp_size > 1 else ""
    return f"SIMULATED {deployment(server_args)}{dp}"


def simulated_deployment(sa: ServerArgs) -> tuple[ServerArgs, Deployment]:
    """`--simulate HARDWARE` as the engine serves it: the arguments sized (`sized_args`) and the
    Deployment: one scheduler process per replica made by `scheduler_parts`, no weights, one clock
    shared by the processes, the badge on every view and the hardware on every /metrics series."""
    sa = sized_args(sa)
    return sa, Deployment(
        scheduler_factory=scheduler_parts,
        loads_weights=False,
        one_process_per_replica=True,
        shared_clock=True,
        badge=badge(sa),
        metric_labels=(("simulated", deployment(sa)),),
    )


def _cost_model(sa: ServerArgs) -> CostModel:
    assert sa.model_path and sa.simulate, "sized_args checked both"
    spec = model_spec(sa.model_path, revision=sa.revision, download_dir=sa.download_dir)  # a Hub id: its config
    hw = get_hardware(sa.simulate)
    calibration = (
        calibrations.auto(hw.name, spec.name).calibration if sa.tp_size == 1 else None
    )  # as Simulator's "auto"
    return CostModel(spec, hw, sa.tp_size, default_dtype_bytes(calibration, hw.name), 1.0, calibration)


def _draft_cost(sa: ServerArgs, target: CostModel) -> CostModel | None:
    """STANDALONE: the draft model's cost (a known model or a config.json), on the target's devices."""
    if sa.speculative_algorithm != "STANDALONE" or not sa.speculative_draft_model_path:
        return None
    draft = model_spec(sa.speculative_draft_model_path, download_dir=sa.download_dir)
    return CostModel(draft, target.hw, sa.tp_size, target.dtype_bytes, 1.0, None)


def sized_args(sa: ServerArgs) -> ServerArgs:
    """The simulated engine's arguments: checked, and the pool and batch limits sized as the real
    runner would size them on that hardware (only where the user left them out)."""
    if sa.simulate not in HARDWARE:
        raise ValueError(f"--simulate must be one of {', '.join(sorted(HARDWARE))}, not {sa.simulate!r}")
    if not sa.model_path:  # the default model, as a real engine takes it: its spec (no weights to load)
        sa = dataclasses.replace(sa, model_path=DEFAULT_MODEL)
    unsupported = {
        "--nnodes": sa.nnodes > 1,  # a simulated deployment's devices are the cost model's: one host runs it
        "--enable-torch-compile": sa.enable_torch_compile,
    }
    given = [flag for flag, on in unsupported.items() if on]
    if given:
        raise ValueError(
            f"a live simulated engine does not run {', '.join(given)} (one host runs the simulated devices; "
            "`workbench sim run` simulates the same deployment offline)"
        )
    if sa.speculative_algorithm and sa.speculative_accept_rate is None:
        raise ValueError(
            "a simulated engine's draft tokens are not computed: give --speculative-accept-rate, the chance "
            "the target agrees with each draft (e.g. 0.7)"
        )
    cost = _cost_model(sa)  # raises with what to change when the model does not fit
    gpu = sa.simulate != "cpu-here"
    return dataclasses.replace(
        sa,
        max_total_tokens=sa.max_total_tokens or cost.kv_pool_tokens(draft=_draft_cost(sa, cost)),
        chunked_prefill_size=sa.chunked_prefill_size
        if sa.chunked_prefill_size is not None
        else (8192 if gpu else 2048),
        max_running_requests=sa.max_running_requests if sa.max_running_requests != 128 or not gpu else 256,
        disable_overlap_schedule=sa.disable_overlap_schedule is not False,  # the normal loop unless asked
        num_threads=1,  # nothing to compute: one thread, the cores stay with the views
    )


# Wall seconds a scheduler waits for an announced arrival whose driver is alive before going on. A
# driver withdraws its announcement when it stops (even on an error), so this bounds only a hung
# one; on a loaded 2-core host a live driver's request can take over a second to come through its
# tokenizer manager and the DP controller, and giving up then changes the deployment's schedule.
ANNOUNCE_WAIT_S = 30.0
logger = logging.getLogger(__name__)


class WarpSimWorker(SimWorker):
    """`SimWorker` on the shared simulated clock: a pass moves the clock by its predicted duration
    when it ends; at a speed X > 0 it first lasts 1/X of that on the wall clock (counted from the
    end of the pass before, so the scheduler's own work fits inside, as a real host's does)."""

    def __init__(self, *args, shared: trace_clock.SharedClock, speed: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.shared, self.speed = shared, speed
        self.pace_from = time.monotonic()  # wall time the next pass's duration counts from

    def forward_batch(self, mwb: ModelWorkerBatch):
        cost, out = self.compute(mwb)
        self._last_ms = cost.total * 1000
        if self.speed > 0:
            due = self.pace_from + cost.total / self.speed
            rest = due - time.monotonic()
            if rest > 0:
                time.sleep(rest)
            self.pace_from = max(due, time.monotonic() - 0.001)  # behind: catch up by at most 1 ms
        self.shared.advance(round(cost.total * 1e9))
        return out


class ReplicaSimWorker(WarpSimWorker):
    """One data-parallel replica's worker: a pass moves the replica's own time (the shared time follows
    the replica furthest behind: trace/clock.py). At a speed X > 0 a pass ends on the wall clock when the
    deployment's one mapping of simulated to wall time says, so two replicas' overlapping passes take
    their time once between them, not once each."""

    def __init__(self, *args, dp_rank: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.dp_rank = dp_rank

    def forward_batch(self, mwb: ModelWorkerBatch):
        cost, out = self.compute(mwb)
        self._last_ms = cost.total * 1000
        _replica_move(self.shared, self.dp_rank, round(cost.total * 1e9), self.speed)
        return out


def _replica_move(shared: trace_clock.SharedClock, rank: int, ns: int, speed: float) -> int:
    """Replica `rank`'s time moves on by `ns`; at a speed > 0, once the deployment's wall pacing says the
    new time is due (behind: catch up by at most 1 ms). Returns the replica's new time."""
    if speed > 0:
        end = shared.replica_now(rank) + ns
        rest = shared.pace_deadline(end, speed) - time.monotonic()
        if rest > 0:
            time.sleep(rest)
        elif rest < -0.001:
            shared.repace(end, time.monotonic() - 0.001)
    return shared.replica_advance(rank, ns)


class LiveSimOverlapClient:
    """The overlap loop's worker client for a live simulated deployment: `SimOverlapClient`'s two
    timelines with the host's on the shared clock. A launch moves the host by the pass's fixed overhead
    and queues the pass on the device (free again at `device_free`); resolving a launch moves the host to
    the end of that pass. At a speed X > 0 each move also takes 1/X of it on the wall clock. A data-parallel
    replica's host timeline is its own time (`dp_rank`; trace/clock.py)."""

    def __init__(self, worker: WarpSimWorker, dp_rank: int | None = None):
        self.worker, self.shared, self.speed = worker, worker.shared, worker.speed
        self.dp_rank = dp_rank
        self.device_free = 0
        self.num_threads = 1

    def _now(self) -> int:
        return self.shared.now_ns() if self.dp_rank is None else self.shared.replica_now(self.dp_rank)

    def _move(self, ns: int) -> int:
        """The host timeline moves on by `ns` (paced at the speed); returns the new time."""
        if self.dp_rank is not None:
            return _replica_move(self.shared, self.dp_rank, ns, self.speed)
        if self.speed > 0 and ns > 0:
            time.sleep(ns / 1e9 / self.speed)
        return self.shared.advance(ns)

    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> tuple[list[int], tuple[int, GenerationBatchResult]]:
        cost, out = self.worker.compute(mwb)
        host = self._move(round(cost.overhead * 1e9))
        start = max(host, self.device_free)
        self.device_free = start + round((cost.total - cost.overhead) * 1e9)
        ids = out.sampler_output.next_token_ids.tolist()
        result = GenerationBatchResult(out.logits_output, out.sampler_output, ids, cost.total * 1000, None)
        return [-(i + 1) for i in range(len(mwb.seq_lens_cpu))], (self.device_free, result)

    def resolve_batch_result(self, handle: tuple[int, GenerationBatchResult]) -> GenerationBatchResult:
        end, result = handle
        self._move(max(0, end - self._now()))
        return result

    def shutdown(self) -> None:
        pass


class LiveSimClock:
    """The StepClock (scheduler_contract.py) of a live simulated deployment: the Scheduler is the real
    one; this keeps the simulated clock at the top of its loop.

    Working, it holds the clock and does not start a pass while a request the tokenizer manager sent
    is still on its way or an announced arrival is due (it waits for them on the socket). Idle, it
    lets the clock run at the speed, or, at speed 0 with an arrival announced, jumps it there. It
    keeps the deployment's peak KV use and counts the requests received (get_internal_state).

    `follow_wall` (a PD server: pd_live.py): idle, the clock first catches up with the line every such
    server follows, `speed x this host's monotonic time`, so PD servers that fell behind the wall while
    working (this host slower than the passes) agree on time again whenever they idle."""

    def __init__(self, shared: trace_clock.SharedClock, speed: float, worker: WarpSimWorker, follow_wall: bool = False):
        self.shared, self.speed, self.worker = shared, speed, worker
        self.follow_wall = follow_wall and speed > 0
        self.received = 0  # generate requests that reached this scheduler (the clock counts those sent)
        self._idle = True
        self.kv_used_peak = 0
        self._waiting_for, self._given_up = (0, 0.0), 0  # the announced arrival waited for, and since when

    def after_step(self, scheduler: SchedulerState, batch: ScheduleBatch | None) -> None:
        if batch is not None:
            self._note_kv(scheduler.kv_used())

    def _note_kv(self, used: int) -> None:
        self.kv_used_peak = max(self.kv_used_peak, used)

    def fill_state(self, state: GetInternalStateReqOutput) -> None:
        state.kv_used_peak, state.received_total = self.kv_used_peak, self.received
        if state.hicache is not None:  # the time the passes were charged for HiCache copies (replay's summary)
            state.hicache["charged_s"] = self.worker.hicache_s

    def _take(self, msgs: list) -> list:
        self.received += sum(isinstance(m, TokenizedGenerateReqInput) for m in msgs)
        return msgs

    def recv(self, scheduler: SchedulerState) -> list:
        s, clock = scheduler, self.shared
        msgs = self._take(s.io.recv(0))
        while True:
            arriving = any(isinstance(m, TokenizedGenerateReqInput) for m in msgs)
            stepping = not (s.paused and s.step_credits == 0)
            due, on_way = clock.announced(), self.received < clock.sent()
            # PD transfers in flight with no pass to run (has_work, not has_batch_work): time passes as when
            # idle, and the loop looks every millisecond, so a transfer is installed when the clock says
            if not stepping or not (arriving or s.has_batch_work()):
                s.tracer.flush()
                self._idle = True
                wait_ms = self._let_time_pass(stepping, on_way, due, self.received)
                if stepping and s.has_work():
                    wait_ms = 1
                if msgs:
                    return msgs
                msgs = self._take(s.io.recv(wait_ms))
                if not any(isinstance(m, TokenizedGenerateReqInput) for m in msgs):
                    return msgs
                continue  # a request came: hold the clock and check the gate before it is scheduled
            if self._idle:  # work begins: the next pass's wall time counts from here
                self._idle = False
                self.worker.pace_from = time.monotonic()
            now = clock.hold()
            if on_way or (due is not None and due <= now and not self._gave_up_on(due)):
                msgs += self._take(s.io.recv(1))
                continue
            return msgs

    def _let_time_pass(self, stepping: bool, on_way: bool, due: int | None, received: int) -> int:
        """The deployment is idle: hold, skip or run the clock; returns how long to wait for a message (ms)."""
        clock = self.shared
        if not stepping or on_way:  # paused by a view, or a request on its way: time waits
            clock.hold()
            return 50 if not stepping else 1
        if due is not None and (self.speed == 0 or due <= clock.now_ns()) and not self._gave_up_on(due):
            clock.jump_to(due)  # nothing runs until then: skip the gap; the driver sends now
            return 1
        # time flows, and stops at an announced arrival until the request is in
        due = None if due is not None and due <= clock.now_ns() else due  # given up on
        if self.follow_wall and due is None:
            line = int(time.monotonic_ns() * self.speed)
            if clock.now_ns() < line:
                clock.jump_to(line)  # idle: nothing happens in the gap, so the clock may catch up
        clock.run(self.speed or 1.0, until=due, received=received)
        left_ms = 50 if due is None else (due - clock.now_ns()) / 1e6 / (self.speed or 1.0)
        return max(1, min(50, math.ceil(left_ms)))

    def _gave_up_on(self, due: int) -> bool:
        """Whether the announced arrival `due` will not come: its driver's process is gone, or it was
        waited for ANNOUNCE_WAIT_S of wall time in vain (a driver that announced and then died or hung
        must not freeze the deployment)."""
        if self._waiting_for[0] != due:
            self._waiting_for = (due, time.monotonic())
        dead = not _alive(self.shared.announcer())
        late = dead or time.monotonic() - self._waiting_for[1] > ANNOUNCE_WAIT_S
        if late and self._waiting_for[0] != self._given_up:
            self._given_up = due
            why = "its driver's process is gone" if dead else f"it did not come within {ANNOUNCE_WAIT_S:.0f} s"
            logger.warning("an announced arrival was given up (%s); the deployment goes on", why)
        return late


def _alive(pid: int) -> bool:
    """Whether process `pid` exists (0, no announcer recorded, counts as alive)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _CountingIO:
    """A replica's scheduler I/O, counting the token outputs it sends (`SharedClock.outputs_sent`)."""

    def __init__(self, io: SchedulerIO):
        self.inner, self.outputs = io, 0

    def recv(self, timeout_ms: int = 0) -> list:
        return self.inner.recv(timeout_ms)

    def send(self, msg) -> None:
        self.inner.send(msg)
        self.outputs += isinstance(msg, BatchTokenIDOut)


class ReplicaSimClock(LiveSimClock):
    """`LiveSimClock` of one of `--dp-size` replicas behind the real data-parallel controller. Each
    replica keeps its own simulated time (trace/clock.py): an idle replica begins at its request's
    arrival, a working one starts a pass only when it is the busy one furthest behind, no request is
    on its way to any replica and no announced arrival is due by its time, and a request that reaches
    it before its time has come to the request's arrival waits (`future`). So the replicas run side by
    side in simulated time, one at a time on this host, in the order the offline Simulator steps them;
    the deployment idles (the clock runs or skips) only when every replica does. `io` is the
    scheduler's I/O, whose token outputs it counts."""

    def __init__(
        self, shared: trace_clock.SharedClock, speed: float, worker: WarpSimWorker, dp_rank: int, io: _CountingIO
    ):
        super().__init__(shared, speed, worker)
        self.dp_rank = dp_rank
        self.io = io
        self._busy = False
        self.future: list[TokenizedGenerateReqInput] = []  # arrived after this replica's time: not yet

    def after_step(self, scheduler: SchedulerState, batch: ScheduleBatch | None) -> None:
        super().after_step(scheduler, batch)
        self.shared.outputs_sent(self.dp_rank, self.io.outputs)  # this pass's outputs are on their way

    def _note_kv(self, used: int) -> None:
        self.kv_used_peak = self.shared.note_kv(self.dp_rank, used)  # the deployment's peak (every replica's)

    def _begin(self, at: int) -> None:
        self.shared.replica_begin(self.dp_rank, at)
        self._busy = True

    def _take(self, msgs: list) -> list:
        reqs = [m for m in msgs if isinstance(m, TokenizedGenerateReqInput)]
        if not reqs:
            return msgs
        if not self._busy:  # busy before counted: whoever sees the request received sees this replica busy
            self._begin(min(m.arrival_ts or self.shared.now_ns() for m in reqs))
        self.received += len(reqs)
        self.shared.set_received(self.dp_rank, self.received)
        now = self.shared.replica_now(self.dp_rank)
        self.future += [m for m in reqs if m.arrival_ts > now]
        return [m for m in msgs if not (isinstance(m, TokenizedGenerateReqInput) and m.arrival_ts > now)]

    def _arrived(self) -> list:
        """Requests from `future` whose arrival this replica's time has reached."""
        now = self.shared.replica_now(self.dp_rank)
        ready = [m for m in self.future if m.arrival_ts <= now]
        self.future = [m for m in self.future if m.arrival_ts > now]
        return ready

    def recv(self, scheduler: SchedulerState) -> list:
        s, clock, rank = scheduler, self.shared, self.dp_rank
        msgs = self._take(s.io.recv(0))
        while True:
            msgs += self._arrived() if self.future and self._busy else []
            arriving = any(isinstance(m, TokenizedGenerateReqInput) for m in msgs)
            stepping = not (s.paused and s.step_credits == 0)
            due, on_way = clock.announced(), clock.received_total() < clock.sent()
            if not stepping or not (arriving or s.has_work() or self.future):
                if self._busy:
                    self._busy = False
                    clock.replica_end(rank)
                s.tracer.flush()
                self._idle = True
                wait_ms = self._let_time_pass(stepping, on_way, due, clock.received_total()) if clock.all_idle() else 50
                if msgs:
                    return msgs
                msgs = self._take(s.io.recv(wait_ms))
                if not any(isinstance(m, TokenizedGenerateReqInput) for m in msgs):
                    return msgs
                continue
            if not self._busy:  # work left over from before a pause
                self._begin(clock.now_ns())
            if not (arriving or s.has_work()):  # only requests of later: nothing runs here until the first
                self._begin(min(m.arrival_ts for m in self.future))
                continue
            self._idle = False
            late = due is not None and due <= clock.replica_now(rank) and not self._gave_up_on(due)
            if on_way or late or not clock.replica_turn(rank):
                # Another replica's pass is usually what this waits for: look again in 0.2 ms, not the
                # socket's 1 ms poll, which cost every turn up to a millisecond of wall time.
                new = s.io.recv(0)
                if not new:
                    time.sleep(0.0002)
                msgs += self._take(new)
                continue
            return msgs


def build_worker(
    sa: ServerArgs, vocab: int, shared: trace_clock.SharedClock, seed: int | None = None, dp_rank: int = 0
) -> WarpSimWorker:
    """The scheduler process's worker for `sa` (already `sized_args`); tokens are drawn from [3, vocab).
    Replica r of a data-parallel deployment draws from seed + 7919 r, as the offline Simulator's."""
    cost = _cost_model(sa)
    spec = cost.model
    context = min(spec.context_len, sa.context_length or spec.context_len)
    assert sa.max_total_tokens is not None, "sized_args sized the pool"
    runner = sim_runner(spec, sa.max_total_tokens, sa.max_running_requests, context)
    runner.model_config.vocab_size = min(spec.vocab, vocab)  # ids the stand-in tokenizer can decode
    runner.model_config.eos_token_ids = []  # random ids never mean "stop": requests run to their limit
    runner.kv_head_num = max(1, spec.kv_heads // sa.tp_size)
    seed = (sa.random_seed if seed is None else seed) + 7919 * dp_rank
    # SimWorker's own clock stays unused here: every pass moves the shared one.
    if sa.dp_size > 1:
        return ReplicaSimWorker(
            runner,
            cost,
            SimClock(),
            seed,
            sa.speculative_accept_rate,
            shared=shared,
            speed=sa.sim_speed,
            dp_rank=dp_rank,
        )
    return WarpSimWorker(runner, cost, SimClock(), seed, sa.speculative_accept_rate, shared=shared, speed=sa.sim_speed)


def stand_in_model_dir():
    """The default model's directory: its tokenizer stands in for the simulated model's."""
    from workbench.core.model_loader import prepare_model

    return prepare_model(ServerArgs().model_path, progress=False).model_dir


def scheduler_parts(
    server_args: ServerArgs, port_args: PortArgs, tp_rank: int = 0, tp_size: int = 1, dp_rank: int = 0
) -> SchedulerParts:
    """The SchedulerFactory of a simulated deployment (run_scheduler_process calls it): the real
    Scheduler on its ZMQ I/O, handed a simulated worker, a step clock keeping the clock the engine
    shared (trace/clock.py), and the stand-in tokenizer (stop strings, previews). One process stands
    for every device of a replica (tp_size 1). A data-parallel replica stamps with its own time
    (`ReplicaClock`). Speculative decoding runs the scheduler's NGRAM path with `SimDrafter`'s drafts,
    each kept with --speculative-accept-rate, and STANDALONE costs the draft model's passes."""
    sa = server_args
    shared = trace_clock.current()
    if not isinstance(shared, trace_clock.SharedClock):
        raise RuntimeError("a simulated scheduler needs the engine's shared clock (PortArgs.extra['shared_clock'])")
    tokenizer = load_fast_tokenizer(stand_in_model_dir())
    worker = build_worker(sa, tokenizer.get_vocab_size(), shared, dp_rank=dp_rank)
    # The scheduler's own speculative path, NGRAM's (no draft model is loaded: the drafter is simulated)
    args = dataclasses.replace(sa, speculative_algorithm="NGRAM") if sa.speculative_algorithm else sa
    io: SchedulerIO = ZmqSchedulerIO(port_args)
    replica = dp_rank if sa.dp_size > 1 else None
    if replica is not None:
        trace_clock.install(trace_clock.ReplicaClock(shared, replica))
        io = _CountingIO(io)
        step_clock: LiveSimClock = ReplicaSimClock(shared, sa.sim_speed, worker, replica, io)
    else:
        step_clock = LiveSimClock(shared, sa.sim_speed, worker, follow_wall=sa.disaggregation_mode != "null")
    drafter = None
    if sa.speculative_algorithm:
        drafter = make_drafter(worker, worker.model_runner.model_config.vocab_size, _draft_cost(sa, worker.cost))
    overlap = args.disable_overlap_schedule is False  # the overlap loop over two timelines, when asked
    # PD (--disaggregation-mode): the real prefill or decode side, its transport timed by the link model
    from workbench.core.simulation.pd_live import simulated_pd_part

    pd_part = simulated_pd_part(sa, worker.cost, lambda: shared.now_ns() / 1e9)
    return SchedulerParts(
        args,
        worker=worker,
        io=io,
        tokenizer=tokenizer,
        step_clock=step_clock,
        drafter=drafter,
        overlap_worker=LiveSimOverlapClient(worker, replica) if overlap else None,
        tp_size=1,
        disaggregation=pd_part,
    )


def replay(engine, workload: list[SimRequest], seed: int = 0, progress=None) -> SimResult:
    """Run `workload` through a simulated engine's whole pipeline (tokenizer manager, scheduler
    process, detokenizer): each request is sent when the simulated clock reaches its arrival, which is
    announced first so the scheduler holds time for it (at --sim-speed 0 the idle gaps are skipped).
    Returns the run's figures in simulated time, from each request's `meta_info` (what a client of
    the engine sees), like `Simulator.run`'s. Prompts as `Simulator` draws them (`request_prompt`),
    from the stand-in tokenizer's vocabulary; `progress(done, total, sim_s)` is called as requests end."""
    if not engine.server_args.simulate:
        raise ValueError("replay drives a simulated engine: start it with simulate=HARDWARE (--simulate)")
    return engine._run(_replay(engine, workload, seed, progress))


async def _replay(engine, workload: list[SimRequest], seed: int, progress) -> SimResult:
    tm, clock, sa = engine.tokenizer_manager, engine.clock, engine.server_args
    vocab = len(engine.tokenizer)
    t0 = time.perf_counter()
    clock.announce(clock.now_ns())  # an arrival due now: the scheduler holds the clock, the run starts there
    while clock.running:
        await asyncio.sleep(0.0002)
    base = clock.now_ns()
    before = await tm.get_internal_state()
    order = sorted(range(len(workload)), key=lambda i: workload[i].arrival)
    metas: dict[int, dict] = {}
    outputs: dict[str, list[int]] = {}

    async def one(i: int, obj: GenerateReqInput) -> None:
        async for out in tm.generate_request(obj):
            metas[i] = out["meta_info"]
            if obj.forced_output_ids and obj.rid is not None:
                outputs[obj.rid] = out["output_ids"]
        if progress is not None:
            progress(len(metas), len(workload), (clock.now_ns() - base) / 1e9)

    tasks, prompt_tokens = [], 0
    try:
        for i in order:
            r = workload[i]
            due = base + round(r.arrival * 1e9)
            clock.announce(due)  # the scheduler will not step past it before the request is in
            while clock.now_ns() < due:
                await asyncio.sleep(0.0002)
            ids = request_prompt(i, r, seed, vocab)
            prompt_tokens += len(ids)
            params = SamplingParams(max_new_tokens=r.output_len, temperature=0.0, ignore_eos=True)
            rid = f"r{i}"
            obj = GenerateReqInput(
                input_ids=ids,
                sampling_params=params,
                rid=rid,
                arrival_ns=due,
                forced_output_ids=r.output_ids,
                forced_drafts=r.drafts if r.output_ids else None,
                priority=r.priority,
            )
            tasks.append(asyncio.ensure_future(one(i, obj)))
            while rid not in tm.rid_to_state and not tasks[-1].done():  # counted as sent: the next may be announced
                await asyncio.sleep(0)
        clock.announce(None)
        await asyncio.gather(*tasks)
    finally:
        clock.announce(None)
    state = await tm.get_internal_state()
    pool = engine.max_total_num_tokens * sa.dp_size  # each replica's pool is replica 0's
    res = SimResult(sa.simulate, str(sa.model_path), sa.tp_size, pool, 0.0, 0.0, dp_size=sa.dp_size)
    for i, m in metas.items():
        rid, n = f"r{i}", m["completion_tokens"]
        res.ttft[rid], res.latency[rid] = m["ttft"], m["e2e_latency"]
        if n > 1:
            res.tpot[rid] = (m["e2e_latency"] - m["ttft"]) / (n - 1)
        res.output_tokens += n
        res.cached_tokens += m.get("cached_tokens", 0)
    res.prompt_tokens, res.outputs = prompt_tokens, outputs
    res.peak_kv_used, res.steps = state.kv_used_peak, _steps(state) - _steps(before)  # peak: since the engine began
    res.retracted = state.retracted_total - before.retracted_total
    res.priority_of = {f"r{i}": w.priority for i, w in enumerate(workload) if w.priority is not None}
    res.preempted = -1  # not told apart from KV retractions here: both are in `retracted`
    res.spec_proposed = state.spec_proposed - before.spec_proposed
    res.spec_accepted = state.spec_accepted - before.spec_accepted
    if state.per_replica:  # data parallel: how many requests the controller sent each replica
        res.per_replica_requests = [
            now["received_total"] - then["received_total"] for now, then in zip(state.per_replica, before.per_replica)
        ]
    if state.hicache is not None:  # as Simulator.run's: the counters since the run began
        then = before.hicache or {}
        res.hicache = True
        res.host_hit_tokens = int(state.hicache["load_back_tokens"] - then.get("load_back_tokens", 0))
        res.prefetch_tokens = int(state.hicache["prefetch_tokens"] - then.get("prefetch_tokens", 0))
        res.hicache_s = float(state.hicache.get("charged_s", 0.0) - then.get("charged_s", 0.0))
    start = min((r.arrival for r in workload), default=0.0)
    res.sim_s = max((workload[i].arrival + m["e2e_latency"] for i, m in metas.items()), default=start) - start
    res.wall_s = time.perf_counter() - t0
    return res


def _steps(state) -> int:
    """Passes the deployment ran: every replica's (a data-parallel state's `step` is the largest)."""
    return sum(r["step"] for r in state.per_replica) if state.per_replica else state.step
