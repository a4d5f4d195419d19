"""End-to-end part of tests/fast/test_cpu_ops.py (what starts processes, engines or servers, or loads the
reference model).

The compiled CPU elementwise kernels against the torch ops they replace.

Rotary embedding (rope.c) is bit-identical in every dtype, so the model's tokens do not
change with it. RMSNorm (rms_norm.c, 16-bit models only) rounds a correctly rounded scale;
it is at least as close to float64 as ATen's and differs from it in ~1e-5 of the values.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from workbench.core.layers import cpu_ops
from workbench.core.layers.rotary_embedding import apply_rotary

if shutil.which(os.environ.get("CC", "cc")) is None:
    pytest.skip(
        "no C compiler: the compiled rope cannot be built here (the model uses apply_rotary)", allow_module_level=True
    )


def test_bfloat16_greedy_tokens_are_unchanged_by_the_compiled_rope(default_prepared, monkeypatch):
    from workbench.core.args import ServerArgs
    from workbench.core.model_executor.model_runner import ModelRunner
    from workbench.core.model_executor.offline_harness import OfflineHarness
    from workbench.core.sampling.sampling_params import SamplingParams

    runner = ModelRunner(
        ServerArgs(dtype="bfloat16", max_total_tokens=4096, show_progress=False), prepared=default_prepared
    )
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 30000, (n,), generator=g).tolist() for n in (5, 40, 130)]
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    fused = [r.output_ids for r in OfflineHarness(runner).generate(prompts, sp)]
    monkeypatch.setattr(cpu_ops, "rope_inplace", lambda x, cos, sin: x.copy_(apply_rotary(x, cos, sin)))
    plain = [r.output_ids for r in OfflineHarness(runner).generate(prompts, sp)]
    assert fused == plain
