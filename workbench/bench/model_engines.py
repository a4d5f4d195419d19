"""The engines `workbench bench model` (and its `--profile`) time, and what they share: the batch sizes,
the step clock, the dtypes asked for, the environment the numbers depend on.

Both engines stamp the end of every token step with the module's clock (`set_clock`): wall time by
default, process CPU time with `--clock cpu`, or wall time after a device sync on CUDA.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass

import torch

DEFAULT_DTYPES = ("float32", "bfloat16")


@dataclass
class BenchSizes:
    prompt_len: int = 32  # decode prompts
    decode_tokens_bs1: int = 64
    batch: int = 32
    decode_tokens_batch: int = 32
    prefill_len: int = 512
    repeats: int = 2

    @classmethod
    def quick(cls) -> BenchSizes:
        return cls(prompt_len=8, decode_tokens_bs1=4, batch=4, decode_tokens_batch=3, prefill_len=32, repeats=1)


class WorkbenchModel:
    """The workbench's ModelRunner behind an OfflineHarness, its sampling calls stamped."""

    name = "workbench"

    def __init__(
        self,
        prepared,
        dtype: str,
        max_tokens: int,
        enable_torch_compile: bool,
        device: str = "cpu",
        disable_cuda_graph: bool = False,
    ):
        from workbench.core.args import ServerArgs
        from workbench.core.model_executor.model_runner import ModelRunner
        from workbench.core.model_executor.offline_harness import OfflineHarness

        args = ServerArgs(
            dtype=dtype,
            max_total_tokens=max_tokens,
            show_progress=False,
            device=device,
            enable_torch_compile=enable_torch_compile,
            disable_cuda_graph=disable_cuda_graph,
        )
        self.runner = ModelRunner(args, prepared=prepared)
        self.harness = OfflineHarness(self.runner)
        self._stamps: list[float] = []
        sample = self.runner.sample

        def stamped_sample(*a, **kw):  # every pass ends in one sampling call: a token step
            out = sample(*a, **kw)
            self._stamps.append(_clock())
            return out

        self.runner.sample = stamped_sample

    def linears_step_seconds(self, bs: int, repeats: int) -> float | None:
        """Best time of one decode step's linear layers alone at batch `bs`, each on the path the
        layer takes (oneDNN's packed copy or gemm.c's; CPU only: None where the weights are not
        packed, e.g. on CUDA)."""
        from workbench.core.layers.linear import LinearBase

        model = self.runner.model
        layers = [m for m in model.modules() if isinstance(m, LinearBase) and m.cpu_fast_path]
        head = getattr(model, "_packed_head", None) is not None or getattr(model, "_gemm_head", None) is not None
        if not layers:
            return None
        dtype = layers[0].weight.dtype
        widths = {m.weight.shape[1] for m in layers} | {int(model.config.hidden_size)}
        x = {w: torch.randn(bs, w).to(dtype) for w in widths}

        def step():
            for m in layers:  # model order: qkv, o, gate_up, down per layer
                m._matmul(x[m.weight.shape[1]], m.bias)
            if head:
                model.compute_logits(x[int(model.config.hidden_size)])

        step()
        best = float("inf")
        for _ in range(max(1, repeats)):
            t = _clock()
            step()
            best = min(best, _clock() - t)
        return best

    def compile_times(self) -> dict[int, float]:
        runner = self.runner.decode_runner
        return dict(runner.compile_time_s) if runner is not None else {}

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[float]:
        """Run; return the start time then the time each token step ended (by `_clock`)."""
        from workbench.core.sampling.sampling_params import SamplingParams

        sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        self._stamps = [_clock()]
        out = self.harness.generate(prompts, sp)
        assert all(len(r.output_ids) == new_tokens for r in out)
        return self._stamps


class TransformersModel:
    """transformers' `generate`, one stamp per new token through a stopping criterion."""

    name = "transformers"

    def __init__(self, prepared, dtype: str, device: str = "cpu"):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(prepared.model_dir, dtype=getattr(torch, dtype))
        model.generation_config.eos_token_id = None  # run exactly max_new_tokens steps
        model.generation_config.pad_token_id = 0
        self.model = model.to(device).eval()
        self.device = device

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[float]:
        """Run; return the start time then the time each token step ended (by `_clock`)."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        stamps = [_clock()]

        class Stamp(StoppingCriteria):  # generate calls it once per new token
            def __call__(self, input_ids, scores, **kwargs):
                stamps.append(_clock())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        ids = torch.tensor(prompts, dtype=torch.int64, device=self.device)  # equal lengths: no padding
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                stopping_criteria=StoppingCriteriaList([Stamp()]),
            )
        assert out.shape[1] == ids.shape[1] + new_tokens
        return stamps


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter


def synced_wall() -> float:
    """Wall time once the GPU has finished what was queued (a step's stamp on CUDA)."""
    torch.cuda.synchronize()
    return time.perf_counter()


def set_clock(clock) -> None:
    """The clock both engines stamp their steps with, from now on."""
    global _clock
    _clock = clock


def get_clock():
    """The clock the engines stamp their steps with."""
    return _clock


def parse_dtypes(text: str | None) -> list[str]:
    """`--dtype`: comma-separated dtypes (both float32 and bfloat16 when not given)."""
    if not text:
        return list(DEFAULT_DTYPES)
    out = [d.strip() for d in text.split(",") if d.strip()]
    for d in out:
        if d not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype takes float32, bfloat16 or float16 (comma-separated), not {d!r}")
    return out


def environment() -> dict:
    """What the numbers depend on: versions, threads, CPU."""
    from workbench.core.args import choose_cpu_dtype

    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "auto_dtype": choose_cpu_dtype(),
        "python": platform.python_version(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
