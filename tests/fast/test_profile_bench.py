"""`workbench bench model --profile` on a tiny model: every component row, percentages that add up,
positive times, the engine split, and a model left exactly as it was (no cost once profiling ends)."""

from __future__ import annotations

import argparse
import json
import math

import pytest
from tiny_models import make_tiny_llama

from workbench.bench import profile_bench
from workbench.bench.model_bench import add_parser


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    # Untied head: the LM head then goes through the packed path like SmolLM2's does on CPU.
    return make_tiny_llama(tmp_path_factory.mktemp("profile") / "llama", tie_word_embeddings=False, seed=3)


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"))
    return parser.parse_args(["model", *argv])


def test_profile_quick_prints_every_component_and_the_engine_split(tiny_llama, tmp_path, capsys):
    out = tmp_path / "profile.json"
    args = _args(
        "--profile",
        "--quick",
        "--quiet",
        "--dtype",
        "float32",
        "--threads",
        "1",
        "--model",
        str(tiny_llama),
        "--json",
        str(out),
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())

    rows = data["profile_rows"]
    assert [r["shape"] for r in rows] == ["decode bs=1", "decode bs=4", "extend 32"]
    keys = [k for k, _ in profile_bench.COMPONENTS]
    from workbench.core.layers import cpu_ops

    fused = cpu_ops.fused_decode_enabled()  # batch 1 runs its layers in one C call (decode_layers.c)
    for r in rows:
        assert r["dtype"] == "float32" and r["steps"] >= 1
        assert list(r["ms"]) == keys
        # every component is measured (a wrapper that stopped matching the model would read 0),
        # except those the fused batch-1 call takes whole: the SiLU, and the call itself elsewhere
        one_call = fused and r["shape"] == "decode bs=1"
        zero = {"activation"} if one_call else {"fused_layers"}
        assert all(r["ms"][k] > 0 for k in keys if k not in zero), r["ms"]
        assert all(r["ms"][k] == 0 for k in zero), r["ms"]
        assert r["profiled_ms"] > 0 and r["unprofiled_ms"] > 0
        assert math.isclose(sum(r["ms"].values()), r["profiled_ms"], rel_tol=1e-6)
        row = profile_bench.ProfileRow(**r)
        assert sum(row.percent(k) for k in keys) == pytest.approx(100.0, abs=0.01)
        # the GEMMs' FLOPs from the shapes: their rate over their own time, and over the whole step
        assert row.gemm_flops > 0 and row.gemm_gflops > 0 and row.step_gflops > 0

    # the printed tables: one per shape, each with every component row and both totals
    for _, label in profile_bench.COMPONENTS:
        assert printed.count(label) == 3
    assert printed.count("step, profiled (sum)") == 3 and printed.count("profiler overhead") == 3
    assert printed.count("GEMMs: ") == 3 and printed.count("of peak") >= 6
    pcts = [
        float(line.rsplit(None, 1)[1].rstrip("%"))
        for line in printed.splitlines()
        if any(line.startswith(label) for _, label in profile_bench.COMPONENTS)
    ]
    assert len(pcts) == 3 * len(keys)
    for i in range(3):
        assert sum(pcts[i * len(keys) : (i + 1) * len(keys)]) == pytest.approx(100.0, abs=0.6)

    split = data["engine_split"]
    assert split["batch"] == 4 and split["decode_steps"] >= 1
    assert split["schedule_ms"] > 0 and split["forward_ms"] > 0 and split["rest_ms"] > 0
    assert {"scheduler", "detokenizer", "main process (all threads)"} <= set(split["cpu_ms_per_token"])
    assert all(v >= 0 for v in split["cpu_ms_per_token"].values())
    assert "engine split" in printed and "forward + sample (TpModelWorker)" in printed


def test_profiling_leaves_the_model_untouched(tiny_llama):
    """The wrappers exist only while a measurement runs: afterwards no module, runner or model
    module global is wrapped, so the unprofiled path is the plain code."""
    import sys

    from workbench.core.layers import cpu_ops
    from workbench.core.model_loader import prepare_model

    from workbench.bench.model_engines import WorkbenchModel
    from workbench.bench.prompts import torch_random_ids

    wb = WorkbenchModel(prepare_model(str(tiny_llama), progress=False), "float32", 512, False)
    model_mod = sys.modules[type(wb.runner.model).__module__]
    before = {name: getattr(model_mod, name) for name in ("silu_and_mul", "apply_rotary", "packed_linear")}
    rope = cpu_ops.rope_inplace
    sample = wb.runner.sample
    prompts = torch_random_ids(2, 6, 256, seed=1)
    wb.generate(prompts, 2)
    shapes = [("decode bs=2", "decode", lambda: wb.generate(prompts, 3), "")]
    rows = profile_bench.profile_shapes(wb, "float32", shapes, 1, profile_bench.time.perf_counter)
    assert rows[0].steps == 2 and rows[0].ms["gemm"] > 0
    assert all("forward" not in m.__dict__ for m in wb.runner.model.modules())
    assert "compute_logits" not in wb.runner.model.__dict__
    assert "forward" not in wb.runner.__dict__ and wb.runner.sample is sample
    assert "init_forward_metadata" not in wb.runner.attn_backend.__dict__
    assert "_decode" not in wb.harness.__dict__ and "_extend" not in wb.harness.__dict__
    assert {name: getattr(model_mod, name) for name in before} == before and cpu_ops.rope_inplace is rope
    assert len(wb.generate(prompts, 2)) == 3  # start stamp + two token steps: still works


def test_profile_refuses_cuda_and_compiled_steps(tiny_llama):
    with pytest.raises(ValueError, match="CPU only"):
        profile_bench.run_profile(_args("--profile", "--quick", "--device", "cuda", "--model", str(tiny_llama)))
    with pytest.raises(ValueError, match="compiled"):
        profile_bench.run_profile(_args("--profile", "--quick", "--enable-torch-compile", "--model", str(tiny_llama)))
