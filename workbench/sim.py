"""`workbench sim run` and `workbench sim sweep`: the real scheduler over a cost model (issue #19).

    workbench sim run --model llama-3.1-70b --simulate h100 --tp-size 8 --rate 20 --num-requests 2000
    workbench sim run --live --model llama-3.1-70b --simulate h100 --tp-size 8 --rate 20 --compare
    workbench sim sweep --model llama-3.1-8b --simulate h100 --rate 30 \\
        --vary schedule_policy=fcfs,lpm --vary chunked_prefill_size=2048,8192

Workloads: a Poisson stream (--rate, --num-requests, --prompt-len, --output-len, --groups and
--prefix-len for shared prefixes), or --workload FILE, a JSONL of {"arrival", "prompt_tokens",
"output_tokens", optional "group", "prefix_tokens" and "priority"}, or a real engine's recording (`--record`:
its finished requests' arrivals and lengths, core/simulation/recorded.py), or a production trace
(Mooncake's JSONL, Azure's LLM inference CSV, BurstGPT's CSV: workbench/traces.py), detected from the
file or named by --workload-format, cut by --start/--duration/--sample/--max-requests and paced by
--time-scale. With --priority-mix (or a workload's priority column and --enable-priority-scheduling)
the scheduler admits and preempts by priority and the summary gives TTFT per priority.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

from workbench.core.simulation.hardware import HARDWARE
from workbench.core.simulation.model_specs import KNOWN, model_spec
from workbench.core.simulation.pd import PDSimulator, parse_pd
from workbench.core.simulation.recorded import recorded_speculation
from workbench.core.simulation.simulator import (
    SimRequest,
    Simulator,
    parse_priority_mix,
    poisson_workload,
    request_prompt,
)
from workbench.traces import FORMATS, TraceCut, WorkloadError, drawn_prompts, fit_vocab, read_workload

COLUMNS = (
    ("output_tok_s", "out tok/s", "{:.0f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
    ("tpot_p50_ms", "TPOT p50 ms", "{:.1f}"),
    ("tpot_p99_ms", "TPOT p99 ms", "{:.1f}"),
    ("cache_hit_rate", "cache hit", "{:.0%}"),
    ("peak_kv_frac", "peak KV", "{:.0%}"),
    ("retracted", "retracted", "{}"),
)


def _pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def _trace_cut(args) -> TraceCut | None:
    """The cut and pace asked of --workload (None: the Poisson stream, which takes none)."""
    given = {
        "--workload-format": args.workload_format != "auto",
        "--time-scale": args.time_scale != 1.0,
        "--max-requests": args.max_requests is not None,
        "--start": args.start != 0.0,
        "--duration": args.duration is not None,
        "--sample": args.sample is not None,
    }
    if not args.workload:
        flags = [flag for flag, on in given.items() if on]
        if flags:
            raise SystemExit(
                f"{', '.join(flags)}: for a --workload FILE (a trace to cut or pace); the Poisson stream takes "
                "--rate and --num-requests"
            )
        return None
    checks = (
        (args.time_scale <= 0, f"--time-scale {args.time_scale:g}: a factor above 0 (0.5: twice as fast)"),
        (args.max_requests is not None and args.max_requests < 1, "--max-requests: 1 or more"),
        (args.start < 0, "--start: seconds of the trace from its first request, 0 or more"),
        (args.duration is not None and args.duration <= 0, "--duration: seconds above 0"),
        (args.sample is not None and not 0 < args.sample <= 1, "--sample: a fraction in (0, 1], e.g. 0.1"),
    )
    for bad, text in checks:
        if bad:
            raise SystemExit(text)
    return TraceCut(args.start, args.duration, args.sample, args.max_requests, args.time_scale, seed=args.seed)


def load_workload(args) -> list[SimRequest]:
    """The workload: --workload FILE in any format traces.py reads (cut and paced by the trace flags),
    else the Poisson stream."""
    cut = _trace_cut(args)
    if cut is not None:
        try:
            loaded = read_workload(args.workload, args.workload_format, cut, seed=args.seed)
        except WorkloadError as exc:
            raise SystemExit(str(exc)) from None
        workload = loaded.requests
        if loaded.format == "recording":
            _recorded_drafts(args, workload)
        if loaded.format not in ("workbench", "recording") or cut.describe() or cut.time_scale != 1.0:
            scale = f", --time-scale {cut.time_scale:g}" if cut.time_scale != 1.0 else ""
            print(f"[sim] {loaded.summary(args.workload)}{scale}", file=sys.stderr)
        if drawn_prompts(workload):
            try:
                fit_vocab(workload, _spec(args).vocab)
            except ValueError:
                pass  # an unknown model: the simulator says so next
        return workload
    return poisson_workload(
        args.rate,
        args.num_requests,
        _pair(args.prompt_len),
        _pair(args.output_len),
        seed=args.seed,
        groups=args.groups,
        prefix_len=args.prefix_len,
        priority_mix=_priority_mix(args),
    )


def _priority_mix(args) -> list[tuple[int, float]] | None:
    if not args.priority_mix:
        return None
    try:
        return parse_priority_mix(args.priority_mix)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def _recorded_drafts(args, workload: list[SimRequest]) -> None:
    """A recording of a run with speculative decoding, with its token ids: its drafts are replayed
    (speculative decoding on, at the recording's drafts per step; requests without a recording of
    their own would keep drafts at its accept rate), unless --ignore-recorded-drafts."""
    if not any(r.drafts for r in workload):
        return
    if args.ignore_recorded_drafts:
        for r in workload:
            r.drafts = None
        return
    spec = recorded_speculation(args.workload)
    if args.speculative_accept_rate is None:
        args.speculative_accept_rate = round(spec.accept_rate, 4)
    args.speculative_num_draft_tokens = args.speculative_num_draft_tokens or spec.num_draft_tokens
    print(
        f"[sim] the recording ran {spec.algorithm} speculative decoding ({spec.accepted} of {spec.proposed} "
        f"drafts kept): its drafts are replayed, {args.speculative_num_draft_tokens} per step at most "
        "(--ignore-recorded-drafts to decode without them)",
        file=sys.stderr,
    )
    if spec.algorithm == "STANDALONE" and not args.speculative_draft_model:
        print(
            "[sim] the draft model's passes cost nothing: name it with --speculative-draft-model "
            "(a known model or its config.json) to cost them",
            file=sys.stderr,
        )


def _pd_shape(args, overrides: dict) -> tuple[int, int] | None:
    """(prefill replicas, decode replicas) when a PD deployment is asked for (--pd or the per-role
    flags), else None."""
    pd = overrides.pop("pd", args.pd)
    p = overrides.pop("prefill_replicas", args.prefill_replicas)
    d = overrides.pop("decode_replicas", args.decode_replicas)
    if pd:
        try:
            return parse_pd(pd)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    if p is None and d is None:
        return None
    return p or 1, d or 1


def _priority_and_hicache(args) -> dict:
    """The ServerArgs of --priority-mix / --enable-priority-scheduling and the HiCache flags (offline and --live)."""
    kw: dict = {}
    if args.enable_priority_scheduling or args.priority_mix:
        kw["enable_priority_scheduling"] = True
        kw["priority_scheduling_preemption_threshold"] = args.priority_scheduling_preemption_threshold
    if args.hicache_storage_backend and not args.enable_hierarchical_cache:
        raise SystemExit("--hicache-storage-backend is HiCache's storage tier: add --enable-hierarchical-cache")
    if args.enable_hierarchical_cache:
        kw.update(enable_hierarchical_cache=True, hicache_ratio=args.hicache_ratio)
        kw["hicache_write_policy"] = args.hicache_write_policy
        if args.hicache_storage_backend:
            kw["hicache_storage_backend"] = args.hicache_storage_backend
    return kw


def _simulator(args, **overrides) -> Simulator | PDSimulator:
    kw = dict(max_running_requests=args.max_running_requests, schedule_policy=args.schedule_policy)
    if args.chunked_prefill_size is not None:
        kw["chunked_prefill_size"] = args.chunked_prefill_size
    kw.update(_priority_and_hicache(args))
    kw.update(overrides)
    kw.setdefault("dp_size", args.dp_size)
    kw.setdefault("disable_overlap_schedule", not args.overlap_schedule)
    if args.speculative_accept_rate is not None:
        kw.setdefault("speculative_accept_rate", args.speculative_accept_rate)
        kw.setdefault("speculative_num_draft_tokens", args.speculative_num_draft_tokens or 4)
        if args.speculative_draft_model:
            kw.setdefault("speculative_draft_model", args.speculative_draft_model)
    kw.setdefault("load_balance_method", args.load_balance_method)
    sink = kw.pop("trace_sink", None)
    tp = int(kw.pop("tp_size", args.tp_size))
    hardware = kw.pop("simulate", args.simulate)
    shape = _pd_shape(args, kw)
    pd_kw = {k: kw.pop(k, getattr(args, k)) for k in PD_FLAGS}
    if shape is None:
        given = [f"--{k.replace('_', '-')}" for k, v in pd_kw.items() if v is not None]
        if given:
            raise SystemExit(f"{', '.join(given)}: for a PD deployment; add --pd xPyD (e.g. --pd 2P4D)")
        return Simulator(_spec(args), hardware, tp_size=tp, seed=args.seed, trace_sink=sink, **kw)
    if int(kw.pop("dp_size", 1)) > 1:
        raise SystemExit(
            "--dp-size: a PD deployment's replicas are --pd xPyD (or --prefill-replicas/--decode-replicas)"
        )
    if kw.get("speculative_accept_rate") is not None:
        raise SystemExit("--speculative-accept-rate: not simulated with --pd yet")
    try:
        return PDSimulator(
            _spec(args),
            hardware,
            prefill_replicas=shape[0],
            decode_replicas=shape[1],
            prefill_tp_size=int(pd_kw["prefill_tp_size"] or tp),
            decode_tp_size=int(pd_kw["decode_tp_size"] or tp),
            link_gbps=pd_kw["pd_link_gbps"],
            link_latency_us=pd_kw["pd_link_latency_us"],
            seed=args.seed,
            trace_sink=sink,
            **kw,
        )
    except ValueError as exc:
        raise SystemExit(f"workbench sim: {exc}") from None


# The PD flags besides the replica counts (PDSimulator's arguments; --vary takes them too).
PD_FLAGS = ("prefill_tp_size", "decode_tp_size", "pd_link_gbps", "pd_link_latency_us")


def _spec(args):
    """The simulated model's shapes: a known name, a config.json, or a Hub id's config.json fetched
    once at --revision into --download-dir (the simulator is handed the spec, so it does not fetch again)."""
    cached = getattr(args, "_model_spec", None)
    if cached is None:
        cached = model_spec(args.model, revision=args.revision, download_dir=args.download_dir)
        args._model_spec = cached
    return cached


def _deployment(args) -> str:
    shape = _pd_shape(args, {})
    if shape is not None:
        p, d = shape
        ptp, dtp = args.prefill_tp_size or args.tp_size, args.decode_tp_size or args.tp_size
        return f"{args.simulate} {p}P{d}D (prefill {p} x tp {ptp}, decode {d} x tp {dtp})"
    devices = f"{args.simulate}x{args.tp_size * args.dp_size}"
    return devices if args.dp_size == 1 else f"{devices} (dp {args.dp_size} x tp {args.tp_size})"


def _run_live(args, workload: list[SimRequest]) -> int:
    """`sim run --live`: the workload through a live simulated engine's whole pipeline (live.replay)."""
    from workbench.core.engine import Engine
    from workbench.core.simulation.live import replay

    kw = dict(max_running_requests=args.max_running_requests, schedule_policy=args.schedule_policy)
    if args.chunked_prefill_size is not None:
        kw["chunked_prefill_size"] = args.chunked_prefill_size
    if args.dp_size > 1:
        kw.update(dp_size=args.dp_size, load_balance_method=args.load_balance_method)
    if args.overlap_schedule:
        kw["disable_overlap_schedule"] = False
    if args.speculative_accept_rate is not None:  # the scheduler's own speculative path, drafts simulated
        kw.update(
            speculative_algorithm="STANDALONE" if args.speculative_draft_model else "NGRAM",
            speculative_draft_model_path=args.speculative_draft_model,
            speculative_accept_rate=args.speculative_accept_rate,
            speculative_num_draft_tokens=args.speculative_num_draft_tokens or 4,
        )
    kw.update(_priority_and_hicache(args))
    if args.record:
        kw["record"] = args.record
    last = {"at": 0.0}

    def progress(done, total, now):
        if done == total or time.monotonic() - last["at"] > 2.0:
            last["at"] = time.monotonic()
            print(f"[sim] {done}/{total} requests finished, {now:.1f} simulated s", file=sys.stderr, flush=True)

    try:
        engine = Engine(
            simulate=args.simulate,
            model_path=args.model,
            revision=args.revision,
            download_dir=args.download_dir,
            tp_size=args.tp_size,
            sim_speed=args.sim_speed,
            random_seed=args.seed,
            **kw,
        )
    except ValueError as exc:
        raise SystemExit(f"workbench sim run --live: {exc}") from None
    with engine:
        vocab = len(engine.tokenizer)  # the stand-in tokenizer's: the prompts must be ids it accepts
        fit_vocab(workload, vocab)
        for i, r in enumerate(workload):
            r.prompt_ids = request_prompt(i, r, args.seed, vocab)
        result = replay(engine, workload, seed=args.seed, progress=progress)
    print(f"{result.summary()} [live pipeline, --sim-speed {args.sim_speed:g}]")
    if args.record:
        print(f"trace (simulated time) in {args.record}: workbench replay {args.record}")
    if args.compare:
        offline = _simulator(args).run(workload)
        print(f"{offline.summary()} [offline Simulator]")
        worst = max((abs(result.ttft[k] - offline.ttft.get(k, float("inf"))) for k in result.ttft), default=0.0)
        print(f"largest per-request TTFT difference, live against offline: {worst * 1000:.3f} ms")
    return 0


def cmd_run(args) -> int:
    workload = load_workload(args)
    if args.live and _pd_shape(args, {}) is not None:
        raise SystemExit(
            "--live with --pd: not built; drop --live to run the PD deployment offline, or watch it live: "
            "workbench tui --disaggregation xPyD --simulate HW --model M --tp-size N (or two workbench serve "
            "--simulate ... --disaggregation-mode prefill|decode servers; docs/disaggregation.md)"
        )
    if args.live:
        return _run_live(args, workload)
    recorder = None
    if args.record:
        from workbench.core.trace.recorder import Recorder

        recorder = Recorder(args.record, model=f"SIMULATED {_deployment(args)} {args.model}")
    sim = _simulator(args, trace_sink=recorder) if recorder is not None else _simulator(args)

    def progress(done, total, now):
        print(f"[sim] {done}/{total} requests finished, {now:.1f} simulated s", file=sys.stderr, flush=True)

    try:
        result = sim.run(workload, progress=progress)
    finally:
        if recorder is not None:
            recorder.close()
    print(result.summary())
    if args.record:
        print(f"trace (simulated time) in {args.record}: workbench replay {args.record}")
    return 0


def _coerce(value: str):
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def cmd_sweep(args) -> int:
    grid = []
    for spec in args.vary:
        key, _, values = spec.partition("=")
        if not values:
            raise SystemExit(f"--vary {spec!r}: write KEY=V1,V2 (e.g. schedule_policy=fcfs,lpm)")
        grid.append([(key.strip().replace("-", "_"), _coerce(v)) for v in values.split(",")])
    workload = load_workload(args)
    rows = []
    for combo in itertools.product(*grid) if grid else [()]:
        overrides = dict(combo)
        label = ", ".join(f"{k}={v}" for k, v in combo) or "(as given)"
        print(f"[sim] {label} ...", file=sys.stderr, flush=True)
        result = _simulator(args, **overrides).run(workload)
        rows.append((label, result))
    first = rows[0][1]
    print(
        f"SIMULATED {first.deployment}, {first.model}, {len(workload)} requests "
        f"(simulated time; the scheduler is the real one)"
    )
    print("| setting | " + " | ".join(title for _, title, _ in COLUMNS) + " | real s |")
    print("|---" * (len(COLUMNS) + 2) + "|")
    for label, result in rows:
        m = result.metrics()
        cells = " | ".join(fmt.format(m[key]) for key, _, fmt in COLUMNS)
        print(f"| {label} | {cells} | {result.wall_s:.1f} |")
    if args.plot:
        plot_sweep(rows, args.plot, title=f"SIMULATED {first.deployment}, {first.model}, {len(workload)} requests")
        print(f"plot in {args.plot}")
    return 0


def plot_sweep(rows: list, path: str, title: str = "") -> None:
    """The sweep's figures as one HTML page of bar charts (plotly), one bar per setting."""
    try:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots
    except ImportError:
        raise SystemExit("--plot needs plotly: pip install -e '.[jupyter]' (or pip install plotly)") from None

    panels = (
        ("output tok/s", ("output_tok_s",)),
        ("TTFT ms", ("ttft_p50_ms", "ttft_p99_ms")),
        ("TPOT ms", ("tpot_p50_ms", "tpot_p99_ms")),
        ("cache hit / peak KV", ("cache_hit_rate", "peak_kv_frac")),
    )
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[name for name, _ in panels])
    labels = [label for label, _ in rows]
    for col, (_, keys) in enumerate(panels, 1):
        for key in keys:
            values = [result.metrics()[key] for _, result in rows]
            fig.add_trace(go.Bar(name=key, x=labels, y=values), row=1, col=col)
    fig.update_layout(title=title, barmode="group", height=480, width=420 * len(panels))
    fig.write_html(path, include_plotlyjs="cdn")


def add_parser(sub) -> None:
    p = sub.add_parser("sim", help="simulate a deployment: the real scheduler over a cost model")
    ssub = p.add_subparsers(dest="sim_command", metavar="ACTION")
    for name, func, text in (
        ("run", cmd_run, "run one workload and print throughput, TTFT, TPOT, cache hits, peak KV"),
        ("sweep", cmd_sweep, "run the workload once per combination of --vary values and print a table"),
    ):
        q = ssub.add_parser(name, help=text, description=text)
        q.add_argument(
            "--model",
            default="llama-3.1-8b",
            help=f"a known model ({', '.join(KNOWN)}), an HF config.json, or a Hub id ORG/NAME (its config.json only)",
        )
        q.add_argument("--revision", default=None, help="with a Hub id: the branch, tag or commit (default main)")
        q.add_argument(
            "--download-dir", default=None, help="with a Hub id: the cache to fetch into (default: huggingface_hub's)"
        )
        q.add_argument("--simulate", default="h100", choices=sorted(HARDWARE), help="the hardware simulated")
        q.add_argument("--tp-size", type=int, default=1, help="tensor-parallel devices per replica")
        q.add_argument(
            "--dp-size",
            type=int,
            default=1,
            help="data-parallel replicas, each of --tp-size devices, behind one router",
        )
        q.add_argument(
            "--load-balance-method",
            default="round_robin",
            choices=("round_robin", "shortest_queue", "prefix_aware"),
            help="how the data-parallel controller picks a replica for each request (with --dp-size > 1)",
        )
        q.add_argument(
            "--pd",
            default=None,
            metavar="xPyD",
            help="simulate disaggregated prefill/decode: x prefill and y decode replicas, e.g. 2P4D (each of "
            "--tp-size devices unless --prefill-tp-size/--decode-tp-size), KV over --pd-link-gbps links",
        )
        q.add_argument(
            "--prefill-replicas", type=int, default=None, help="PD: prefill replicas (what --pd xPyD's x says)"
        )
        q.add_argument("--decode-replicas", type=int, default=None, help="PD: decode replicas (--pd xPyD's y)")
        q.add_argument(
            "--prefill-tp-size", type=int, default=None, help="PD: devices per prefill replica (default --tp-size)"
        )
        q.add_argument(
            "--decode-tp-size", type=int, default=None, help="PD: devices per decode replica (default --tp-size)"
        )
        q.add_argument(
            "--pd-link-gbps",
            type=float,
            default=None,
            help="PD: gigabits/s of each device's link from prefill to decode (default the hardware's: 400 for "
            "h100/h200 InfiniBand NDR, 200 a100-80g HDR, 25 l4 Ethernet, 10 cpu-here TCP); a TP group moves "
            "its shards in parallel, one link per device of the smaller side",
        )
        q.add_argument(
            "--pd-link-latency-us",
            type=float,
            default=None,
            help="PD: fixed microseconds per KV transfer besides the bytes (default 10 over RDMA, 50 over TCP)",
        )
        q.add_argument("--schedule-policy", default="fcfs", help="the scheduler's admission order (fcfs, lpm, ...)")
        q.add_argument(
            "--overlap-schedule",
            action="store_true",
            help="run the scheduler's overlap loop (SGLang's default on GPUs): a step's host work hides behind "
            "the previous pass (sweep: --vary disable_overlap_schedule=true,false)",
        )
        q.add_argument("--chunked-prefill-size", type=int, default=None, help="prompt piece per step (default 8192)")
        q.add_argument("--max-running-requests", type=int, default=256, help="most requests decoding at once")
        q.add_argument(
            "--speculative-accept-rate",
            type=float,
            default=None,
            help="speculative decoding: the scheduler's verify path with drafts the target agrees with at this "
            "rate each (0-1); off when not given",
        )
        q.add_argument(
            "--speculative-num-draft-tokens",
            type=int,
            default=None,
            help="drafts per request per step (default 4; a recording's own with its drafts)",
        )
        q.add_argument(
            "--speculative-draft-model",
            default=None,
            help="STANDALONE: a draft model (a known name or an HF config.json) whose decode passes are costed "
            "before each verify pass and whose weights and KV share the memory (needs --speculative-accept-rate)",
        )
        q.add_argument(
            "--workload",
            default=None,
            help="a JSONL workload (see the module docstring), a real engine's --record file (its "
            "finished requests' arrivals and lengths; with --trace-token-ids: their tokens, and the "
            "speculative drafts of a run that drafted), or a production trace: Mooncake's JSONL, Azure's "
            "LLM inference CSV or BurstGPT's CSV (workbench/traces.py)",
        )
        q.add_argument(
            "--workload-format",
            default="auto",
            choices=FORMATS,
            help="the --workload file's format (auto: detected from its first line): workbench JSONL, a "
            "recording, Mooncake's trace JSONL, Azure's LLM inference trace CSV or BurstGPT's CSV",
        )
        q.add_argument(
            "--time-scale",
            type=float,
            default=1.0,
            help="multiply the --workload's arrivals by this (0.5: twice as fast, 2: half as fast)",
        )
        q.add_argument(
            "--max-requests", type=int, default=None, help="keep the --workload's first N requests (after the cut)"
        )
        q.add_argument(
            "--start",
            type=float,
            default=0.0,
            help="skip the --workload's first S seconds (seconds of the trace; the window starts at 0)",
        )
        q.add_argument("--duration", type=float, default=None, help="keep S seconds of the --workload from --start")
        q.add_argument(
            "--sample",
            type=float,
            default=None,
            help="keep this fraction of the --workload's requests (0-1), drawn by --seed",
        )
        q.add_argument(
            "--ignore-recorded-drafts",
            action="store_true",
            help="with a recording of a speculative run: decode without its drafts (speculative decoding "
            "off unless --speculative-accept-rate)",
        )
        q.add_argument(
            "--rate", type=float, default=10.0, help="Poisson arrivals per simulated second (0: all at once)"
        )
        q.add_argument("--num-requests", type=int, default=500, help="requests in the Poisson workload")
        q.add_argument("--prompt-len", default="128,1024", help="prompt tokens, uniform in LO,HI")
        q.add_argument("--output-len", default="64,256", help="output tokens, uniform in LO,HI")
        q.add_argument("--groups", type=int, default=0, help="shared-prefix groups (0: none)")
        q.add_argument("--prefix-len", type=int, default=0, help="tokens of each group's shared prefix")
        q.add_argument("--seed", type=int, default=0, help="seed of the workload and the sampled tokens")
        q.add_argument(
            "--priority-mix",
            default=None,
            help="priority scheduling: give the Poisson workload's requests priorities PRIORITY:SHARE,... "
            "(e.g. 10:0.2,0:0.8; turns on --enable-priority-scheduling); a --workload JSONL has a priority column",
        )
        q.add_argument(
            "--enable-priority-scheduling",
            action="store_true",
            help="admit by priority and let urgent requests preempt running ones (docs/scheduling.md)",
        )
        q.add_argument(
            "--priority-scheduling-preemption-threshold",
            type=int,
            default=10,
            help="with priority scheduling: preempt only for a priority more than this much more urgent",
        )
        q.add_argument(
            "--enable-hierarchical-cache",
            action="store_true",
            help="HiCache: a host-memory KV tier under the device pool; load-backs and backups are charged at the "
            "hardware's host-link bandwidth (docs/hicache.md)",
        )
        q.add_argument(
            "--hicache-ratio",
            type=float,
            default=2.0,
            help="with --enable-hierarchical-cache: host pool size as a multiple of the device KV pool (> 1)",
        )
        q.add_argument(
            "--hicache-write-policy",
            default="write_through",
            choices=["write_through", "write_back", "write_through_selective"],
            help="with --enable-hierarchical-cache: when device KV is copied to host",
        )
        q.add_argument(
            "--hicache-storage-backend",
            default=None,
            choices=["file"],
            help="with --enable-hierarchical-cache: a storage tier (L3) under the host pool, kept in memory for "
            "the run; prefetches from it are charged at the hardware's storage bandwidth (docs/hicache.md)",
        )
        if name == "run":
            q.add_argument(
                "--record",
                default=None,
                help="write the trace (simulated time) as JSONL: the scheduler's events and each request's arrival, "
                "first token and finish (workbench replay FILE shows it as a live run's)",
            )
            q.add_argument(
                "--live",
                action="store_true",
                help="run the workload through a live simulated engine (the real tokenizer manager, scheduler "
                "process and detokenizer, as `serve --simulate`), every stamp in simulated time",
            )
            q.add_argument(
                "--sim-speed",
                type=float,
                default=0.0,
                help="with --live: simulated seconds per wall second (0, the default: as fast as this host can)",
            )
            q.add_argument(
                "--compare",
                action="store_true",
                help="with --live: also run the offline Simulator on the same workload and print the largest "
                "per-request TTFT difference",
            )
        if name == "sweep":
            q.add_argument("--plot", default=None, help="also write the figures as an HTML page of bar charts (plotly)")
            q.add_argument(
                "--vary",
                action="append",
                default=[],
                help="KEY=V1,V2: a ServerArgs field, tp_size, dp_size, load_balance_method or simulate",
            )
        q.set_defaults(func=func)
    p.set_defaults(func=lambda a: p.print_help() or 2)


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="workbench")
    add_parser(parser.add_subparsers())
    a = parser.parse_args()
    raise SystemExit(a.func(a))
