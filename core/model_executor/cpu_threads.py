"""How many OpenMP threads the scheduler computes with on CPU, and on which cores.

Why this exists: torch's CPU kernels split every op across an OpenMP team and end in a
barrier. When another process (the TUI, a notebook kernel, the HTTP front end, a busy
neighbour) takes a core, one thread of the team is descheduled mid-op and the others wait
for it at every barrier, so two threads can run slower than one; quiet, two are ~1.5x one.
Which wins depends on the CPU, the batch and the neighbour, so the default measures it:

- `StepTimePolicy` (pure, tested without processes) now and then runs a few decode steps of
  the same batch size with the other thread count and keeps whichever was faster, giving
  up on a probe at its first step that takes twice as long;
- `AdaptiveThreads` is the glue the scheduler calls after every decode step: it applies a
  change with `torch.set_num_threads` between steps, and reads `CpuLoadMeter` (what the
  *other* processes use of our cores, from /proc/stat, steal included) to report it.

How long an idle thread of the team spins before it sleeps matters as much. libgomp (torch's
OpenMP) spins ~300,000 rounds at every barrier by default: quiet that is free, but beside a
neighbour a spinning thread burns the core its descheduled teammate (or the neighbour) needs,
and a decode step of ~300 parallel regions runs several times slower. `omp_wait_env` starts the
scheduler processes with a bounded spin (GOMP_SPINCOUNT, below) unless the user set one.

`--num-threads N` fixes the count; `--cpu-omp-threads-bind 0-1` (SGLang's
SGLANG_CPU_OMP_THREADS_BIND, `|` between TP ranks) pins the scheduler to those cores and uses
one thread per core. Both turn the adaptation off: the user chose.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

__all__ = [
    "parse_core_list",
    "cores_for_rank",
    "CpuLoadMeter",
    "StepTimePolicy",
    "AdaptiveThreads",
    "ThreadPlan",
    "plan_threads",
    "omp_wait_env",
    "OMP_SPINCOUNT",
]

BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"
# Spin rounds before an idle OpenMP thread sleeps (libgomp's GOMP_SPINCOUNT; default 300,000).
# Gaps between a decode step's parallel regions are far shorter than this many rounds, so quiet
# steps keep their speed; beside a neighbour a waiting thread yields its core soon (docs/design.md).
OMP_SPINCOUNT = "10000"
_USER_WAIT_VARS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def omp_wait_values(environ) -> dict:
    """The variables `omp_wait_env` adds to `environ` (none where the user chose a wait policy)."""
    if any(environ.get(v) for v in _USER_WAIT_VARS):
        return {}
    return {"GOMP_SPINCOUNT": OMP_SPINCOUNT}


def omp_wait_text(environ) -> str:
    """How this process's OpenMP threads wait, for the ready line."""
    if environ.get("OMP_WAIT_POLICY"):
        return f"OpenMP waits: OMP_WAIT_POLICY={environ['OMP_WAIT_POLICY']}"
    if environ.get("GOMP_SPINCOUNT"):
        return f"OpenMP waits: spin {environ['GOMP_SPINCOUNT']} rounds, then sleep"
    return "OpenMP waits: libgomp's default spin"


class omp_wait_env:
    """Context manager: processes started inside it get the bounded OpenMP spin (libgomp reads it
    once, when torch loads it, so it must be in the child's environment from the start); the
    parent's environment is restored on exit."""

    def __init__(self, device: str = "cpu"):
        self.device = device
        self._saved: dict = {}

    def __enter__(self) -> dict:
        # "auto" too (resolving it would import torch here): on a GPU the host threads barely use OpenMP
        added = omp_wait_values(os.environ) if self.device != "cuda" else {}
        self._saved = {k: os.environ.get(k) for k in added}
        os.environ.update(added)
        return added

    def __exit__(self, *exc) -> None:
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def parse_core_list(text: str) -> list[int]:
    """'0-3,6' -> [0, 1, 2, 3, 6]; raises ValueError saying what a core list looks like."""
    cores: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                cores.extend(range(lo, hi + 1))
            else:
                cores.append(int(part))
        except ValueError:
            raise ValueError(
                f"bad core list {text!r}: use ranges and numbers like 0-3,6 "
                "(and | between tensor-parallel ranks: 0-1|2-3)"
            ) from None
    if not cores or min(cores) < 0:
        raise ValueError(f"bad core list {text!r}: use ranges and numbers like 0-3,6")
    return sorted(set(cores))


def cores_for_rank(spec: str, local_rank: int, local_ranks: int) -> list[int]:
    """The cores of `local_rank` in a bind spec '0-1|2-3' (one group per rank on this node)."""
    groups = spec.split("|")
    if len(groups) != local_ranks:
        raise ValueError(
            f"--cpu-omp-threads-bind {spec!r} has {len(groups)} core group(s) for {local_ranks} "
            f"scheduler rank(s) on this node: give one group per rank, separated by |"
        )
    cores = parse_core_list(groups[local_rank])
    allowed = _allowed_cores()
    outside = [c for c in cores if allowed is not None and c not in allowed]
    if outside:
        raise ValueError(
            f"--cpu-omp-threads-bind names core(s) {outside} this process may not use (allowed: {sorted(allowed)})"
        )
    return cores


def _allowed_cores() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


# ==== measuring the neighbours ==============================================================


class CpuLoadMeter:
    """Other processes' CPU use on `cores`, in cores, between two `read()` calls.

    Busy time of those cores from /proc/stat (user, nice, system, irq, softirq and steal:
    a hypervisor's other guest on our core stalls a thread just like a local process)
    minus this process's own user+system time. Returns None where /proc/stat is missing.
    """

    def __init__(
        self,
        cores: list[int] | None = None,
        stat_path: str = "/proc/stat",
        clock: Callable[[], float] = time.monotonic,
        own_cpu: Callable[[], float] = None,
    ):
        allowed = _allowed_cores()
        self.cores = sorted(cores if cores is not None else (allowed or range(os.cpu_count() or 1)))
        self.stat_path = stat_path
        self.clock = clock
        self.own_cpu = own_cpu or (lambda: sum(os.times()[:2]))
        self.ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._sample()

    def _busy_seconds(self) -> float | None:
        wanted = {f"cpu{c}" for c in self.cores}
        try:
            with open(self.stat_path) as f:
                lines = f.readlines()
        except OSError:
            return None
        busy = 0
        for line in lines:
            name, _, rest = line.partition(" ")
            if name in wanted:
                v = [int(x) for x in rest.split()]
                # user nice system idle iowait irq softirq steal: all but idle and iowait
                busy += v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
        return busy / self.ticks

    def _sample(self) -> tuple[float, float, float] | None:
        busy = self._busy_seconds()
        return None if busy is None else (self.clock(), busy, self.own_cpu())

    def read(self) -> float | None:
        """Cores kept busy by everything but this process since the last read (>= 0)."""
        now = self._sample()
        last, self._last = self._last, now
        if now is None or last is None or now[0] <= last[0]:
            return None
        others = (now[1] - last[1]) - (now[2] - last[2])
        return max(0.0, others / (now[0] - last[0]))


# ==== the decision rule ========================================================================


@dataclass
class StepTimePolicy:
    """Keeps whichever thread count decodes the current batch faster; pure and deterministic.

    Whether a second thread helps depends on the CPU, the batch and what else runs, and on
    the machine this was built on no load threshold predicted it well (a TUI using 0.4 of a
    core left two threads faster; a busy loop made one thread 1.9x faster at batch 1). So it
    is measured: after every `period` decode steps at the current count (the first time after
    `first_probe`), the next
    `probe_steps` decode steps of the *same batch size* run with the other count. The probe's
    first step is not timed (the team wakes up). The probe is kept if its median step is
    `margin` faster than the median of the last steps before it; it is abandoned at once
    if a step takes over twice as long (a collapsing team costs one slow step, not four; the
    untimed first step already ends it when it takes over `collapse` times as long), or if the
    batch size changes (not comparable).

    Beside a neighbour that keeps a core busy, every probe of more threads collapses, so each
    failed one doubles the wait before the next (up to `max_backoff` periods); one that is
    kept resets it, and the wait never exceeds `max_wait_ms` of decoding (so a machine that
    went quiet gets its second thread back within seconds at any batch size).

    `probe_soon(n)` asks for a probe of `n` threads as soon as four steps of one batch size
    allow: AdaptiveThreads calls it when the neighbours' CPU use changes by half a core (a
    neighbour arrived or left), so the policy need not wait out a period of collapsed steps
    (48 steps at batch 1 beside a busy loop were ~5 s at 110 ms each). A trigger on slow steps
    instead (tried) fired on a neighbour's passing burst and kept one thread against the slow
    steps, costing ~20% of quiet batch-1 decode beside an idle vLLM; a load change lasting a
    meter interval is a steadier sign, and the probe still decides by step times.
    """

    max_threads: int
    period: int = 48
    first_probe: int = 8  # the first probe comes sooner: a collapsing start is short
    probe_steps: int = 4
    margin: float = 0.08
    collapse: float = 4.0
    max_backoff: int = 16
    max_wait_ms: float = 4000.0
    threads: int = 0
    probing: int | None = None  # the count being tried, or None
    probes: int = 0  # probes started (reported in get_internal_state)
    _since: int = field(default=0, repr=False)
    _recent: list = field(default_factory=list, repr=False)  # (bs, ms) at `threads`
    _probe: list = field(default_factory=list, repr=False)  # ms at `probing`
    _probe_bs: int = field(default=0, repr=False)
    _next_try: int = field(default=0, repr=False)  # alternates down / up for N > 2
    _up_backoff: int = field(default=1, repr=False)  # periods to wait before probing more threads
    _since_ms: float = field(default=0.0, repr=False)  # decode time since the last probe
    _asked: int | None = field(default=None, repr=False)  # the count probe_soon asked for

    def __post_init__(self):
        self.max_threads = max(1, int(self.max_threads))
        self.threads = self.threads or self.max_threads
        self._since = self.period - min(self.first_probe, self.period)

    @property
    def current(self) -> int:
        """The count the next step should run with."""
        return self.probing if self.probing is not None else self.threads

    def probe_soon(self, n: int) -> bool:
        """Probe `n` threads next, as soon as four decode steps of one batch size at the current
        count are in, counted from now (no wait for the period or a back-off). False (nothing
        changes) when `n` is out of range, the current count, or a probe is running."""
        if self.probing is not None or not 1 <= n <= self.max_threads or n == self.threads:
            return False
        self._asked = n
        self._recent = []  # steps from before the change are no baseline for the probe
        if n > self.threads:
            self._up_backoff = 1
        return True

    def _candidate(self) -> int | None:
        if self._asked is not None:
            n, self._asked = self._asked, None
            return n
        options = [n for n in (self.threads - 1, self.threads + 1) if 1 <= n <= self.max_threads]
        if not options:
            return None
        self._next_try += 1
        return options[self._next_try % len(options)]

    def _due(self) -> bool:
        """Whether the next probe is due: after `period` steps, or longer while probes up keep
        failing (at one thread, where the only probe is up), but never past `max_wait_ms`."""
        if self._since < self.period:
            return False
        if self.threads != 1 or self._up_backoff == 1:
            return True
        return self._since >= self.period * self._up_backoff or self._since_ms >= self.max_wait_ms

    def observe_decode(self, bs: int, ms: float) -> int:
        """One decode step of `bs` requests took `ms` at `self.current` threads; returns the next count."""
        if self.probing is None:
            self._recent = (self._recent + [(bs, ms)])[-8:]
            self._since += 1
            self._since_ms += ms
            same = [m for b, m in self._recent[-4:] if b == bs]
            if (self._asked is not None or self._due()) and len(same) == 4:
                cand = self._candidate()
                if cand is not None:
                    self.probing, self._probe, self._probe_bs = cand, [], bs
                    self.probes += 1
            return self.current
        base = sorted(m for b, m in self._recent if b == self._probe_bs)
        base_ms = base[len(base) // 2]
        if bs != self._probe_bs:
            return self._end_probe(keep=False, retry_soon=True)
        self._probe.append(ms)
        limit = 2 * base_ms if len(self._probe) > 1 else self.collapse * base_ms
        if ms > limit:
            return self._end_probe(keep=False)
        if len(self._probe) < self.probe_steps:
            return self.current
        timed = sorted(self._probe[1:])
        return self._end_probe(keep=timed[len(timed) // 2] < (1 - self.margin) * base_ms)

    def _end_probe(self, keep: bool, retry_soon: bool = False) -> int:
        if keep:
            self._up_backoff = 1  # the situation changed: probe up at the normal pace again
        elif self.probing > self.threads and not retry_soon:
            self._up_backoff = min(2 * self._up_backoff, self.max_backoff)
        if keep:
            self.threads = self.probing
            self._recent = []
        self.probing, self._probe, self._asked = None, [], None
        self._since = self.period // 2 if retry_soon else 0
        self._since_ms = 0.0
        return self.threads


@dataclass
class ThreadPlan:
    """What the scheduler process runs with, decided once at start-up."""

    threads: int  # the starting thread count
    adaptive: bool  # whether AdaptiveThreads may change it
    cores: list[int] | None  # pinned cores (None: wherever the OS puts us)
    reason: str  # said in the start-up log and get_server_info
    spare_cores: int = 0  # cores this node's ranks leave without a compute thread (fixed plans only)

    def describe(self) -> str:
        where = f" on cores {_ranges(self.cores)}" if self.cores else ""
        mode = "adaptive" if self.adaptive else "fixed"
        return f"{self.threads} compute thread(s){where}, {mode}: {self.reason}; {omp_wait_text(os.environ)}"


def _ranges(cores: list[int]) -> str:
    out, start = [], None
    for i, c in enumerate(cores):
        if start is None:
            start = c
        if i + 1 == len(cores) or cores[i + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(out)


def plan_threads(
    num_threads: int | None, bind: str | None, local_rank: int, local_ranks: int, device: str = "cpu"
) -> ThreadPlan:
    """The thread plan for one scheduler rank from the flags (pure but for the affinity lookup).

    Precedence: --num-threads fixes the count; --cpu-omp-threads-bind (or SGLANG_CPU_OMP_THREADS_BIND)
    pins the cores and, without --num-threads, gives one thread per pinned core; otherwise the
    rank's share of the cores it may use, adapted to the neighbours when it is the only rank here.
    """
    bind = bind or os.environ.get(BIND_ENV) or None
    cores = cores_for_rank(bind, local_rank, local_ranks) if bind and bind != "nobind" else None
    allowed = _allowed_cores()
    n_cores = len(allowed) if allowed else (os.cpu_count() or 1)
    if num_threads:
        room = len(cores) if cores else n_cores // max(1, local_ranks)
        return ThreadPlan(int(num_threads), False, cores, "set by --num-threads", max(0, room - int(num_threads)))
    if cores:
        return ThreadPlan(len(cores), False, cores, "one per core of --cpu-omp-threads-bind")
    share = max(1, n_cores // max(1, local_ranks))
    if device != "cpu":
        return ThreadPlan(share, False, None, "host threads beside the GPU")
    if local_ranks > 1:
        return ThreadPlan(share, False, None, f"{n_cores} core(s) shared by {local_ranks} ranks on this node")
    if share == 1:
        return ThreadPlan(1, False, None, "one core available")
    return ThreadPlan(
        share,
        True,
        None,
        f"up to {share} on {n_cores} cores, whichever count decodes faster "
        "beside the other processes (probed after 8 decode steps, then every 48, and at once when "
        "the neighbours' load moves half a core)",
    )


def overlap_by_default(plan: ThreadPlan, device: str, dp_size: int = 1) -> bool:
    """Whether the overlap loop runs when neither --disable-overlap-schedule nor its negation is given.

    On CPU the scheduler's Python work (schedule, process the last result, stream) runs beside
    the forward pass only if a core is free for it: with every core computing, it steals cycles
    from the compute threads and their barriers wait on it (measured slower at 2 threads on 2
    cores, faster at 1). So: on when a fixed thread count leaves a core of this rank's share
    idle; never under the adaptive policy, whose point is to use every core it finds free.
    Data-parallel ranks share the machine's cores, so they keep the normal loop.
    """
    return device == "cpu" and dp_size == 1 and not plan.adaptive and plan.spare_cores >= 1


# ==== the scheduler's glue =====================================================================


class AdaptiveThreads:
    """The scheduler's glue: decode step times in, `apply(n)` out, between steps.

    `apply(n)` changes the count (torch.set_num_threads in the thread that runs the model).
    The load meter is read every `interval_s` (`others`: what the neighbours use, reported
    beside what the policy chose). It never decides the count, but when the neighbours' use
    moves `rise` cores or more away from its level at the last trigger (`calm`), it asks the
    policy for a probe now: one thread fewer when it rose, one more when it fell.
    `changes` records (time, threads, others).
    """

    def __init__(
        self,
        plan: ThreadPlan,
        apply: Callable[[int], None],
        interval_s: float = 0.25,
        meter: CpuLoadMeter | None = None,
        clock: Callable[[], float] = time.monotonic,
        policy: StepTimePolicy | None = None,
        rise: float = 0.5,
    ):
        self.plan = plan
        self.apply = apply
        self.interval_s = interval_s
        self.clock = clock
        self.policy = policy or StepTimePolicy(plan.threads, threads=plan.threads)
        self.meter = meter if meter is not None else (CpuLoadMeter(plan.cores) if plan.adaptive else None)
        self.next_at = clock() + interval_s
        self.others: float | None = None
        self.rise = rise
        self.calm: float | None = None  # the neighbours' use when last looked at (a trigger or the first read)
        self.triggers = 0  # probes the load meter asked for
        self.changes: list[tuple[float, int, float]] = []
        self.applied = plan.threads

    @property
    def threads(self) -> int:
        return self.policy.threads

    def on_decode_step(self, bs: int, forward_ms: float) -> int | None:
        """Feed one decode step; returns the new count when it changed (probe or decision)."""
        now = self.clock()
        if self.meter is not None and now >= self.next_at:
            self.next_at = now + self.interval_s
            others = self.meter.read()
            self.others = others if others is not None else self.others
            if others is not None:
                self._on_load(others)
        before_threads = self.policy.threads
        want = self.policy.observe_decode(bs, forward_ms)
        if self.policy.threads != before_threads:
            self.changes.append((now, self.policy.threads, self.others if self.others is not None else -1.0))
            del self.changes[:-32]
            logger.info(
                "compute threads %d -> %d (decode steps at batch %d ran faster; others use %s cores)",
                before_threads,
                self.policy.threads,
                bs,
                "?" if self.others is None else f"{self.others:.2f}",
            )
        if want == self.applied:
            return None
        self.applied = want
        self.apply(want)
        return want

    def _on_load(self, others: float) -> None:
        """A neighbour arrived or left (its use moved `rise` cores): probe the other count now."""
        if self.calm is None:
            self.calm = others
            return
        if self.policy.probing is not None:
            return
        moved = others - self.calm
        if abs(moved) < self.rise:
            return
        self.calm = others  # the new level is the reference: a neighbour that stays triggers once
        n = self.policy.threads + (-1 if moved > 0 else 1)
        if self.policy.probe_soon(n):
            self.triggers += 1
