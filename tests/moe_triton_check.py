"""Run in a fresh process with TRITON_INTERPRET=1 (tests/e2e/test_moe_triton.py): the Triton experts
(core/layers/moe_triton.py) against FusedMoE's CPU loop on random layers; prints one JSON line per case."""

from __future__ import annotations

import json
import os

import torch
from workbench.core.distributed import parallel_state as ps
from workbench.core.layers.moe import FusedMoE, TopKRouter


def run_case(tokens: int, experts: int, top_k: int, ep: int, seed: int) -> dict:
    hidden, inter = 32, 48
    g = torch.Generator().manual_seed(seed)
    full13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2
    full2 = torch.randn(experts, hidden, inter, generator=g) * 0.2
    router = TopKRouter(hidden, experts, top_k, renormalize=True)
    router.weight.data.copy_(torch.randn(experts, hidden, generator=g))
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = router(x)
    worst = 0.0
    total = torch.zeros(tokens, hidden)
    for rank in range(ep):  # each expert-parallel rank's share; their sum is the layer (the all-reduce)
        ps.set_tp_group(rank, ep)
        ps.set_moe_ep_size(ep)
        moe = FusedMoE(experts, hidden, inter)
        for e in range(experts):
            moe.weight_loader(moe.w13_weight, full13[e, :inter], e, "w1")
            moe.weight_loader(moe.w13_weight, full13[e, inter:], e, "w3")
            moe.weight_loader(moe.w2_weight, full2[e], e, "w2")
        moe.tp_size = 1  # no process group here: sum the ranks by hand below
        os.environ["WORKBENCH_MOE_TRITON"] = "0"
        want = moe(x, weights, ids)
        os.environ["WORKBENCH_MOE_TRITON"] = "1"
        got = moe(x, weights, ids)
        worst = max(worst, float((got - want).abs().max()))
        total += got
    ps.set_tp_group(0, 1)
    ps.set_moe_ep_size(1)
    ref = FusedMoE(experts, hidden, inter)
    ref.w13_weight.data.copy_(full13)
    ref.w2_weight.data.copy_(full2)
    os.environ["WORKBENCH_MOE_TRITON"] = "0"
    layer = ref(x, weights, ids)
    return {
        "tokens": tokens,
        "experts": experts,
        "top_k": top_k,
        "ep": ep,
        "max_diff_vs_loop": worst,
        "max_diff_sum_vs_layer": float((total - layer).abs().max()),
        "scale": float(layer.abs().max()),
    }


def run_model(model_dir: str) -> dict:
    """A tiny Qwen3-MoE's greedy tokens with the Triton experts against transformers."""
    from transformers import AutoModelForCausalLM
    from workbench.core.args import ServerArgs
    from workbench.core.model_executor.model_runner import ModelRunner
    from workbench.core.model_executor.offline_harness import OfflineHarness
    from workbench.core.sampling.sampling_params import SamplingParams

    prompts = [[5, 6, 7, 8, 9, 60, 61], [40, 41, 42, 43]]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [
            hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p) :].tolist() for p in prompts
        ]
    os.environ["WORKBENCH_MOE_TRITON"] = "1"
    runner = ModelRunner(ServerArgs(model_path=model_dir, dtype="float32", max_total_tokens=512, show_progress=False))
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    got = [r.output_ids for r in OfflineHarness(runner).generate(prompts, sp)]
    return {"model": "qwen3_moe", "equal": got == ref, "got": got, "ref": ref}


if __name__ == "__main__":
    import sys

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    if len(sys.argv) > 1:
        print(json.dumps(run_model(sys.argv[1])), flush=True)
        sys.exit(0)
    for case in [
        (1, 8, 2, 1, 0),
        (7, 8, 2, 1, 1),
        (33, 8, 2, 1, 2),
        (40, 4, 1, 1, 3),
        (19, 8, 2, 2, 4),
        (5, 6, 3, 3, 5),
    ]:
        print(json.dumps(run_case(*case)), flush=True)
