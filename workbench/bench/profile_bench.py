"""`workbench bench model --profile`: where a step's time goes, measured.

For each dtype it runs three shapes through the model executor (the offline
harness, which builds batches the way the scheduler does, simply): decode at
batch 1, decode at batch N (32) and one extend (prefill) of P (512) tokens. Each
step's time is split into GEMMs (every linear layer and the LM head), attention
(backend call plus its per-pass metadata), norms + rope, SiLU-and-mul, sampling
(the logits' float cast, then the sampler), the embedding lookup,
other model ops (what is left inside the forward: Python, module calls, views)
and, at batch 1 in float32, the decoder layers' single compiled call (decode_layers.c; run
with WORKBENCH_CPU_FUSED_DECODE=0 to see its split by component)
and host work outside the forward (KV slot allocation, ForwardBatch and sampling
info building, reading the tokens back).

How it measures: while profiling, the callables that do each kind of work
(module `forward`s, the model module's `silu_and_mul` / `apply_rotary` /
`packed_linear`, `cpu_ops.rope_inplace`, the runner's `forward` and `sample`)
are replaced by wrappers that read a clock around the call, and put back
afterwards. Nothing in the model code changes, so with profiling off there is no
cost at all. Each region is charged its *self* time (its time minus that of the
regions nested in it), so the components add up to the step exactly. On CPU
every op runs synchronously, so the clock around a call is the op's time.
The same steps are also timed with only the step-level clock (no wrappers),
alternating with the profiled runs: the gap between the two totals is what the
wrappers cost.

The engine-level split (skipped with `--no-engine-split`) starts a real Engine,
runs N requests, and reads the trace's `batch.step` events: per decode step the
scheduler's schedule / forward+sample / the rest of its loop (processing the
result, streaming it out, receiving input, tracing), and each process's CPU
time per output token from /proc (tokenizer manager = the engine's loop thread).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from workbench.bench.gemm_work import LinearShapes
from workbench.bench.harness import Stages, busy_warning
from workbench.bench.model_engines import CLOCKS, BenchSizes, WorkbenchModel, environment, parse_dtypes
from workbench.bench.prompts import torch_random_ids

# Component keys in table order, with their printed labels.
COMPONENTS = (
    ("gemm", "GEMMs (linear layers + lm_head)"),
    ("fused_layers", "decoder layers in one C call"),
    ("attention", "attention (+ its metadata)"),
    ("norm_rope", "norms + rope"),
    ("activation", "activation (SiLU-and-mul)"),
    ("sampling", "sampling (logits cast + sampler)"),
    ("embedding", "embedding"),
    ("other", "other model ops"),
    ("host", "host: batch prep outside forward"),
)


# ---- the recorder -------------------------------------------------------------------
class _Recorder:
    """Self-time per component over the steps of one measurement.

    `active` is set only while a step of the shape being measured runs, so the
    warm-up and the other kind of step (the extend before decode steps) pass
    straight through the wrappers.
    """

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.active = False
        self.reset()

    def reset(self) -> None:
        self.totals: dict[str, float] = {k: 0.0 for k, _ in COMPONENTS}
        self.step_times: list[float] = []
        self._stack: list[list[float]] = []  # per open region: time spent in its children

    def wrap(self, key: str, fn: Callable) -> Callable:
        """`fn` with its self time charged to `key` while the recorder is active."""
        rec, clock = self, self.clock

        def timed(*args, **kwargs):
            if not rec.active:
                return fn(*args, **kwargs)
            children = [0.0]
            rec._stack.append(children)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = clock() - t0
                rec._stack.pop()
                rec.totals[key] += dt - children[0]
                if rec._stack:
                    rec._stack[-1][0] += dt

        return timed

    def wrap_step(self, fn: Callable, measured: Callable[[], bool]) -> Callable:
        """A whole step (the harness's `_decode` or `_extend`): its time is one step; its self time
        (outside forward and sample) is host work. The components therefore add up to the step."""
        rec, clock = self, self.clock

        def step(*args, **kwargs):
            if not measured():
                return fn(*args, **kwargs)
            rec.active = True
            children = [0.0]
            rec._stack = [children]
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = clock() - t0
                rec._stack = []
                rec.totals["host"] += dt - children[0]
                rec.step_times.append(dt)
                rec.active = False

        return step


class _Patches:
    """Attribute replacements that are undone in reverse order (instance attributes that shadowed
    a class method are deleted again, so the object is exactly as before)."""

    def __init__(self):
        self._undo: list[tuple[object, str, object, bool]] = []

    def replace(self, obj, name: str, make: Callable[[Callable], Callable]) -> None:
        own = name in getattr(obj, "__dict__", {})
        old = getattr(obj, name)
        self._undo.append((obj, name, old, own))
        setattr(obj, name, make(old))

    def undo(self) -> None:
        while self._undo:
            obj, name, old, own = self._undo.pop()
            if own:
                setattr(obj, name, old)
            else:
                delattr(obj, name)


def _instrument(runner, rec: _Recorder) -> _Patches:
    """Wrap every component's callables in `runner`'s model; returns the patches to undo."""
    from workbench.core.layers import cpu_ops
    from workbench.core.layers.layernorm import RMSNorm
    from workbench.core.layers.linear import LinearBase
    from workbench.core.layers.radix_attention import RadixAttention

    p = _Patches()
    model = runner.model
    kinds = ((LinearBase, "gemm"), (RMSNorm, "norm_rope"), (RadixAttention, "attention"))
    for module in model.modules():
        for cls, key in kinds:
            if isinstance(module, cls):
                p.replace(module, "forward", lambda f, k=key: rec.wrap(k, f))
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "embed_tokens"):
        p.replace(inner.embed_tokens, "forward", lambda f: rec.wrap("embedding", f))
    if inner is not None and hasattr(inner, "rotary_emb"):
        p.replace(inner.rotary_emb, "get_cos_sin", lambda f: rec.wrap("norm_rope", f))
    # Functions the model calls by module-global name (looked up at call time).
    mod = sys.modules[type(model).__module__]
    for name, key in (("silu_and_mul", "activation"), ("apply_rotary", "norm_rope")):
        if hasattr(mod, name):
            p.replace(mod, name, lambda f, k=key: rec.wrap(k, f))
    p.replace(cpu_ops, "rope_inplace", lambda f: rec.wrap("norm_rope", f))
    # Batch-1 float32 decode runs every decoder layer in one compiled call (decode_layers.c): its
    # GEMVs, attention, norms and rope are one region here. WORKBENCH_CPU_FUSED_DECODE=0 splits it.
    p.replace(cpu_ops, "decode_layers_f32", lambda f: rec.wrap("fused_layers", f))
    # The batch-1 float32 GEMV (linears and the LM head, which compute_logits calls directly).
    p.replace(cpu_ops, "gemv", lambda f: rec.wrap("gemm", f))
    # The LM head: on the packed path compute_logits = head GEMM (packed_linear) + float cast
    # (logits processing); without packing the whole call is the head's F.linear GEMM.
    if getattr(model, "_packed_head", None) is not None and hasattr(mod, "packed_linear"):
        p.replace(mod, "packed_linear", lambda f: rec.wrap("gemm", f))
        p.replace(model, "compute_logits", lambda f: rec.wrap("sampling", f))
    else:
        p.replace(model, "compute_logits", lambda f: rec.wrap("gemm", f))
    p.replace(runner.attn_backend, "init_forward_metadata", lambda f: rec.wrap("attention", f))
    p.replace(runner, "forward", lambda f: rec.wrap("other", f))
    p.replace(runner, "sample", lambda f: rec.wrap("sampling", f))
    return p


# ---- results ------------------------------------------------------------------------
@dataclass
class ProfileRow:
    """One (dtype, shape): milliseconds per step per component, and the step with and without wrappers."""

    shape: str  # "decode bs=1", "decode bs=32", "extend 512"
    dtype: str
    steps: int  # steps in the kept (best) measurement
    detail: str
    ms: dict[str, float] = field(default_factory=dict)  # component key -> ms per step
    profiled_ms: float = 0.0  # step total with the wrappers (= sum of components)
    unprofiled_ms: float = 0.0  # step total, step clock only, same run
    gemm_flops: float = 0.0  # one step's linear + LM-head FLOPs, from the model's shapes
    peak_gflops: float | None = None  # this machine's compute peak for the dtype and threads (peak.py)

    @property
    def gemm_ms(self) -> float:
        """The step's GEMM time; with the decoder layers in one C call (float32 batch 1) that call is
        counted too, since its linears cannot be timed apart from the rest of it."""
        return self.ms.get("gemm", 0.0) + self.ms.get("fused_layers", 0.0)

    @property
    def gemm_gflops(self) -> float | None:
        """The GEMMs' own rate: their FLOPs over their time."""
        return self.gemm_flops / self.gemm_ms / 1e6 if self.gemm_flops and self.gemm_ms > 0 else None

    @property
    def step_gflops(self) -> float | None:
        """The same FLOPs over the whole step (unprofiled): the rate the engine gets out of the GEMMs."""
        return self.gemm_flops / self.unprofiled_ms / 1e6 if self.gemm_flops and self.unprofiled_ms > 0 else None

    def percent(self, key: str) -> float:
        return 100.0 * self.ms[key] / self.profiled_ms if self.profiled_ms > 0 else 0.0

    @property
    def overhead_pct(self) -> float:
        return 100.0 * (self.profiled_ms / self.unprofiled_ms - 1.0) if self.unprofiled_ms > 0 else 0.0


@dataclass
class EngineSplit:
    """A real Engine's decode steps, from the scheduler's `batch.step` events and /proc CPU times."""

    dtype: str
    batch: int
    decode_steps: int  # decode steps averaged over
    schedule_ms: float  # begin_step -> batch built (scheduling + prepare_for_decode)
    forward_ms: float  # TpModelWorker: ForwardBatch, forward, sample, tokens to a list
    rest_ms: float  # process the result, stream it, receive input, trace flush
    trace_ms: float  # of the three above: the scheduler's tracing, per step
    wall_s: float  # the workload, as the caller saw it
    output_tokens: int
    cpu_ms_per_token: dict[str, float] = field(default_factory=dict)  # process/thread -> CPU ms per token

    @property
    def step_ms(self) -> float:
        return self.schedule_ms + self.forward_ms + self.rest_ms


# ---- the model-level profile -----------------------------------------------------------
def _measure(wb, rec: _Recorder, run: Callable[[], None], profiled: bool) -> tuple[float, dict[str, float], int]:
    """Run `run` once; (ms per step, component ms per step, steps). `profiled` installs the wrappers."""
    rec.reset()
    patches = _instrument(wb.runner, rec) if profiled else None
    try:
        run()
    finally:
        if patches is not None:
            patches.undo()
    n = len(rec.step_times)
    if n == 0:
        raise RuntimeError("no step was measured")
    return 1000 * sum(rec.step_times) / n, {k: 1000 * v / n for k, v in rec.totals.items()}, n


def profile_shapes(
    wb,
    dtype: str,
    shapes: list[tuple[str, str, Callable[[], None], str]],
    repeats: int,
    clock: Callable[[], float],
    stages=None,
    flops: dict[str, float] | None = None,
    peak_gflops: float | None = None,
) -> list[ProfileRow]:
    """Profile each shape (name, step kind "decode"/"extend", run, detail) of one loaded `WorkbenchModel`.
    `flops`: shape name -> one step's GEMM FLOPs; `peak_gflops`: the machine's peak they are measured against.

    Unprofiled and profiled runs alternate `repeats` times; for each the repeat with the
    lowest per-step total is kept (the least disturbed by other processes)."""
    rec = _Recorder(clock)
    kind = {"now": ""}
    offline = wb.harness
    offline._decode = rec.wrap_step(offline._decode, lambda: kind["now"] == "decode")
    offline._extend = rec.wrap_step(offline._extend, lambda: kind["now"] == "extend")
    rows = []
    try:
        for name, step_kind, run, detail in shapes:
            kind["now"] = step_kind
            best_plain, best_prof = float("inf"), None
            for _ in range(max(1, repeats)):
                plain, _, _ = _measure(wb, rec, run, profiled=False)
                best_plain = min(best_plain, plain)
                prof = _measure(wb, rec, run, profiled=True)
                if best_prof is None or prof[0] < best_prof[0]:
                    best_prof = prof
            total, comps, n = best_prof
            row = ProfileRow(name, dtype, n, detail, comps, total, best_plain)
            row.gemm_flops, row.peak_gflops = (flops or {}).get(name, 0.0), peak_gflops
            rows.append(row)
            if stages is not None:
                stages.step(f"{dtype}: profiled {name}: {total:.2f} ms/step ({best_plain:.2f} without wrappers)")
    finally:
        kind["now"] = ""
        del offline._decode, offline._extend  # back to the class methods
    return rows


def run_profile(args: argparse.Namespace) -> tuple[list[ProfileRow], EngineSplit | None]:
    """`bench model --profile`: the tables for every dtype, then (unless skipped) the engine split."""
    from workbench.core.model_loader import prepare_model

    if (getattr(args, "device", None) or "cpu") != "cpu":
        raise ValueError(
            "--profile times ops with a host clock, which on a GPU measures launches, not work; "
            "it runs on CPU only (leave --device out)"
        )
    if getattr(args, "enable_torch_compile", False):
        raise ValueError(
            "--profile splits the eager step by layer; a compiled step has no layers to split "
            "(leave --enable-torch-compile out)"
        )
    sizes = BenchSizes.quick() if args.quick else BenchSizes()
    for name in ("batch", "prefill_len", "repeats"):
        if getattr(args, name, None):
            setattr(sizes, name, getattr(args, name))
    steps = getattr(args, "profile_steps", None) or (3 if args.quick else 16)
    dtypes = parse_dtypes(args.dtype)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    clock = CLOCKS[getattr(args, "clock", None) or "wall"]
    engine_split = not getattr(args, "no_engine_split", False)
    stages = Stages(total=len(dtypes) * 4 + int(engine_split), quiet=bool(getattr(args, "quiet", False)))
    busy = busy_warning()
    if busy and not stages.quiet:
        print(busy, file=sys.stderr, flush=True)
    prepared = prepare_model(args.model, progress=not stages.quiet)
    vocab = int(prepared.config.vocab_size)
    one = torch_random_ids(1, sizes.prompt_len, vocab, seed=1)
    many = torch_random_ids(sizes.batch, sizes.prompt_len, vocab, seed=2)
    long_prompt = torch_random_ids(1, sizes.prefill_len, vocab, seed=3)[0]
    max_tokens = max(sizes.batch * (sizes.prompt_len + steps + 2), sizes.prefill_len + 2) + 64
    extends = max(1, steps // 8)

    import torch

    from workbench.bench.peak import get_peak, peak_gflops

    peak = get_peak(quiet=stages.quiet)
    threads = torch.get_num_threads()
    lin = LinearShapes.from_config(prepared.config)
    body, head = lin.body_flops_per_token(), lin.head_flops_per_token()
    flops = {  # one step's GEMM work: a row per decode token through everything; a prompt's rows + one head row
        "decode bs=1": body + head,
        f"decode bs={sizes.batch}": sizes.batch * (body + head),
        f"extend {sizes.prefill_len}": sizes.prefill_len * body + head,
    }
    rows: list[ProfileRow] = []
    for dtype in dtypes:
        wb = WorkbenchModel(prepared, dtype, max_tokens, False)
        stages.step(f"{dtype}: workbench loaded")
        for prompts in (one, many):  # warm-up: oneDNN kernel creation stays out of the timings
            wb.generate(prompts, 2)
        wb.generate([long_prompt], 1)
        after = f"{steps} decode steps after {sizes.prompt_len}-token prompts"
        shapes = [
            ("decode bs=1", "decode", lambda: wb.generate(one, steps + 1), after),
            (f"decode bs={sizes.batch}", "decode", lambda: wb.generate(many, steps + 1), after),
            (
                f"extend {sizes.prefill_len}",
                "extend",
                lambda: [wb.generate([long_prompt], 1) for _ in range(extends)],
                f"{extends} x one {sizes.prefill_len}-token prompt, its first token sampled",
            ),
        ]
        rows += profile_shapes(
            wb, dtype, shapes, sizes.repeats, clock, stages, flops, peak_gflops(peak, dtype, threads)
        )
        shapes = wb = None  # free this dtype's model before the next one loads
    split = None
    if engine_split:
        split = run_engine_split(args.model, dtypes[0], many, steps + 1, max_tokens, args.threads)
        stages.step(f"{dtypes[0]}: engine split: {split.step_ms:.2f} ms per decode step")
    return rows, split


# ---- the engine-level split --------------------------------------------------------------
def _cpu_seconds(stat_path: str) -> float | None:
    """utime + stime of a process or thread from its /proc stat file (None where unreadable)."""
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # fields 14, 15 of stat


def _cpu_snapshot(engine) -> dict[str, float | None]:
    pids = engine.get_server_info()["pids"]
    out = {role: _cpu_seconds(f"/proc/{pid}/stat") for role, pid in sorted(pids.items())}
    loop_thread = getattr(engine, "_loop_thread", None)
    tid = getattr(loop_thread, "native_id", None)
    out["tokenizer manager (engine loop thread)"] = _cpu_seconds(f"/proc/self/task/{tid}/stat") if tid else None
    out["main process (all threads)"] = _cpu_seconds("/proc/self/stat")
    return out


def run_engine_split(
    model: str | None, dtype: str, prompts: list[list[int]], new_tokens: int, max_tokens: int, threads: int | None
) -> EngineSplit:
    """Run `prompts` through a real Engine with the trace on; average its decode steps."""
    from workbench.core.engine import Engine
    from workbench.core.trace.events import BatchStep

    kwargs = {"num_threads": threads} if threads else {}
    # The split is the normal loop's (schedule, forward, rest one after the other): a fixed thread count
    # with a core to spare would otherwise start the overlap loop, whose phases overlap.
    kwargs["disable_overlap_schedule"] = True
    sp = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    with Engine(model_path=model, dtype=dtype, max_total_tokens=max_tokens, show_progress=False, **kwargs) as eng:
        sub = eng.subscribe(with_snapshot=False, name="profile")
        try:
            eng.generate(input_ids=prompts, sampling_params=dict(sp, max_new_tokens=2))  # warm-up
            time.sleep(0.3)
            sub.drain()
            trace0, cpu0 = eng.get_internal_state()["trace_ms"], _cpu_snapshot(eng)
            t0 = time.perf_counter()
            eng.generate(input_ids=prompts, sampling_params=sp)
            wall = time.perf_counter() - t0
            cpu1, trace1 = _cpu_snapshot(eng), eng.get_internal_state()["trace_ms"]
            time.sleep(0.3)  # the last step's events are flushed after its output is sent
            events = [e for e in sub.drain() if isinstance(e, BatchStep)]
        finally:
            sub.close()
    steps = sorted(events, key=lambda e: e.step)
    sched, fwd, rest = [], [], []
    # A step's "rest" ends where the next one begins: its batch.step is stamped after its forward,
    # so next.ts - schedule - forward is when the next step began.
    for a, b in zip(steps, steps[1:]):
        if a.mode == "decode" and b.mode == "decode" and b.step == a.step + 1:
            sched.append(b.schedule_ms)
            fwd.append(b.forward_ms)
            rest.append((b.ts - a.ts) / 1e6 - b.schedule_ms - b.forward_ms)
    if not sched:
        raise RuntimeError(f"the trace carried no consecutive decode steps ({len(steps)} batch.step events)")
    tokens = len(prompts) * new_tokens
    cpu = {
        role: 1000 * (cpu1[role] - cpu0[role]) / tokens
        for role in cpu0
        if cpu0[role] is not None and cpu1.get(role) is not None
    }
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return EngineSplit(
        dtype,
        len(prompts),
        len(sched),
        mean(sched),
        mean(fwd),
        mean(rest),
        (trace1 - trace0) / max(1, len(steps)),
        wall,
        tokens,
        cpu,
    )


# ---- printing --------------------------------------------------------------------------
def format_profile(rows: list[ProfileRow]) -> str:
    """One table per (dtype, shape): component | ms per step | % of step, then the totals."""
    out = []
    for r in rows:
        w = max(len(label) for _, label in COMPONENTS) + 2
        lines = [
            f"{r.shape}, {r.dtype} ({r.detail}; {r.steps} steps measured)",
            f"{'component':<{w}}{'ms/step':>10}{'% of step':>11}",
            "-" * (w + 21),
        ]
        for key, label in COMPONENTS:
            lines.append(f"{label:<{w}}{r.ms[key]:>10.3f}{r.percent(key):>10.1f}%")
        lines.append("-" * (w + 21))
        lines.append(f"{'step, profiled (sum)':<{w}}{r.profiled_ms:>10.3f}{100.0:>10.1f}%")
        lines.append(
            f"{'step, without profiler':<{w}}{r.unprofiled_ms:>10.3f}   (profiler overhead {r.overhead_pct:+.1f}%)"
        )
        if r.gemm_gflops:
            from workbench.bench.peak import fraction_text

            lines.append(
                f"GEMMs: {r.gemm_flops / 1e9:.3f} GFLOP a step at {r.gemm_gflops:.1f} GFLOP/s "
                f"({fraction_text(r.gemm_gflops, r.peak_gflops)} of peak); over the whole step "
                f"{r.step_gflops:.1f} GFLOP/s ({fraction_text(r.step_gflops, r.peak_gflops)} of peak)"
                + (f"; peak {r.peak_gflops:.1f} GFLOP/s (`workbench bench peak`)" if r.peak_gflops else "")
            )
        out.append("\n".join(lines))
    return "\n\n".join(out)


def format_engine_split(s: EngineSplit) -> str:
    step = s.step_ms
    pct = lambda v: 100.0 * v / step if step > 0 else 0.0  # noqa: E731
    lines = [
        f"engine split: scheduler decode step, {s.dtype}, {s.batch} requests "
        f"(mean of {s.decode_steps} decode steps, from the trace's batch.step events)",
        f"{'part':<50}{'ms/step':>10}{'% of step':>11}",
        "-" * 71,
    ]
    for label, v in (
        ("schedule (pick batch, prepare_for_decode)", s.schedule_ms),
        ("forward + sample (TpModelWorker)", s.forward_ms),
        ("rest (process result, stream out, recv, trace)", s.rest_ms),
    ):
        lines.append(f"{label:<50}{v:>10.3f}{pct(v):>10.1f}%")
    lines.append("-" * 71)
    lines.append(f"{'step':<50}{step:>10.3f}{100.0:>10.1f}%")
    lines.append(f"{'  of which tracing (spread over the parts)':<50}{s.trace_ms:>10.3f}{pct(s.trace_ms):>10.1f}%")
    lines.append(f"CPU time per output token ({s.output_tokens} tokens in {s.wall_s:.2f} s wall):")
    for role, ms in s.cpu_ms_per_token.items():
        lines.append(f"  {role:<48}{ms:>10.3f} ms")
    lines.append(
        "  (/proc counts CPU in 10 ms ticks: short runs read coarse; scheduler CPU includes its OpenMP threads)"
    )
    return "\n".join(lines)


def cli_main(args: argparse.Namespace) -> int:
    """Print the profile (and write it with --json); called from `bench model --profile`."""
    import json
    from dataclasses import asdict

    rows, split = run_profile(args)
    print(format_profile(rows))
    if split is not None:
        print()
        print(format_engine_split(split))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "profile_rows": [asdict(r) for r in rows],
                    "engine_split": asdict(split) if split else None,
                    "components": dict(COMPONENTS),
                    "environment": environment(),
                    "quick": bool(args.quick),
                },
                f,
                indent=2,
            )
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
