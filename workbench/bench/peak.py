"""`workbench bench peak`: this machine's arithmetic peak and read bandwidth, and the yardstick the
throughput tables measure their GEMMs against.

The probe itself is core/layers/cpu_ops/peak.py (register-only loops in peak_probe.c, compiled at first
use): fp32 FMA GFLOP/s (AVX-512 or AVX2 + FMA, by /proc/cpuinfo's flags), the bf16 dot product
(vdpbf16ps) where AVX512_BF16 exists, AMX bf16 tiles where present, on one core and on all the cores
in use, and a streaming read's GB/s with and without transparent huge pages. Compute figures are
timed by each thread's own CPU time (a neighbour's load does not lower them; the wall clock would).

The tables of `bench engine` (transformers and vLLM peers) and `bench model` (and `--profile`) print
their GEMM GFLOP/s (the linears' FLOPs, from the model's shapes and the tokens processed, over the
measured time) as a fraction of the peak for their dtype and threads, beside their ratio against
the peer. They reuse this machine's cached probe (`Peak`, keyed by CPU model and flags, 6 h).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from workbench.bench.harness import progress


def get_peak(threads: int | None = None, fresh: bool = False, quiet: bool = False):
    """This machine's `Peak` (cached per machine), or None after saying why it cannot be measured."""
    from workbench.core.layers.cpu_ops import peak as probe

    try:
        return probe.peak(threads, fresh=fresh, progress=None if quiet else (lambda t: progress(f"peak probe: {t}")))
    except RuntimeError as exc:
        if not quiet:
            progress(f"no peak figures: {exc}")
        return None


def peak_gflops(peak, dtype: str, threads: int | None = None) -> float | None:
    """The compute peak a GEMM of `dtype` on `threads` threads can use here (None without a probe)."""
    if peak is None:
        return None
    value = peak.compute_peak(dtype, threads)
    return value or None


def fraction_text(gflops: float | None, peak_gflops_: float | None) -> str:
    """`gflops` as a share of the peak, "37%"; "-" where either is unknown."""
    if not gflops or not peak_gflops_:
        return "-"
    return f"{gflops / peak_gflops_:.0%}"


def gemm_text(gflops: float | None, peak_gflops_: float | None) -> str:
    """ "123.4 (37%)": GEMM GFLOP/s and its share of the peak; "-" without a figure."""
    if not gflops:
        return "-"
    return f"{gflops:.1f} ({fraction_text(gflops, peak_gflops_)})"


def peak_note(peak, dtype_threads: list[tuple[str, int | None]] | None = None) -> str:
    """One line for under a table: which peak the fractions are of, with the CPU and the load."""
    if peak is None:
        return "peak: not measured here (`workbench bench peak` says why)"
    parts = []
    for dtype, threads in dtype_threads or [("float32", None)]:
        t = peak.cores if threads is None else threads
        parts.append(f"{dtype} on {t} thread(s) {peak.compute_peak(dtype, t):.1f}")
    return (
        "% of peak: the linears' GFLOP/s (FLOPs from the model's shapes x tokens processed, over the measured time) "
        f"over the peak GFLOP/s ({', '.join(parts)}; `workbench bench peak`), measured on {peak.where()}"
    )


def format_peak(peak) -> str:
    """The probe's figures as a Markdown table, with the CPU and load under it."""

    def num(v: float | None, unit: str = "") -> str:
        return f"{v:.1f}{unit}" if v else "-"

    rows = [
        ("fp32 FMA, GFLOP/s", num(peak.fp32_core), num(peak.fp32_all), peak.isa),
        (
            "bf16 dot product (vdpbf16ps), GFLOP/s",
            num(peak.bf16_dp_core),
            num(peak.bf16_dp_all),
            peak.bf16_note or "AVX512_BF16",
        ),
        ("AMX bf16 tiles, GFLOP/s", num(peak.amx_core), num(peak.amx_all), peak.amx_note or "amx_bf16"),
    ]
    huge_note = f"THP {peak.thp_mode}" + (
        f", {peak.huge_pages_mib:.0f} of {peak.buffer_mib} MiB on huge pages" if peak.huge_pages_mib is not None else ""
    )
    for key, label in (("huge", "huge pages (madvise)"), ("small", "4 KiB pages (MADV_NOHUGEPAGE)")):
        wall = peak.read_all_wall.get(key)
        rows.append(
            (
                f"read bandwidth, {label}, GB/s",
                num(peak.read_core.get(key)),
                num(peak.read_all.get(key)),
                f"{peak.buffer_mib} MiB streamed; all cores by the wall clock {num(wall)}"
                + (f"; {huge_note}" if key == "huge" else ""),
            )
        )
    header = ["figure", "one core", f"{peak.cores} cores in use", "note"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines.append("")
    lines.append(
        f"measured on {peak.where()}, in {peak.probe_seconds:.1f} s; compute and read figures by each "
        "thread's own CPU time (best of short runs), so a neighbour's load does not lower them"
    )
    return "\n".join(lines)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `peak` on `bench`'s subparsers."""
    p = subparsers.add_parser(
        "peak",
        help="this machine's fp32 FMA / bf16 / AMX GFLOP/s and read bandwidth (the GEMM tables' yardstick)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="the cores in use for the 'all cores' figures (default: every CPU this process may run on)",
    )
    p.add_argument(
        "--cached",
        action="store_true",
        help="print this machine's cached figures if fresh (under 6 h) instead of measuring again",
    )
    p.add_argument("--json", metavar="PATH", default=None, help="also write the figures as JSON")
    p.set_defaults(func=cmd_bench_peak)
    return p


def cmd_bench_peak(args: argparse.Namespace) -> int:
    """`workbench bench peak`: measure (the result is cached for the other benches), print, exit 0;
    1 where the probe cannot run here."""
    peak = get_peak(getattr(args, "threads", None), fresh=not getattr(args, "cached", False))
    if peak is None:
        print(
            "workbench: the peak probe needs a C compiler (cc, or $CC) and an x86-64 CPU with AVX2 + FMA",
            file=sys.stderr,
        )
        return 1
    print(format_peak(peak))
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(asdict(peak), f, indent=2)
    return 0
