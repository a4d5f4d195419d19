"""`workbench bench peak`: the probe measures positive figures in a couple of seconds, its result is
cached per machine (CPU model and flags), and the throughput tables print GEMM GFLOP/s as a share of
the peak. No speed is asserted: the machine is shared."""

from __future__ import annotations

import json
import time
from dataclasses import asdict

import pytest
from workbench.core.layers.cpu_ops import peak as probe

from workbench.bench import engine_bench, model_bench
from workbench.bench import peak as bench_peak


def _known_peak(**kw) -> probe.Peak:
    """A `Peak` of known figures, as this machine's (its key), measured now."""
    fields = dict(
        cpu_model="Test CPU",
        machine_key=probe.machine_key(),
        isa="AVX2 + FMA",
        cores=2,
        fp32_core=100.0,
        fp32_all=190.0,
        bf16_note="not on this CPU (no AVX512_BF16)",
        amx_note="absent (no amx_bf16 on this CPU)",
        read_core={"huge": 12.0, "small": 10.0},
        read_all={"huge": 20.0, "small": 18.0},
        read_all_wall={"huge": 19.0, "small": 17.0},
        huge_pages_mib=64.0,
        thp_mode="madvise",
        buffer_mib=64,
        load_before=3.5,
        load_after=4.0,
        measured_at=time.time(),
    )
    fields.update(kw)
    return probe.Peak(**fields)


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """A cache directory of the test's own and an empty in-process memo."""
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(probe, "_memo", {})
    return tmp_path


def test_probe_measures_positive_figures(private_cache):
    """Built at first use, the quick probe gives every figure this CPU has, and says why of the rest."""
    try:
        probe.load_library()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    model, flags = probe.cpu_identity()
    if not ({"avx2", "fma"} <= flags or "avx512f" in flags):
        pytest.skip("the probe needs AVX2 + FMA or AVX-512")
    result = probe.measure(threads=2, quick=True)
    assert result.cpu_model == model and result.cores == 2
    assert result.isa == ("AVX-512" if "avx512f" in flags else "AVX2 + FMA")
    assert result.fp32_core > 0 and result.fp32_all > 0
    if "avx512_bf16" in flags:
        assert result.bf16_dp_core > 0 and result.bf16_dp_all > 0
    else:
        assert result.bf16_dp_core is None and "not on this CPU" in result.bf16_note
    if "amx_bf16" not in flags:
        assert result.amx_core is None and result.amx_note.startswith("absent")
    for key in ("huge", "small"):
        assert result.read_core[key] > 0 and result.read_all[key] > 0 and result.read_all_wall[key] > 0
    assert result.buffer_mib == 64 and result.load_before >= 0 and result.probe_seconds > 0
    assert result.compute_peak("float32") == result.fp32_all
    assert result.compute_peak("float32", threads=1) == result.fp32_core


def test_compute_peak_picks_the_dtypes_best_path():
    p = _known_peak()
    assert p.compute_peak("float32") == 190.0 and p.compute_peak("float32", 1) == 100.0
    assert p.compute_peak("bfloat16") == 190.0  # no bf16 instruction: widen to fp32 and use FMAs
    p = _known_peak(bf16_dp_core=80.0, bf16_dp_all=150.0, amx_core=900.0, amx_all=1700.0)
    assert p.compute_peak("float32") == 190.0 and p.compute_peak("bfloat16") == 1700.0
    assert p.compute_peak("bfloat16", threads=1) == 900.0
    assert _known_peak(cores=4, fp32_all=390.0).compute_peak("float32", threads=2) == 200.0


def test_peak_is_cached_per_machine(private_cache):
    """A cached result of this machine is reused; one whose key is another machine's is not."""
    mine = _known_peak()
    path = private_cache / "peak" / f"peak-{probe.machine_key()}-2t.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(asdict(mine)))
    assert probe.peak(threads=2) == mine
    # another machine's figures under this machine's name (a shared cache gone wrong) are not used
    probe._memo.clear()
    path.write_text(json.dumps(asdict(_known_peak(machine_key="0123456789abcdef"))))
    try:
        probe.load_library()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    fresh = probe.peak(threads=2, quick=True)
    assert fresh.machine_key == probe.machine_key() and fresh.cpu_model != "Test CPU"
    assert json.loads(path.read_text())["cpu_model"] == fresh.cpu_model  # the new figures replaced them
    assert probe.peak(threads=2) is fresh  # then from the process's memo


def test_tables_print_gemm_gflops_as_a_share_of_peak(capsys):
    """Fed known numbers, each throughput table prints the GEMM rate and its share of the peak."""
    rows = [
        model_bench.Row("decode bs=32", "float32", 200.0, 100.0, 2.0, "", 400.0, 50.0, 25.0, 200.0, 2),
        model_bench.Row("decode bs=1", "float32", 20.0, None, None, "", None, None, None, None, 2),
    ]
    table = model_bench.format_table(rows, _known_peak(fp32_all=200.0))
    assert "GEMM GFLOP/s (% of peak)" in table and "transformers % of peak" in table
    line = next(ln for ln in table.splitlines() if ln.startswith("decode bs=32"))
    assert "2.00x" in line and "50.0 (25%)" in line and "12%" in line and "400.0" in line
    assert "float32 on 2 thread(s) 200.0" in table and "Test CPU" in table and "load 1m 3.50" in table
    assert "not a bound" in table and "ceiling" not in table

    bench_rows = [
        engine_bench.BenchRow("a: mixed x32", "workbench", 2.0, 4096, 2048.0, 1.5, gemm_gflops=60.0, peak_gflops=240.0),
        engine_bench.BenchRow("a: mixed x32", "transformers (static batch)", 3.0, 4096, 1365.3),
    ]
    engine_bench._print(bench_rows, {"main": 100.0}, 5.0, None)
    out = capsys.readouterr().out
    assert "GEMM GFLOP/s (% of peak)" in out and "60.0 (25%)" in out and "1.50x" in out

    from workbench.bench import threads

    res = threads.PolicyResult("adaptive (default)", "2 threads", flops_per_token={"bs32": 1e9}, peak_gflops=400.0)
    res.cells = [threads.Cell(res.policy, n, "bs32", t, 1.0) for n, t in (("quiet", 100.0), ("busy", 70.0))]
    table = threads.format_table([res], ("quiet", "busy"))
    assert "quiet GEMM GFLOP/s (% of peak)" in table.splitlines()[0]
    assert "| 0.70 | 100.0 (25%) |" in table  # the quiet median at 1 GFLOP a token: 100 GFLOP/s of 400

    text = bench_peak.format_peak(_known_peak())
    assert "| fp32 FMA, GFLOP/s | 100.0 | 190.0 | AVX2 + FMA |" in text
    assert "not on this CPU" in text and "absent" in text and "64 of 64 MiB on huge pages" in text
    assert "Test CPU" in text and "load 1m 3.50→4.00" in text
    assert bench_peak.fraction_text(None, 100.0) == "-" and bench_peak.gemm_text(None, 1.0) == "-"


def test_cli_bench_peak_prints_the_cached_figures(private_cache, tmp_path, capsys):
    from workbench.cli import build_parser, main

    args = build_parser().parse_args(["bench", "peak", "--cached", "--threads", "2"])
    assert args.func is bench_peak.cmd_bench_peak and args.cached and args.threads == 2
    path = private_cache / "peak" / f"peak-{probe.machine_key()}-2t.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(asdict(_known_peak())))
    out_json = tmp_path / "peak.json"
    assert main(["bench", "peak", "--cached", "--threads", "2", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "| fp32 FMA, GFLOP/s | 100.0 | 190.0 |" in out and "2 cores in use" in out
    assert json.loads(out_json.read_text())["fp32_all"] == 190.0
