"""Multi-LoRA under tensor parallelism (each rank holds its shard of every adapter: B's rows on the
column-parallel projections, A's columns on the row-parallel ones, whose partial deltas join the
all-reduce), and `workbench bench lora --quick` as a smoke run, both on tiny random models."""

from __future__ import annotations

import subprocess
import sys

from lora_helpers import make_peft_adapter, peft_greedy
from tiny_models import make_tiny_llama, make_tiny_qwen2
from workbench.core.engine import Engine

PROMPTS = [[5, 17, 33, 80, 9, 61], [100, 4, 77, 3, 9], [3, 3, 150, 42, 18]]


def test_two_ranks_serve_adapters_as_peft_does(tmp_path):
    model = make_tiny_qwen2(tmp_path / "qwen")
    a = make_peft_adapter(model, tmp_path / "a", seed=21, r=4)
    b = make_peft_adapter(model, tmp_path / "b", seed=22, r=2, targets=["q_proj", "o_proj", "up_proj", "down_proj"])
    loras = ["a", None, "b"]
    sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    with Engine(
        model_path=str(model),
        dtype="float32",
        tp_size=2,
        max_total_tokens=1024,
        show_progress=False,
        lora_paths=[f"a={a}"],
        lora_target_modules=["all"],
        max_lora_rank=4,
    ) as engine:
        engine.load_lora_adapter("b", str(b))  # reaches every rank
        outs = engine.generate(input_ids=PROMPTS, sampling_params=sp, lora_path=loras)
    for i, (name, out) in enumerate(zip(loras, outs)):
        want = peft_greedy(model, {"a": a, "b": b}[name] if name else None, [PROMPTS[i]], 6)[0]
        assert out["output_ids"] == want, f"request {i} under {name}"


def test_bench_lora_quick(tmp_path):
    model = make_tiny_llama(tmp_path / "llama")
    run = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "bench", "lora", "--quick", "--model-path", str(model)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for label in ("base", "1 adapter", "2 adapters mixed", "4 adapters mixed"):
        assert label in run.stdout, run.stdout
