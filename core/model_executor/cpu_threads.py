"""How many OpenMP threads the scheduler computes with on CPU, and on which cores.

Why this exists: torch's CPU kernels split every op across an OpenMP team and end in a
barrier. When another process (the TUI, a notebook kernel, the HTTP front end, a busy
neighbour) takes a core, one thread of the team is descheduled mid-op and the others wait
for it at every barrier: on this project's 2-core machine two threads then decode 5-35x
slower than one. One thread never waits for a sibling, but leaves half the machine idle when
it is quiet. So the default is adaptive:

- `CpuLoadMeter` measures what *other* processes use of the cores this process may run on
  (from /proc/stat, steal time included, minus this process's own CPU time), in cores;
- `ThreadPolicy` (pure, tested without /proc) turns those readings into a thread count:
  one fewer thread per core the others keep busy, down at once, back up only after the
  cores have stayed quiet for a few windows (hysteresis, so it does not flap);
- `AdaptiveThreads` is the glue the scheduler calls once per step: it reads the meter every
  `interval_s` and applies a change with `torch.set_num_threads` between steps.

`--num-threads N` fixes the count; `--cpu-omp-threads-bind 0-1` (SGLang's
SGLANG_CPU_OMP_THREADS_BIND, `|` between TP ranks) pins the scheduler to those cores and uses
one thread per core. Both turn the adaptation off: the user chose.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

logger = logging.getLogger(__name__)

__all__ = ["parse_core_list", "cores_for_rank", "CpuLoadMeter", "ThreadPolicy", "AdaptiveThreads",
           "ThreadPlan", "plan_threads"]

BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


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
            raise ValueError(f"bad core list {text!r}: use ranges and numbers like 0-3,6 "
                             "(and | between tensor-parallel ranks: 0-1|2-3)") from None
    if not cores or min(cores) < 0:
        raise ValueError(f"bad core list {text!r}: use ranges and numbers like 0-3,6")
    return sorted(set(cores))


def cores_for_rank(spec: str, local_rank: int, local_ranks: int) -> list[int]:
    """The cores of `local_rank` in a bind spec '0-1|2-3' (one group per rank on this node)."""
    groups = spec.split("|")
    if len(groups) != local_ranks:
        raise ValueError(f"--cpu-omp-threads-bind {spec!r} has {len(groups)} core group(s) for {local_ranks} "
                         f"scheduler rank(s) on this node: give one group per rank, separated by |")
    cores = parse_core_list(groups[local_rank])
    allowed = _allowed_cores()
    outside = [c for c in cores if allowed is not None and c not in allowed]
    if outside:
        raise ValueError(f"--cpu-omp-threads-bind names core(s) {outside} this process may not use "
                         f"(allowed: {sorted(allowed)})")
    return cores


def _allowed_cores() -> Optional[set[int]]:
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

    def __init__(self, cores: Optional[list[int]] = None, stat_path: str = "/proc/stat",
                 clock: Callable[[], float] = time.monotonic, own_cpu: Callable[[], float] = None):
        allowed = _allowed_cores()
        self.cores = sorted(cores if cores is not None else (allowed or range(os.cpu_count() or 1)))
        self.stat_path = stat_path
        self.clock = clock
        self.own_cpu = own_cpu or (lambda: sum(os.times()[:2]))
        self.ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._sample()

    def _busy_seconds(self) -> Optional[float]:
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

    def _sample(self) -> Optional[tuple[float, float, float]]:
        busy = self._busy_seconds()
        return None if busy is None else (self.clock(), busy, self.own_cpu())

    def read(self) -> Optional[float]:
        """Cores kept busy by everything but this process since the last read (>= 0)."""
        now = self._sample()
        last, self._last = self._last, now
        if now is None or last is None or now[0] <= last[0]:
            return None
        others = (now[1] - last[1]) - (now[2] - last[2])
        return max(0.0, others / (now[0] - last[0]))


# ==== the decision rule ========================================================================

@dataclass
class ThreadPolicy:
    """Threads = max_threads minus one per core the neighbours keep busy; pure and deterministic.

    `observe(others)` takes one window's reading (cores used by other processes) and returns
    the thread count to use from now on. A core counts as taken above `down_at` of it (one
    stalled team member costs more than the core's remaining share brings), and is given back
    below `up_at` for `up_after` windows in a row: quick to retreat, slow to return.
    """
    max_threads: int
    down_at: float = 0.35
    up_at: float = 0.15
    up_after: int = 3
    threads: int = 0
    _quiet_windows: int = field(default=0, repr=False)

    def __post_init__(self):
        self.max_threads = max(1, int(self.max_threads))
        self.threads = self.threads or self.max_threads

    def _target(self, others: float, margin: float) -> int:
        taken = 0
        while taken < self.max_threads - 1 and others > taken + margin:
            taken += 1
        return self.max_threads - taken

    def observe(self, others: float) -> int:
        down = self._target(others, self.down_at)
        if down < self.threads:
            self.threads, self._quiet_windows = down, 0
            return self.threads
        up = self._target(others, self.up_at)
        if up > self.threads:
            self._quiet_windows += 1
            if self._quiet_windows >= self.up_after:
                self.threads, self._quiet_windows = self.threads + 1, 0
        else:
            self._quiet_windows = 0
        return self.threads


@dataclass
class ThreadPlan:
    """What the scheduler process runs with, decided once at start-up."""
    threads: int                        # the starting thread count
    adaptive: bool                      # whether AdaptiveThreads may change it
    cores: Optional[list[int]]          # pinned cores (None: wherever the OS puts us)
    reason: str                         # said in the start-up log and get_server_info

    def describe(self) -> str:
        where = f" on cores {_ranges(self.cores)}" if self.cores else ""
        mode = "adaptive" if self.adaptive else "fixed"
        return f"{self.threads} compute thread(s){where}, {mode}: {self.reason}"


def _ranges(cores: list[int]) -> str:
    out, start = [], None
    for i, c in enumerate(cores):
        if start is None:
            start = c
        if i + 1 == len(cores) or cores[i + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(out)


def plan_threads(num_threads: Optional[int], bind: Optional[str], local_rank: int, local_ranks: int,
                 device: str = "cpu") -> ThreadPlan:
    """The thread plan for one scheduler rank from the flags (pure but for the affinity lookup).

    Precedence: --num-threads fixes the count; --cpu-omp-threads-bind (or SGLANG_CPU_OMP_THREADS_BIND)
    pins the cores and, without --num-threads, gives one thread per pinned core; otherwise the
    rank's share of the cores it may use, adapted to the neighbours when it is the only rank here.
    """
    bind = bind or os.environ.get(BIND_ENV) or None
    cores = cores_for_rank(bind, local_rank, local_ranks) if bind and bind != "nobind" else None
    if num_threads:
        where = "--num-threads"
        return ThreadPlan(int(num_threads), False, cores, f"set by {where}")
    if cores:
        return ThreadPlan(len(cores), False, cores, "one per core of --cpu-omp-threads-bind")
    allowed = _allowed_cores()
    n_cores = len(allowed) if allowed else (os.cpu_count() or 1)
    share = max(1, n_cores // max(1, local_ranks))
    if device != "cpu":
        return ThreadPlan(share, False, None, "host threads beside the GPU")
    if local_ranks > 1:
        return ThreadPlan(share, False, None, f"{n_cores} core(s) shared by {local_ranks} ranks on this node")
    if share == 1:
        return ThreadPlan(1, False, None, "one core available")
    return ThreadPlan(share, True, None, f"up to {share} on {n_cores} cores, one fewer per core other "
                      "processes keep busy")


# ==== the scheduler's glue =====================================================================

class AdaptiveThreads:
    """Called by the scheduler after every step; re-reads the meter every `interval_s`.

    `apply(n)` is what changes the count (torch.set_num_threads in the thread that runs the
    model); `changes` records (time, threads, others) for get_server_info and the trace.
    """

    def __init__(self, plan: ThreadPlan, apply: Callable[[int], None], interval_s: float = 0.5,
                 meter: Optional[CpuLoadMeter] = None, clock: Callable[[], float] = time.monotonic):
        self.plan = plan
        self.apply = apply
        self.interval_s = interval_s
        self.clock = clock
        self.policy = ThreadPolicy(plan.threads, threads=plan.threads)
        self.meter = meter if meter is not None else (CpuLoadMeter(plan.cores) if plan.adaptive else None)
        self.next_at = clock() + interval_s
        self.others: Optional[float] = None
        self.changes: list[tuple[float, int, float]] = []

    @property
    def threads(self) -> int:
        return self.policy.threads

    def maybe_update(self) -> Optional[int]:
        """The new thread count when it changed on this call, else None."""
        if self.meter is None:
            return None
        now = self.clock()
        if now < self.next_at:
            return None
        self.next_at = now + self.interval_s
        others = self.meter.read()
        if others is None:
            return None
        self.others = others
        before = self.policy.threads
        after = self.policy.observe(others)
        if after == before:
            return None
        self.apply(after)
        self.changes.append((now, after, others))
        del self.changes[:-32]
        logger.info("compute threads %d -> %d: other processes use %.2f core(s)", before, after, others)
        return after
