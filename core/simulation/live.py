"""A deployment that is not there, served live (issue #19):

    workbench serve --simulate h100 --model llama-3.1-70b --tp-size 8
    workbench tui --simulate h100 --model llama-3.1-70b --tp-size 8
    Engine(simulate="h100", model_path="llama-3.1-70b", tp_size=8)

The tokenizer manager, the scheduler process and the detokenizer are the real ones, joined by ZMQ as
always, so the TUI, the Dashboard, the recorder, /metrics and the HTTP API work unchanged. Only the
scheduler's model worker is replaced: `PacedSimWorker` computes nothing, samples its tokens from a
seeded generator and lets each pass take, on the wall clock, the time the cost model predicts for its
shape on the simulated hardware (the scheduler's own work counts inside it, as a real host's does).
So simulated time is wall time in a live deployment, and every stamp a user sees (the trace,
`meta_info` latencies, /metrics) is the simulated deployment's. Faster-than-real-time runs over a
workload are `workbench sim run` (simulator.py), which steps the same Scheduler on a simulated clock.

The weights are not there, so neither is the simulated model's tokenizer: the default model's stands
in (prompts are tokenized with it, and the sampled ids are drawn from its vocabulary so the text
decodes); a prompt's length and cost are what the cost model sees. Every view carries a
`SIMULATED h100x8` badge (`badge`), as does the trace's header and each /metrics series.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

from workbench.core.args import ServerArgs
from workbench.core.simulation.calibration import shipped
from workbench.core.simulation.cost_model import CostModel
from workbench.core.simulation.hardware import HARDWARE, get_hardware
from workbench.core.simulation.model_specs import model_spec
from workbench.core.simulation.simulator import SimClock, SimRunner, SimWorker, default_dtype_bytes


def deployment(server_args: ServerArgs) -> str:
    """'h100x8': the simulated hardware and how many devices serve the model."""
    return f"{server_args.simulate}x{server_args.tp_size}"


def badge(server_args: ServerArgs) -> str:
    """What every view and the trace's header say of a simulated engine ('' for a real one)."""
    return f"SIMULATED {deployment(server_args)}" if server_args.simulate else ""


def _cost_model(sa: ServerArgs) -> CostModel:
    spec, hw = model_spec(sa.model_path), get_hardware(sa.simulate)
    calibration = shipped(hw.name, spec.name) if sa.tp_size == 1 else None  # as Simulator's "auto"
    return CostModel(spec, hw, sa.tp_size, default_dtype_bytes(calibration, hw.name), 1.0, calibration)


def sized_args(sa: ServerArgs) -> ServerArgs:
    """The simulated engine's arguments: checked, and the pool and batch limits sized as the real
    runner would size them on that hardware (only where the user left them out)."""
    if sa.simulate not in HARDWARE:
        raise ValueError(f"--simulate must be one of {', '.join(sorted(HARDWARE))}, not {sa.simulate!r}")
    if not sa.model_path:
        raise ValueError("--simulate needs --model: a known model (e.g. llama-3.1-70b) or an HF config.json")
    unsupported = {
        "--dp-size": sa.dp_size > 1,
        "--nnodes": sa.nnodes > 1,
        "--speculative-algorithm": bool(sa.speculative_algorithm),
        "--enable-torch-compile": sa.enable_torch_compile,
        "--overlap-schedule": sa.disable_overlap_schedule is False,
    }
    given = [flag for flag, on in unsupported.items() if on]
    if given:
        raise ValueError(
            f"a live simulated engine runs one scheduler with the normal loop; {', '.join(given)} "
            "is simulated by `workbench sim run` (data parallel, the overlap loop, speculative decoding)"
        )
    cost = _cost_model(sa)  # raises with what to change when the model does not fit
    gpu = sa.simulate != "cpu-here"
    return dataclasses.replace(
        sa,
        max_total_tokens=sa.max_total_tokens or cost.kv_pool_tokens(),
        chunked_prefill_size=sa.chunked_prefill_size
        if sa.chunked_prefill_size is not None
        else (8192 if gpu else 2048),
        max_running_requests=sa.max_running_requests if sa.max_running_requests != 128 or not gpu else 256,
        disable_overlap_schedule=True,
        num_threads=1,  # nothing to compute: one thread, the cores stay with the views
    )


class PacedSimWorker(SimWorker):
    """`SimWorker` on the wall clock: a pass returns when the time the cost model predicts for it has
    passed since the pass began (it sleeps the rest), so the deployment runs at its own speed."""

    def forward_batch(self, mwb):
        start = time.monotonic()
        cost, out = self.compute(mwb)
        self.clock.now += cost.total
        self._last_ms = cost.total * 1000
        rest = start + cost.total - time.monotonic()
        if rest > 0:
            time.sleep(rest)
        return out


def build_worker(sa: ServerArgs, vocab: int, seed: Optional[int] = None) -> PacedSimWorker:
    """The scheduler process's worker for `sa` (already `sized_args`); tokens are drawn from [3, vocab)."""
    cost = _cost_model(sa)
    spec = cost.model
    context = min(spec.context_len, sa.context_length or spec.context_len)
    runner = SimRunner(spec, sa.max_total_tokens, sa.max_running_requests, context)
    runner.model_config.vocab_size = min(spec.vocab, vocab)  # ids the stand-in tokenizer can decode
    runner.model_config.eos_token_ids = []  # random ids never mean "stop": requests run to their limit
    runner.simulated = badge(sa)
    runner.kv_head_num = max(1, spec.kv_heads // sa.tp_size)
    return PacedSimWorker(runner, cost, SimClock(), sa.random_seed if seed is None else seed)


def stand_in_model_dir():
    """The default model's directory: its tokenizer stands in for the simulated model's."""
    from workbench.core.model_loader import prepare_model

    return prepare_model(ServerArgs().model_path, progress=False).model_dir


def build_scheduler(sa: ServerArgs, port_args, proc_name: str = "scheduler"):
    """The scheduler process's Scheduler over a `PacedSimWorker` (run_scheduler_process calls this
    for --simulate): the real class with its ZMQ I/O and tracer; the stand-in tokenizer decodes
    for stop strings and previews."""
    from workbench.core.managers.scheduler import Scheduler, _load_fast_tokenizer

    tokenizer = _load_fast_tokenizer(stand_in_model_dir())
    worker = build_worker(sa, tokenizer.get_vocab_size())
    return Scheduler(sa, port_args, 0, 1, proc_name=proc_name, worker=worker, tokenizer=tokenizer)
