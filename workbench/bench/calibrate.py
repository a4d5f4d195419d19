"""`workbench bench calibrate` and `workbench bench sim-accuracy` (issue #19).

calibrate: the real Engine on a grid of pass shapes, each whole-step time measured beside the cost
model's prediction, written as a calibration file (core/simulation/calibration.py):
- decode batches of 1 to 64 requests at contexts of 64 and 512 tokens: each request's time from its
  first token to its last over the steps between (`_decode_step`), the smaller of two runs;
- prompts of 32 to 2048 tokens, one request: the time to its first token.
- the trip through the tokenizer manager and detokenizer (a burst of one-token requests sent at
  once, read off the trace): when requests reach the scheduler and when tokens reach the client.

sim-accuracy: the engine benchmark's workloads run on the real Engine and in the simulator (the
same lengths, the same shared prefixes, the same arrival times) in one command, side by side:
(i) 32 mixed prompts at once, (ii) 32 sharing a 512-token prefix, and two Poisson streams.

Both time a probe (`_probe`: the same small burst) beside their runs. On a shared host the machine's
speed drifts by more than 15% over minutes; the probe now against the probe when the calibration was
measured says how fast the machine runs in this command, and sim-accuracy also prints the simulator
at that speed (`Simulator(scale=...)`), as a benchmark compares two engines measured in one run.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import statistics
import time
from pathlib import Path

from workbench.bench.harness import load_text, progress
from workbench.bench.prompts import build_workloads, random_ids

NEW_DECODE = 24
# Prefill batches of several prompts (count, tokens each), beside the single prompts; each fits one
# step of the CPU's default chunked prefill (2,048 tokens).
PREFILL_BATCHES = [(4, 512), (8, 128), (16, 128), (32, 64)]


def _gen(engine, prompts: list[list[int]], new: int) -> float:
    engine.flush_cache()
    sp = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=sp)
    return time.perf_counter() - t0


def _decode_step(engine, prompts: list[list[int]], new: int) -> float:
    """One decode step's time with every request of `prompts` decoding: from the requests' own
    `meta_info`, (e2e_latency - ttft) / (new - 1) of those prefilled last (the others' windows hold
    steps where some were still prefilling), the median. Timing the whole run and subtracting a
    one-token run instead, as this did before, mixed in whether the prompts were prefilled in one
    step or two, and a long prefill's noise swamped the steps: batch 32 at context 512 read 73 ms in one
    calibration and 8.9 ms in the next."""
    engine.flush_cache()
    sp = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
    metas = [o["meta_info"] for o in engine.generate(input_ids=prompts, sampling_params=sp)]
    last = max(m["ttft"] for m in metas)
    return statistics.median((m["e2e_latency"] - m["ttft"]) / (new - 1) for m in metas if m["ttft"] >= last - 1e-4)


def _prefill_parts(cost, events: list) -> tuple[tuple[float, float, float], int]:
    """The cost model's (linear + comm, attention, overhead) summed over the prefill steps in `events`,
    and how many there were."""
    from workbench.core.trace import events as ev

    lin = att = over = 0.0
    steps = [e for e in events if isinstance(e, ev.BatchStep) and e.mode == "extend"]
    for step in steps:
        c = cost.step([r.computed for r in step.reqs], [r.cached + r.computed for r in step.reqs])
        lin, att, over = lin + c.linear + c.comm, att + c.attention, over + c.overhead
    return (lin, att, over), len(steps)


def _trip(engine, sub, prompts: list[list[int]]) -> dict:
    """The trip through the tokenizer manager and the detokenizer, from the trace of a burst of
    one-token requests sent at once by as many client threads (as `sim-accuracy` sends them):
    tm_gap_s, the spacing at which the tokenizer manager hands requests to the scheduler (its
    req.tokenized events, one loop in turn); tm_in_s, from that hand-over to the scheduler's
    req.queued for the first one (which finds the scheduler idle); tm_out_s, the median time from a
    prefill step's batch.step to the tokenizer manager's req.first_token of a request it finished."""
    from workbench.core.trace import events as ev
    from workbench.core.trace.bus import drain_settled

    engine.flush_cache()
    drain_settled(sub)
    sp = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    with cf.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        list(pool.map(lambda p: engine.generate(input_ids=p, sampling_params=sp), prompts))
    events = drain_settled(sub)
    handed = {e.rid: e.ts for e in events if isinstance(e, ev.ReqTokenized)}
    queued = {e.rid: e.ts for e in events if isinstance(e, ev.ReqQueued)}
    first = {e.rid: e.ts for e in events if isinstance(e, ev.ReqFirstToken)}
    outs = [
        (first[r.rid] - e.ts) / 1e9
        for e in events
        if isinstance(e, ev.BatchStep) and e.mode == "extend"
        for r in e.reqs
        if r.rid in first
    ]
    if len(handed) < 2 or not queued or not outs:
        return {}
    lead = min(queued, key=queued.get)
    times = sorted(handed.values())
    return dict(
        tm_in_s=max(0.0, (queued[lead] - handed.get(lead, queued[lead])) / 1e9),
        tm_gap_s=(times[-1] - times[0]) / 1e9 / (len(times) - 1),
        tm_out_s=max(0.0, statistics.median(outs)),
    )


def _prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return random_ids(rng, n, length, 10, vocab - 10)


PROBE = (8, 128, 8)  # requests, prompt tokens, new tokens: a burst of about a second here


def _probe(engine) -> float:
    """Wall seconds of one fixed burst (PROBE: a prefill of 8 prompts, then decode at batch 8), the
    faster of two: how fast this machine runs the engine right now."""
    n, length, new = PROBE
    prompts = _prompts(random.Random(7), n, length, len(engine.tokenizer))
    return min(_gen(engine, prompts, new) for _ in range(2))


def _sim_name(engine, given) -> str:
    from workbench.core.model_loader.resolve import DEFAULT_MODEL_FILE

    if given:
        return given
    path = str(engine.model_path)
    return "smollm2-135m" if path.endswith(DEFAULT_MODEL_FILE) or "SmolLM2-135M" in path else path


def run_calibrate(args) -> int:
    from workbench.core.args import ServerArgs
    from workbench.core.engine import Engine
    from workbench.core.simulation.calibration import Calibration, extend_point, local_path, machine, shipped_path
    from workbench.core.simulation.cost_model import CostModel
    from workbench.core.simulation.hardware import get_hardware
    from workbench.core.simulation.model_specs import model_spec
    from workbench.core.trace.bus import drain_settled

    args.simulate = args.simulate or "cpu-here"  # here --simulate names the hardware entry being measured
    sa = ServerArgs.from_cli_args(args).replace(show_progress=False, simulate=None)  # ... on the real engine
    batches = (1, 4) if args.quick else (1, 4, 16, 32, 64)
    contexts = (16,) if args.quick else (64, 512)
    prompt_lens = (32, 128) if args.quick else (32, 128, 512, 2048)
    rng = random.Random(0)
    loads = [load_text(2)]
    with Engine(server_args=sa) as engine:
        name = _sim_name(engine, args.sim_model)
        spec = model_spec(name if name != str(engine.model_path) else str(engine.prepared.model_dir))
        dtype_bytes = 4 if "float32" in str(engine.scheduler_info.get("dtype", "float32")) else 2
        hw = get_hardware(args.simulate)
        cost = CostModel(spec, hw, 1, dtype_bytes)
        vocab = spec.vocab
        probes = [_probe(engine)]  # the machine's speed at the start, middle and end
        points = []
        for b in batches:
            for c in contexts:
                ps = _prompts(rng, b, c, vocab)
                if b * (c + NEW_DECODE) > engine.max_total_num_tokens or b > engine.server_args.max_running_requests:
                    # Not all of them fit in the KV pool (or the batch) at once: the step would be a smaller one.
                    progress(f"decode batch {b}, context {c}: skipped, {b} x {c + NEW_DECODE} tokens do not fit")
                    continue
                t = max(min(_decode_step(engine, ps, NEW_DECODE) for _ in range(2)), 1e-5)
                pred = cost.step([1] * b, [c + NEW_DECODE // 2] * b).total
                points.append(dict(kind="decode", batch=b, context=c, measured_s=t, predicted_s=pred))
                progress(f"decode batch {b}, context {c}: {1000 * t:.1f} ms/step (predicted {1000 * pred:.1f})")
        probes.append(_probe(engine))
        # Prefill: single prompts, and batches of shorter ones of as many tokens in all (attention
        # differs; Calibration.extend_fit separates it from the linear layers by their parts).
        # The prediction is summed over the prefill steps the trace shows the engine ran: prompts sent
        # together are not always one step (the first often arrives alone and is prefilled by itself).
        sub = engine.subscribe(with_snapshot=False)
        try:
            for b, n in [(1, n) for n in prompt_lens] + ([(2, 64), (4, 32)] if args.quick else PREFILL_BATCHES):
                ps = _prompts(rng, b, n, vocab)
                runs = []
                for _ in range(2):
                    drain_settled(sub)
                    t = _gen(engine, ps, 1)
                    runs.append((t, _prefill_parts(cost, drain_settled(sub))))
                t, (parts, steps) = min(runs, key=lambda r: r[0])
                points.append(extend_point(b, n, t, parts, steps))
                progress(
                    f"prefill {b} x {n} tokens in {steps} step(s): {1000 * t:.1f} ms to the first token "
                    f"(predicted {1000 * sum(parts):.1f})"
                )
            trip = _trip(engine, sub, _prompts(rng, 4 if args.quick else 32, 16, vocab))
            progress(
                "the trip through the tokenizer manager: "
                + ", ".join(f"{k} {1000 * v:.2f} ms" for k, v in trip.items())
            )
        finally:
            sub.close()
        probes.append(_probe(engine))
        progress(f"probe ({PROBE[0]} x {PROBE[1]} tokens, {PROBE[2]} new): " + ", ".join(f"{t:.3f}" for t in probes))
        loads.append(load_text(2))
        meta = dict(
            **trip,
            **machine(dtype_bytes),  # which machine this describes: for_this_machine checks it where it is used
            probe_s=statistics.median(probes),
            dtype_bytes=dtype_bytes,
            threads=engine.scheduler_info.get("threads", ""),
            load=" -> ".join(loads),
            measured_at=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        )
    cal = Calibration(hw.name, spec.name, points, meta)
    # By default this machine's own calibration, where the simulator looks first (for_this_machine).
    out = args.out or (shipped_path(hw.name, spec.name) if args.install else local_path(hw.name, spec.name))
    print(f"calibration of {spec.name} on {hw.name} (load {meta['load']}):")
    print("| pass | measured ms | predicted ms | measured / predicted |\n|---|---|---|---|")
    for p in points:
        what = (
            f"decode bs {p['batch']} ctx {p['context']}"
            if p["kind"] == "decode"
            else f"prefill {p['batch']} x {p['context']}"
        )
        print(
            f"| {what} | {1000 * p['measured_s']:.1f} | {1000 * p['predicted_s']:.1f} | "
            f"{p['measured_s'] / p['predicted_s']:.2f} |"
        )
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    cal.save(out)
    print(
        f"written to {out}"
        + (
            " (this machine's calibration: the simulator uses it from now on)"
            if not args.out and not args.install
            else ""
        )
    )
    return 0


# ---- accuracy ---------------------------------------------------------------------------------
def _real_stream(engine, prompts: list[list[int]], news: list[int], arrivals: list[float]) -> dict:
    """Submit each request at its arrival time (threads); returns throughput and TTFT p50."""
    engine.flush_cache()
    t0 = time.perf_counter() + 0.05

    def one(i):
        delay = t0 + arrivals[i] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        sp = {"max_new_tokens": news[i], "temperature": 0.0, "ignore_eos": True}
        out = engine.generate(input_ids=prompts[i], sampling_params=sp)
        return out["meta_info"], time.perf_counter()

    with cf.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        results = list(pool.map(one, range(len(prompts))))
    end = max(t for _, t in results)
    tokens = sum(m["completion_tokens"] for m, _ in results)
    return {"tok_s": tokens / (end - t0), "ttft_p50": statistics.median(m["ttft"] for m, _ in results)}


def run_sim_accuracy(args) -> int:
    from workbench.core.args import ServerArgs
    from workbench.core.engine import Engine
    from workbench.core.simulation.calibration import Calibration, for_this_machine
    from workbench.core.simulation.simulator import SimRequest, Simulator

    args.simulate = args.simulate or "cpu-here"  # here --simulate names the hardware entry being measured
    sa = ServerArgs.from_cli_args(args).replace(show_progress=False, simulate=None)  # ... on the real engine
    rows = []
    loads = [load_text(2)]
    with Engine(server_args=sa) as engine:
        name = _sim_name(engine, args.sim_model)
        wl = {w.key: w for w in build_workloads(engine.tokenizer, args.quick)}
        rng = random.Random(1)
        n_stream = 8 if args.quick else 32
        stream_prompts = [p for p in wl["i"].prompts][:n_stream]
        cases = [
            (wl["i"].label + ", at once", wl["i"].prompts, [wl["i"].new_tokens] * len(wl["i"].prompts), None, 0),
            (
                wl["ii"].label + ", at once",
                wl["ii"].prompts,
                [wl["ii"].new_tokens] * len(wl["ii"].prompts),
                None,
                0,
            ),
        ]
        for rate in (args.rates or "0.5,2").split(","):
            r = float(rate)
            t, arr = 0.0, []
            for _ in stream_prompts:
                t += rng.expovariate(r)
                arr.append(t)
            cases.append(
                (f"Poisson {r:g}/s, {len(stream_prompts)} requests", stream_prompts, [64] * len(stream_prompts), arr, 0)
            )
        # Warm the engine first, as the calibration's passes are measured warm: the first burst after start-up
        # pays for its shapes once (its first prefill took 2.4x its later ones here), which no run repeats.
        progress("real engine: warming up on (i) (not measured)")
        _real_stream(engine, wl["i"].prompts, [8] * len(wl["i"].prompts), [0.0] * len(wl["i"].prompts))
        # The real engine's figures move by up to +-30% from one run to the next on a shared machine: each
        # case runs --repeats times, the cases interleaved (all once, then all again), and the simulator is
        # compared with the median, the spread printed beside it. The machine's speed drifts as much over
        # minutes, so each run is preceded by the probe the calibration also timed: their ratio is how fast
        # the machine ran this case against when it was calibrated, and the simulator is also run at it.
        choice = None if args.calibration else for_this_machine(args.simulate, name)
        cal = Calibration.load(args.calibration) if args.calibration else choice.calibration
        if choice is not None and choice.warning:
            progress(choice.warning)
        probe_then = cal.meta.get("probe_s") if cal is not None else None
        repeats = max(1, args.repeats)
        runs: dict[str, list[dict]] = {label: [] for label, *_ in cases}
        probes: dict[str, list[float]] = {label: [] for label, *_ in cases}
        for k in range(repeats):
            for label, prompts, news, arrivals, _ in cases:
                progress(f"real engine: {label} (run {k + 1} of {repeats})")
                probes[label].append(_probe(engine))
                runs[label].append(_real_stream(engine, prompts, news, arrivals or [0.0] * len(prompts)))
                loads.append(load_text(2))
        for label, prompts, news, arrivals, _ in cases:
            real = {key: statistics.median(r[key] for r in runs[label]) for key in ("tok_s", "ttft_p50")}
            lo = {key: min(r[key] for r in runs[label]) for key in real}
            hi = {key: max(r[key] for r in runs[label]) for key in real}
            ranges = (
                f"{lo['tok_s']:.0f}-{hi['tok_s']:.0f}",
                f"{1000 * lo['ttft_p50']:.0f}-{1000 * hi['ttft_p50']:.0f}",
            )
            own = max(hi[key] / lo[key] for key in real)  # how far apart the real engine's own runs were
            shared = 512 if label.startswith("(ii)") and not args.quick else (64 if label.startswith("(ii)") else 0)
            work = [
                SimRequest((arrivals or [0.0] * len(prompts))[i], len(p), news[i], 0 if shared else None, shared)
                for i, p in enumerate(prompts)
            ]

            def simulate(scale: float) -> dict:
                return (
                    Simulator(
                        name,
                        args.simulate,
                        calibration=cal,
                        scale=scale,
                        max_running_requests=sa.max_running_requests,
                        chunked_prefill_size=sa.resolved_chunked_prefill_size() or -1,
                    )
                    .run(work)
                    .metrics()
                )

            m = simulate(1.0)
            speed = statistics.median(probes[label]) / probe_then if probe_then else None
            at_speed = simulate(speed) if speed else None
            rows.append(
                (label, real["tok_s"], m["output_tok_s"], 1000 * real["ttft_p50"], m["ttft_p50_ms"], ranges, own)
                + ((speed, at_speed["output_tok_s"], at_speed["ttft_p50_ms"]) if speed else (None, None, None))
            )
    what = f"the median of {repeats} runs (their range beside it)" if repeats > 1 else "one run"
    print(
        f"\nsimulator ({args.simulate}, {name}, {args.calibration or _calibration_text(choice)}) against the real engine "
        f"in the same command, {what}; load {' -> '.join(loads)}"
    )
    several, paced = repeats > 1, probe_then is not None
    print(
        "| workload | real out tok/s | simulated | sim / real | real TTFT p50 ms | simulated | sim / real | within 15% |"
        + (" machine's pace (probe now / then) | sim / real at that pace (tok/s, TTFT) | within 15% |" if paced else "")
        + (" real runs' own spread (max / min) |" if several else "")
        + "\n"
        + "|---" * (8 + 3 * paced + several)
        + "|"
    )
    close = {"as calibrated": 0, "at the pace": 0}  # figures within 15%
    for label, rt, st, rf, sf, (tok_range, ttft_range), own, speed, pt, pf in rows:
        near = [abs(st / rt - 1) <= 0.15, abs(sf / rf - 1) <= 0.15]
        close["as calibrated"] += sum(near)
        rt_s, rf_s = (f"{rt:.1f} ({tok_range})", f"{rf:.0f} ({ttft_range})") if several else (f"{rt:.1f}", f"{rf:.0f}")
        line = f"| {label} | {rt_s} | {st:.1f} | {st / rt:.2f} | {rf_s} | {sf:.0f} | {sf / rf:.2f} | {_yes(near)} |"
        if paced:
            near_pace = [abs(pt / rt - 1) <= 0.15, abs(pf / rf - 1) <= 0.15]
            close["at the pace"] += sum(near_pace)
            line += f" {speed:.2f} | {pt / rt:.2f}, {pf / rf:.2f} | {_yes(near_pace)} |"
        if several:
            line += f" {own:.2f} |"
        print(line)
    summary = f"within 15%: {close['as calibrated']} of {2 * len(rows)} figures as calibrated"
    if paced:
        summary += (
            f", {close['at the pace']} at the machine's pace in this command (the probe, timed before each run, "
            f"against its {probe_then:.3f} s when the calibration was measured)"
        )
    else:
        summary += "; the calibration has no probe time (made before it was timed): recalibrate to see the pace"
    print(summary)
    return 0


def _yes(flags: list[bool]) -> str:
    return "yes" if all(flags) else "no"


def _calibration_text(choice) -> str:
    """Which calibration sim-accuracy used, and why it may not fit this machine."""
    if choice is None or choice.calibration is None:
        return "no calibration"
    text = f"the {choice.source} calibration" if choice.source == "shipped" else "this machine's calibration"
    return text + (" -- NOT measured on this machine, see the warning above" if choice.warning else "")


def add_parsers(bench_sub) -> None:
    from workbench.core.args import ServerArgs

    for name, func, text in (
        ("calibrate", run_calibrate, "measure the real engine's step times for the simulator's cost model"),
        ("sim-accuracy", run_sim_accuracy, "the simulator against the real engine on the same workloads"),
    ):
        p = bench_sub.add_parser(name, help=text)
        ServerArgs.add_cli_args(p)  # its --simulate names the hardware entry this machine is (default cpu-here)
        p.add_argument("--sim-model", default=None, help="the model's name in the simulator (default: from --model)")
        p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
        p.set_defaults(func=func)
        if name == "calibrate":
            p.add_argument(
                "--out",
                default=None,
                help="write the calibration JSON here (default: this machine's cache, $WORKBENCH_CACHE_DIR/"
                "calibrations, where --simulate cpu-here looks first)",
            )
            p.add_argument(
                "--install", action="store_true", help="write it where the simulator looks (core/simulation/data)"
            )
        else:
            p.add_argument(
                "--rates", default=None, help="Poisson arrival rates per second, comma-separated (default 0.5,2)"
            )
            p.add_argument(
                "--calibration",
                default=None,
                help="a calibration file (`bench calibrate --out FILE`) in place of the shipped one",
            )
            p.add_argument(
                "--repeats",
                type=int,
                default=3,
                help="runs of each workload on the real engine, interleaved; the simulator is compared with their "
                "median (default 3; 1 for a quick look)",
            )


__all__ = ["add_parsers", "run_calibrate", "run_sim_accuracy"]
