"""`workbench bench lora`: what serving LoRA adapters costs (issue #42).

One engine with --enable-lora and four random adapters of --rank on every projection (written in
PEFT's format to a temporary directory), measured on one batch of --batch requests that run
under: the base model only, 1 adapter, 2 adapters mixed, 4 adapters mixed (the requests take them
in turn). Each configuration runs in turn per round (noise lands on all alike) and the medians
are printed with the ratio to the base model:

- prefill tok/s: prompts of --prompt-len tokens with max_new_tokens 1 (the radix cache flushed first);
- decode tok/s: greedy, EOS ignored, (N - 1) tokens per request over the time of an N-token run
  minus a 1-token run (prefill excluded).

A batch with any adapter runs op by op (the fused batch-1 decode kernel does not apply), and each
adapter adds two small GEMMs per targeted projection over its rows (docs/lora.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from workbench.bench.harness import engine_parser, load_text, progress

CONFIGS = (("base", 0), ("1 adapter", 1), ("2 adapters mixed", 2), ("4 adapters mixed", 4))
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(model_dir, out: Path, rank: int, seed: int) -> Path:
    """A random LoRA adapter of every projection of the model at `model_dir`, in PEFT's format."""
    from safetensors.torch import save_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    shapes = {  # projection -> (in, out)
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def _loras(n: int, batch: int) -> list[str | None]:
    return [None] * batch if n == 0 else [f"l{i % n}" for i in range(batch)]


def _timed(engine, ids, new: int, loras) -> float:
    sp = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    engine.generate(input_ids=ids, sampling_params=sp, lora_path=loras)
    return time.perf_counter() - t0


def _median(values: list[float]) -> float:
    kept = [v for v in values if v == v]
    return statistics.median(kept) if kept else float("nan")


def run_lora_bench(args: argparse.Namespace) -> dict:
    from workbench.core.args import ServerArgs
    from workbench.core.engine import Engine
    from workbench.core.model_loader import prepare_model
    from workbench.core.simulation.calibration import cpu_model

    quick = args.quick
    batch, new = (8, 8) if quick else (args.batch, args.new)
    prompt_len, rounds, rank = (32, 1, 8) if quick else (args.prompt_len, args.rounds, args.rank)
    base = ServerArgs.from_cli_args(args).replace(show_progress=False)
    model_dir = prepare_model(base.model_path, progress=False).model_dir
    loads = [load_text()]
    with tempfile.TemporaryDirectory(prefix="workbench-lora-bench-") as tmp:
        progress(f"writing 4 random rank-{rank} adapters of every projection")
        paths = [f"l{i}={write_random_adapter(model_dir, Path(tmp) / f'l{i}', rank, i)}" for i in range(4)]
        server_args = base.replace(
            enable_lora=True, lora_paths=paths, max_loras_per_batch=4, lora_target_modules=["all"]
        )
        progress("starting the engine")
        with Engine(server_args=server_args) as engine:
            text = " ".join(["the quick brown fox jumps over the lazy dog"] * (prompt_len // 8 + 2))
            tok = engine.tokenizer.encode(text)[:prompt_len]
            vocab = len(engine.tokenizer)
            ids = [[(1000 + 7 * i) % vocab] + tok[1:] for i in range(batch)]  # no shared prefix between requests
            progress("warming up")
            for _, n in CONFIGS:
                _timed(engine, ids, 2, _loras(n, batch))
            samples: dict[str, dict[str, list[float]]] = {label: {"prefill": [], "decode": []} for label, _ in CONFIGS}
            for r in range(rounds):
                for label, n in CONFIGS if r % 2 == 0 else tuple(reversed(CONFIGS)):
                    progress(f"round {r + 1}/{rounds}: {label}")
                    loras = _loras(n, batch)
                    engine.flush_cache()
                    t1 = _timed(engine, ids, 1, loras)
                    samples[label]["prefill"].append(batch * prompt_len / t1)
                    engine.flush_cache()
                    tn = _timed(engine, ids, new, loras)
                    samples[label]["decode"].append(batch * (new - 1) / (tn - t1) if tn > t1 else float("nan"))
                loads.append(load_text())
    rows = [(label, _median(samples[label]["prefill"]), _median(samples[label]["decode"])) for label, _ in CONFIGS]
    base_pre, base_dec = rows[0][1], rows[0][2]
    print(
        f"\nLoRA cost: batch {batch}, prompts of {prompt_len} tokens, {new} new tokens (greedy, EOS ignored), "
        f"rank {rank} on all 7 projections; tok/s medians of {rounds} round(s); dtype {base.dtype}, "
        f"threads {base.num_threads or 'default'}"
    )
    print(f"CPU: {cpu_model() or 'unknown'}; load average {' → '.join(loads)}")
    print(f"{'':<20} {'prefill tok/s':>14} {'vs base':>8} {'decode tok/s':>13} {'vs base':>8}")
    for label, pre, dec in rows:
        print(f"{label:<20} {pre:>14.1f} {pre / base_pre:>7.2f}× {dec:>13.1f} {dec / base_dec:>7.2f}×")
    return {"rows": rows}


def add_parser(bench_sub) -> None:
    p = engine_parser(
        bench_sub,
        "lora",
        help="prefill and decode tok/s of a batch under the base model and 1, 2 and 4 LoRA adapters mixed",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--rounds", type=int, default=2, help="rounds (each runs every configuration once)")
    p.add_argument("--batch", type=int, default=32, help="requests in the batch")
    p.add_argument("--new", type=int, default=32, help="new tokens per request in the decode runs")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one round (smoke test)")
    p.set_defaults(func=lambda a: 0 if run_lora_bench(a)["rows"] else 1)
