"""Check the triton backend against torch_native on small random batches (any device).

Each case builds a real token-slot KV pool and request table, scatters every
request's prefix over random slots, and runs one attention layer through both
backends (`init_forward_metadata`, then `forward`, which also writes the pass's
K/V to the pool). On CPU this needs Triton's interpreter, and `TRITON_INTERPRET=1`
must be set before triton is first imported, so callers run it in a fresh process:

    TRITON_INTERPRET=1 python -m workbench.triton_check --json

prints one JSON line per case: its parameters and the largest absolute difference.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class KernelCase:
    mode: str  # "decode" or "extend"
    batch: int
    group: int  # query heads per KV head (GQA ratio)
    kv_heads: int = 2
    head_dim: int = 32
    seed: int = 0
    with_prefix: bool = True  # extend: requests carry a cached prefix (one of them none)
    dtype: str = "float32"
    kv_splits: int = 0  # decode: KV splits per request (0: the backend's default for the device)

    @property
    def id(self) -> str:
        p = "" if self.mode == "decode" else ("+prefix" if self.with_prefix else "-prefix")
        s = f"-splits{self.kv_splits}" if self.kv_splits else ""
        return f"{self.mode}{p}-bs{self.batch}-g{self.group}{s}-{self.dtype}"


@dataclass
class CaseResult:
    case: KernelCase
    max_abs_diff: float
    ref_max_abs: float
    seconds: float
    error: str = ""


def default_cases() -> list[KernelCase]:
    """Several batch sizes, ragged lengths, GQA ratios 1/3/4, prefix or not."""
    cases = []
    for i, (bs, group) in enumerate([(1, 1), (3, 3), (5, 4), (4, 1), (2, 4)]):
        cases.append(KernelCase("decode", bs, group, seed=i))
    for i, (bs, group, prefix) in enumerate([(1, 1, False), (3, 3, True), (4, 4, True), (2, 1, True), (3, 4, False)]):
        cases.append(KernelCase("extend", bs, group, seed=10 + i, with_prefix=prefix))
    # Half precision: float16 only. Triton 3.9's interpreter computes tl.dot on bfloat16 tiles wrongly
    # (a 16x16 bf16 dot returns values ~1e10 while loads, stores and casts of bf16 are exact), so
    # bfloat16 kernels can only be checked on a GPU (`workbench selftest --device cuda`).
    # The GPU's split count: short rows leave most splits empty, which the reduction must skip.
    cases.append(KernelCase("decode", 4, 3, seed=32, kv_splits=8))
    cases.append(KernelCase("decode", 3, 3, seed=30, dtype="float16"))
    cases.append(KernelCase("extend", 3, 4, seed=31, dtype="float16"))
    return cases


TOLERANCE = {"float32": 2e-5, "float16": 5e-3}


def model_shape_cases(q_heads: int, kv_heads: int, head_dim: int) -> list[KernelCase]:
    """A few decode and extend cases with a real model's head layout."""
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
    shape = dict(group=q_heads // kv_heads, kv_heads=kv_heads, head_dim=head_dim)
    return [
        KernelCase("decode", 1, seed=20, **shape),
        KernelCase("decode", 4, seed=21, **shape),
        KernelCase("extend", 1, seed=22, with_prefix=False, **shape),
        KernelCase("extend", 3, seed=23, with_prefix=True, **shape),
    ]


def _case_inputs(case: KernelCase, device: str):
    g = torch.Generator().manual_seed(case.seed)
    bs = case.batch
    if case.mode == "decode":
        # ragged contexts, some past one 32-key block and past several KV splits
        prefix = torch.randint(1, 80, (bs,), generator=g).tolist()
        ext = [1] * bs
    else:
        ext = torch.randint(1, 70, (bs,), generator=g).tolist()
        prefix = torch.randint(0, 50, (bs,), generator=g).tolist() if case.with_prefix else [0] * bs
        if case.with_prefix and bs > 1:
            prefix[0] = 0  # a fresh prompt beside cached ones
    return prefix, ext, g


def run_case(case: KernelCase, device: str = "cpu") -> CaseResult:
    """Both backends on one random batch; the largest |triton - torch_native|."""
    from workbench.core.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from workbench.core.layers.attention.triton_backend import TritonAttnBackend
    from workbench.core.layers.radix_attention import RadixAttention
    from workbench.core.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from workbench.core.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    t0 = time.perf_counter()
    dtype = getattr(torch, case.dtype)
    hk, d = case.kv_heads, case.head_dim
    hq = hk * case.group
    prefix, ext, g = _case_inputs(case, device)
    seq = [p + e for p, e in zip(prefix, ext)]
    total_slots = sum(seq) + 8
    perm = (torch.randperm(total_slots, generator=g) + 1).tolist()  # scattered slots, never 0

    def fresh_pools():
        kv = MHATokenToKVPool(total_slots, dtype, hk, d, 1, device)
        kv.k_buffer[0].copy_(torch.randn(kv.k_buffer[0].shape, generator=g).to(dtype))
        kv.v_buffer[0].copy_(torch.randn(kv.v_buffer[0].shape, generator=g).to(dtype))
        rt = ReqToTokenPool(bs + 1, max(seq) + 8, device)
        return kv, rt

    bs = case.batch
    kv_a, rt_a = fresh_pools()
    rows = list(range(1, bs + 1))[::-1]  # rows out of order on purpose
    out_loc, start = [], 0
    for i, (row, n) in enumerate(zip(rows, seq)):
        slots = perm[start : start + n]
        start += n
        rt_a.req_to_token[row, :n] = torch.tensor(slots)
        out_loc.extend(slots[prefix[i] :])
    kv_b, rt_b = MHATokenToKVPool(total_slots, dtype, hk, d, 1, device), ReqToTokenPool(bs + 1, max(seq) + 8, device)
    for buf_a, buf_b in ((kv_a.k_buffer[0], kv_b.k_buffer[0]), (kv_a.v_buffer[0], kv_b.v_buffer[0])):
        buf_b.copy_(buf_a)
    rt_b.req_to_token.copy_(rt_a.req_to_token)

    t = sum(ext)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hk, d, generator=g).to(dtype)
    v = torch.randn(t, hk, d, generator=g).to(dtype)
    layer = RadixAttention(hq, d, d**-0.5, hk, layer_id=0)
    mode = ForwardMode.DECODE if case.mode == "decode" else ForwardMode.EXTEND
    positions = torch.tensor([p + j for p, e in zip(prefix, ext) for j in range(e)], dtype=torch.int64)

    def run(backend, kv, rt) -> torch.Tensor:
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=bs,
            input_ids=torch.zeros(t, dtype=torch.int64),
            positions=positions,
            req_pool_indices=torch.tensor(rows, dtype=torch.int64),
            seq_lens=torch.tensor(seq, dtype=torch.int64),
            out_cache_loc=torch.tensor(out_loc, dtype=torch.int64),
            seq_lens_cpu=list(seq),
            extend_seq_lens_cpu=list(ext),
            extend_prefix_lens_cpu=list(prefix),
            req_to_token_pool=rt,
            token_to_kv_pool=kv,
            attn_backend=backend,
        )
        backend.init_forward_metadata(fb)
        return backend.forward(q, k, v, layer, fb)

    try:
        ref = run(TorchNativeAttnBackend(), kv_a, rt_a).double()
        out = run(TritonAttnBackend(hq, d, device, num_kv_splits=case.kv_splits or None), kv_b, rt_b).double()
        diff = float((out - ref).abs().max())
        if not torch.equal(kv_a.k_buffer[0], kv_b.k_buffer[0]):
            raise AssertionError("the backends wrote different K to the pool")
        return CaseResult(case, diff, float(ref.abs().max()), time.perf_counter() - t0)
    except Exception as exc:  # reported per case, so one broken case does not hide the others
        return CaseResult(case, float("nan"), float("nan"), time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")


MODEL_PROMPTS = [[5, 6, 7, 8, 9, 60, 61], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [77]]


def model_check(model_dir: str, device: str = "cpu", new_tokens: tuple[int, ...] = (7, 5, 3, 6)) -> dict:
    """Greedy tokens of a whole model with torch_native, triton, and triton under the stand-in graph.

    Prompts are split into a cached prefix and an extension (the extend kernel's prefix path);
    different lengths make the decode batch shrink through several graph buckets.
    """
    from workbench.core.args import ServerArgs
    from workbench.core.model_executor.cuda_graph_runner import CudaGraphRunner, StandInGraphMechanism
    from workbench.core.model_executor.model_runner import ModelRunner
    from workbench.core.model_executor.offline_harness import OfflineHarness
    from workbench.core.sampling.sampling_params import SamplingParams

    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in new_tokens]
    halves = [len(p) // 2 for p in MODEL_PROMPTS]
    out: dict = {}
    for name in ("torch_native", "triton"):
        runner = ModelRunner(
            ServerArgs(
                model_path=str(model_dir),
                dtype="float32",
                max_total_tokens=512,
                attention_backend=name,
                device=device,
                show_progress=False,
            )
        )
        harness = OfflineHarness(runner)
        out[name] = [r.output_ids for r in harness.generate(MODEL_PROMPTS, params, prefix_lens=halves)]
    runner.graph_runner = CudaGraphRunner(runner, [1, 2, 4], StandInGraphMechanism())
    runner.graph_runner.capture()
    out["triton+graph"] = [r.output_ids for r in harness.generate(MODEL_PROMPTS, params, prefix_lens=halves)]
    out["graph_replays"] = dict(runner.graph_runner.replay_count)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="one JSON object per case on stdout")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--heads",
        metavar="HQ,HK,D",
        default=None,
        help="run a few cases with this head layout instead of the default cases",
    )
    p.add_argument(
        "--model-check",
        metavar="MODEL_DIR",
        default=None,
        help="instead: greedy tokens of a whole (tiny) model through both backends",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.model_check:
        print(json.dumps({"model_check": model_check(args.model_check, args.device)}), flush=True)
        return 0
    cases = default_cases()
    if args.heads:
        hq, hk, d = (int(x) for x in args.heads.split(","))
        cases = model_shape_cases(hq, hk, d)
    for case in cases:
        r = run_case(case, args.device)
        if args.json:
            print(json.dumps({"id": case.id, **asdict(r)}), flush=True)
        else:
            status = "ok" if not r.error else r.error
            print(f"{case.id:<28} max|diff| {r.max_abs_diff:.2e}  {r.seconds:6.2f}s  {status}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
