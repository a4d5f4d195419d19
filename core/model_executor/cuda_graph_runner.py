"""Static-shape decode steps: batch-size buckets, padding, CUDA graphs, and the compiled CPU runner.

A captured CUDA graph and a `torch.compile(dynamic=False)` graph share one
constraint: the batch size is baked in. Both therefore keep one graph per bucket
and pad a decode batch up to the smallest bucket that holds it. Padded rows are
harmless by construction: they read token 0 at position 0, write their K/V to the
pool's scratch slot 0 (never handed out), and attend to that one slot only; their
logits are dropped.

- `CudaGraphRunner` (CUDA): buckets 1, 2, 4, 8, then every 8; static input buffers,
  one shared memory pool, the attention backend's capture/replay hooks. The graph
  mechanism is injectable: `TorchCudaGraphMechanism` on a GPU,
  `StandInGraphMechanism` (re-runs the recorded callable) in CPU tests.
- `TorchCompileDecodeRunner` (CPU, `--enable-torch-compile`, cpu_compile_runner.py):
  buckets 1, 2, 4, 8, 16, 24, 32, then every 16.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

BASE_BUCKETS = (1, 2, 4, 8, 16, 24, 32)
BUCKET_STEP_ABOVE_32 = 16


def get_batch_size_buckets(max_bs: int) -> list[int]:
    """Bucket sizes up to `max_bs` (which is always the last bucket)."""
    if max_bs < 1:
        raise ValueError(f"max batch size must be at least 1, got {max_bs}")
    sizes = {b for b in BASE_BUCKETS if b <= max_bs}
    b = BASE_BUCKETS[-1] + BUCKET_STEP_ABOVE_32
    while b < max_bs:
        sizes.add(b)
        b += BUCKET_STEP_ABOVE_32
    sizes.add(max_bs)
    return sorted(sizes)


def pick_bucket(bs: int, buckets: list[int]) -> int | None:
    """The smallest bucket >= bs, or None when bs is larger than every bucket (run eagerly)."""
    if bs < 1:
        raise ValueError(f"batch size must be at least 1, got {bs}")
    i = bisect.bisect_left(buckets, bs)
    return buckets[i] if i < len(buckets) else None


@dataclass
class PaddedDecodeInputs:
    """A decode batch's per-request tensors, padded to a bucket (rows >= real_bs are padding)."""

    bucket: int
    real_bs: int
    input_ids: torch.Tensor  # [bucket]
    positions: torch.Tensor  # [bucket]
    out_cache_loc: torch.Tensor  # [bucket]; padding writes to scratch slot 0
    seq_lens: torch.Tensor  # [bucket]; padding has length 1
    seq_lens_cpu: list[int]
    slot_table: torch.Tensor  # [bucket, L] KV slots per row; padding rows are all slot 0


def pad_decode_batch(
    bucket: int,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    seq_lens_cpu: list[int],
    slot_table: torch.Tensor,
) -> PaddedDecodeInputs:
    """Pad a decode batch of len(seq_lens_cpu) rows up to `bucket` rows."""
    bs = len(seq_lens_cpu)
    if bucket < bs:
        raise ValueError(f"bucket {bucket} is smaller than the batch ({bs})")
    pad = bucket - bs
    device = input_ids.device

    def padded(t: torch.Tensor, value: int) -> torch.Tensor:
        if pad == 0:
            return t
        return torch.cat((t, torch.full((pad,) + tuple(t.shape[1:]), value, dtype=t.dtype, device=device)))

    lens = list(seq_lens_cpu) + [1] * pad
    return PaddedDecodeInputs(
        bucket=bucket,
        real_bs=bs,
        input_ids=padded(input_ids, 0),
        positions=padded(positions, 0),
        out_cache_loc=padded(out_cache_loc, 0),
        seq_lens=torch.tensor(lens, dtype=torch.int64, device=device),
        seq_lens_cpu=lens,
        slot_table=padded(slot_table, 0),
    )


# ---- CUDA graphs for decode ------------------------------------------------------------
CUDA_GRAPH_STEP = 8


def get_cuda_graph_batch_sizes(max_bs: int, explicit: list[int] | None = None) -> list[int]:
    """Captured batch sizes: `explicit` (--cuda-graph-bs) capped at `max_bs`, else 1, 2, 4, 8 and
    every 8 up to `max_bs` (--cuda-graph-max-bs), which is always included."""
    if max_bs < 1:
        raise ValueError(f"--cuda-graph-max-bs must be at least 1, got {max_bs}")
    if explicit:
        bad = [b for b in explicit if int(b) < 1]
        if bad:
            raise ValueError(f"--cuda-graph-bs sizes must be at least 1, got {bad}")
        sizes = sorted({int(b) for b in explicit if int(b) <= max_bs})
        if not sizes:
            raise ValueError(
                f"every --cuda-graph-bs size exceeds the largest batch ({max_bs}); "
                "lower them or raise --cuda-graph-max-bs / --max-running-requests"
            )
        return sizes
    sizes = {b for b in (1, 2, 4) if b <= max_bs}
    sizes.update(range(CUDA_GRAPH_STEP, max_bs + 1, CUDA_GRAPH_STEP))
    sizes.add(max_bs)
    return sorted(sizes)


class _CudaGraph:
    """A captured torch.cuda.CUDAGraph and the output tensors it writes on every replay."""

    def __init__(self, graph, output: tuple[torch.Tensor, ...]):
        self.graph, self.output = graph, output

    def replay(self) -> None:
        self.graph.replay()


class TorchCudaGraphMechanism:
    """Real CUDA graphs: warm up on a side stream, capture into one shared memory pool."""

    name = "cuda"

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def make_pool(self):
        return torch.cuda.graph_pool_handle()

    def capture(self, fn, pool) -> _CudaGraph:
        # Two eager runs first: lazy initialisation (cuBLAS handles, workspaces, autotuned
        # kernels) allocates or syncs, neither of which may happen inside a capture.
        torch.cuda.synchronize(self.device)
        with torch.cuda.stream(self.stream):
            fn()
            fn()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=self.stream):
            output = fn()
        torch.cuda.synchronize(self.device)
        return _CudaGraph(graph, output)


class _StandInGraph:
    """Records the step's Python callable; replay re-runs it into the same output tensors."""

    def __init__(self, fn, output: tuple[torch.Tensor, ...]):
        self.fn, self.output = fn, output

    def replay(self) -> None:
        for static, new in zip(self.output, self.fn()):
            static.copy_(new)


class StandInGraphMechanism:
    """A CPU stand-in for CUDA graphs, so the runner's whole flow runs in tests.

    Like a real graph it fixes the callable, its input buffers and its output tensor
    at capture; replay must read new inputs only through those buffers. Unlike a real
    graph it re-runs Python, so host-side metadata may change shape between replays.
    """

    name = "stand-in"

    def make_pool(self):
        return None

    def capture(self, fn, pool) -> _StandInGraph:
        return _StandInGraph(fn, fn())


@dataclass
class StaticDecodeBuffers:
    """The graphs' inputs, allocated once for the largest bucket; bucket bs uses rows [:bs]."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    pad_row: int  # the req_to_token row padded requests point at (all slot 0)

    @classmethod
    def allocate(cls, max_bs: int, device, pad_row: int) -> StaticDecodeBuffers:
        def z():
            return torch.zeros(max_bs, dtype=torch.int64, device=device)

        buf = cls(z(), z(), z(), z(), z(), pad_row)
        buf.fill_padding(0, max_bs)
        return buf

    def fill_padding(self, start: int, end: int) -> None:
        """Rows [start, end) become dummy requests: token 0 at position 0, one key (slot 0),
        writing their K/V to the scratch slot 0, which no request owns."""
        if end <= start:
            return
        for t in (self.input_ids, self.positions, self.out_cache_loc):
            t[start:end].zero_()
        self.req_pool_indices[start:end].fill_(self.pad_row)
        self.seq_lens[start:end].fill_(1)

    def load(self, fb, bucket: int) -> list[int]:
        """Copy a decode batch into rows [:bs], pad rows [bs:bucket]; returns the padded host lengths."""
        bs = fb.batch_size
        self.input_ids[:bs].copy_(fb.input_ids, non_blocking=True)
        self.positions[:bs].copy_(fb.positions, non_blocking=True)
        self.req_pool_indices[:bs].copy_(fb.req_pool_indices, non_blocking=True)
        self.seq_lens[:bs].copy_(fb.seq_lens, non_blocking=True)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc, non_blocking=True)
        self.fill_padding(bs, bucket)
        return list(fb.seq_lens_cpu) + [1] * (bucket - bs)


class CudaGraphRunner:
    """Decode and speculative-verify passes replayed from graphs captured per batch-size bucket.

    A decode batch of bs rows replays the graph of the smallest bucket >= bs: its
    tensors are copied into the static input buffers, rows [bs, bucket) become dummy
    requests, the attention backend refreshes its static metadata, the graph replays,
    and the first bs rows of the static logits are returned. With speculative decoding
    on, verify passes (TARGET_VERIFY) get graphs of their own, one per bucket, with
    1 + num_draft_tokens rows per request (cuda_graph_verify.py). Larger batches, extend
    passes and other all-position logits run eagerly. `mechanism` is real CUDA graphs by
    default; tests pass `StandInGraphMechanism()` to run the same flow on CPU.

    A mixture-of-experts model's routing (each block's top-k expert ids, which the trace's
    `moe.routing` event reads) is a graph output too: the captured step returns it beside the
    logits, and a replay hands each block the real rows of its static copy.
    """

    def __init__(self, model_runner, batch_sizes: list[int], mechanism=None):
        self.model_runner = model_runner
        self.batch_sizes = sorted(batch_sizes)
        self.max_bs = self.batch_sizes[-1]
        self.device = torch.device(model_runner.device)
        self.mechanism = mechanism if mechanism is not None else TorchCudaGraphMechanism(self.device)
        self.attn_backend = model_runner.attn_backend
        if self.mechanism.name == "cuda" and not self.attn_backend.cuda_graph_capturable:
            raise ValueError(
                f"the {self.attn_backend.name} attention backend cannot be captured in a CUDA "
                "graph; use --attention-backend flashinfer or triton, or --disable-cuda-graph"
            )
        pool = model_runner.token_to_kv_pool
        self.attn_backend.init_cuda_graph_state(self.max_bs, pool.size + 1 + self.max_bs)
        pad_row = model_runner.req_to_token_pool.reserve_padding_row()
        self.buffers = StaticDecodeBuffers.allocate(self.max_bs, self.device, pad_row)
        self.graphs: dict[int, object] = {}
        self.forward_batches: dict[int, object] = {}
        self.capture_time_s: dict[int, float] = {}
        self.replay_count: dict[int, int] = {}
        self._pool = None  # one memory pool for every bucket's graph
        self.moe_blocks = [blk for _, blk in getattr(model_runner, "moe_blocks", [])]
        # Speculative verify graphs: 1 + num_draft_tokens rows per request, when the backend's
        # extend metadata can live in static buffers (or under the stand-in, which re-plans).
        spec = model_runner.server_args.resolved_num_draft_tokens()
        self.verify_tokens_per_req = 0
        self.verify_graphs: dict[int, object] = {}
        self.verify_batches: dict[int, object] = {}
        self.verify_replay_count: dict[int, int] = {}
        if spec and (self.mechanism.name != "cuda" or self.attn_backend.verify_cuda_graph_capturable):
            from workbench.core.model_executor.cuda_graph_verify import StaticVerifyBuffers

            self.verify_tokens_per_req = 1 + spec
            self.verify_buffers = StaticVerifyBuffers.allocate(
                self.max_bs, self.verify_tokens_per_req, self.device, pad_row
            )

    # ---- decisions (device-neutral) ----------------------------------------------------------
    def can_run(self, fb) -> bool:
        """Graph or eager: graphs cover decode passes of up to max_bs rows (next-token logits only)
        and, with verify graphs, verify passes of up to max_bs requests."""
        return self.plan(fb.forward_mode, fb.batch_size, fb.return_all_logits) is not None

    def plan(self, forward_mode, bs: int, return_all_logits: bool = False) -> int | None:
        """The bucket a pass of this mode and batch size replays, or None (eager)."""
        if not 1 <= bs <= self.max_bs:
            return None
        decode = forward_mode.is_decode() and not return_all_logits
        verify = forward_mode.is_target_verify() and self.verify_tokens_per_req
        return self.bucket_for(bs) if decode or verify else None

    def bucket_for(self, bs: int) -> int | None:
        """The captured batch size a bs-row decode pads to (None: too big, eager)."""
        return pick_bucket(bs, self.batch_sizes)

    # ---- capture ---------------------------------------------------------------------------------
    def _static_batch(self, bs: int, verify: bool = False):
        """The batch a graph is captured with, over the static buffers: decode (one row per request)
        or verify (verify_tokens_per_req rows per request, all-position logits)."""
        from workbench.core.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        mr = self.model_runner
        b, k = (self.verify_buffers, self.verify_tokens_per_req) if verify else (self.buffers, 1)
        n = bs * k
        return ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY if verify else ForwardMode.DECODE,
            batch_size=bs,
            input_ids=b.input_ids[:n],
            positions=b.positions[:n],
            req_pool_indices=b.req_pool_indices[:bs],
            seq_lens=b.seq_lens[:bs],
            out_cache_loc=b.out_cache_loc[:n],
            seq_lens_cpu=[k] * bs,
            extend_seq_lens_cpu=[k] * bs,
            extend_prefix_lens_cpu=[0] * bs,
            return_all_logits=verify,
            req_to_token_pool=mr.req_to_token_pool,
            token_to_kv_pool=mr.token_to_kv_pool,
            attn_backend=self.attn_backend,
        )

    def capture(self, progress: bool = False) -> None:
        """Capture every bucket, largest first: the largest sizes the shared pool, the smaller
        ones reuse its memory (their graphs never run at the same time)."""
        import sys
        import time

        if self._pool is None:
            self._pool = self.mechanism.make_pool()
        pool = self._pool
        t_all = time.perf_counter()
        todo = [bs for bs in reversed(self.batch_sizes) if bs not in self.graphs]
        for i, bs in enumerate(todo):
            t0 = time.perf_counter()
            self.buffers.fill_padding(0, self.max_bs)  # capture runs on dummy rows only
            fb = self._static_batch(bs)
            self.attn_backend.init_forward_metadata_capture_cuda_graph(
                bs, self.buffers.req_pool_indices[:bs], self.buffers.seq_lens[:bs], fb
            )

            with torch.inference_mode():
                self.graphs[bs] = self.mechanism.capture(self._step_fn(fb), pool)
            self.forward_batches[bs] = fb
            self.capture_time_s[bs] = time.perf_counter() - t0
            self.replay_count[bs] = 0
            if self.verify_tokens_per_req:
                t0 = time.perf_counter()
                self._capture_verify(bs, pool)
                self.capture_time_s[bs] += time.perf_counter() - t0
            if progress:
                print(
                    f"capture {self.mechanism.name} graph bs={bs:<4} [{i + 1}/{len(todo)}] "
                    f"{self.capture_time_s[bs]:.2f}s",
                    file=sys.stderr,
                    flush=True,
                )
        if progress and todo:
            what = "decode and verify" if self.verify_tokens_per_req else "decode"
            print(
                f"captured {len(todo)} {what} graphs ({self.mechanism.name}) in {time.perf_counter() - t_all:.1f}s",
                file=sys.stderr,
                flush=True,
            )

    def _step_fn(self, fb):
        """The captured step: (logits, then each MoE block's top-k expert ids) of batch `fb`."""
        model, blocks = self.model_runner.model, self.moe_blocks

        def step():
            logits = model.compute_logits(model(fb.input_ids, fb.positions, fb))
            return (logits, *(blk.experts.last_topk_ids for blk in blocks))

        return step

    def _capture_verify(self, bs: int, pool) -> None:
        self.verify_buffers.fill_padding(0, self.max_bs)
        fb = self._static_batch(bs, verify=True)
        self.attn_backend.init_forward_metadata_capture_verify_cuda_graph(bs, self.verify_buffers, fb)
        with torch.inference_mode():
            self.verify_graphs[bs] = self.mechanism.capture(self._step_fn(fb), pool)
        self.verify_batches[bs] = fb
        self.verify_replay_count[bs] = 0

    def _hand_routing(self, graph, rows) -> None:
        """Each MoE block's expert ids of the real rows (a copy: the next replay overwrites them)."""
        for blk, ids in zip(self.moe_blocks, graph.output[1:]):
            blk.experts.last_topk_ids = ids[rows].clone()

    # ---- replay ----------------------------------------------------------------------------------
    def replay_verify(self, fb) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits of every real row [sum(rows), V], next-token logits [B, V]) of verify batch `fb`."""
        from workbench.core.model_executor.cuda_graph_verify import verify_layout

        bucket = self.plan(fb.forward_mode, fb.batch_size, fb.return_all_logits)
        if bucket is None or not fb.forward_mode.is_target_verify():
            raise ValueError(f"a {fb.forward_mode.name} batch of {fb.batch_size} rows has no verify graph")
        if bucket not in self.verify_graphs:
            self.capture()
        layout = verify_layout(list(fb.extend_seq_lens_cpu), self.verify_tokens_per_req, bucket)
        dest = torch.tensor(layout.dest, dtype=torch.int64).to(self.device, non_blocking=True)
        static_fb = self.verify_batches[bucket]
        static_fb.seq_lens_cpu, static_fb.extend_prefix_lens_cpu = self.verify_buffers.load(fb, layout, dest)
        self.attn_backend.init_forward_metadata_replay_verify_cuda_graph(bucket, self.verify_buffers, static_fb)
        graph = self.verify_graphs[bucket]
        graph.replay()
        self.verify_replay_count[bucket] += 1
        rows = graph.output[0].index_select(0, dest)  # a copy, like replay()'s
        last = torch.tensor(layout.last, dtype=torch.int64).to(self.device, non_blocking=True)
        self._hand_routing(graph, dest)
        return rows, graph.output[0].index_select(0, last)

    def replay(self, fb) -> torch.Tensor:
        """Next-token logits [bs, V] of decode batch `fb` through its bucket's graph."""
        bucket = self.bucket_for(fb.batch_size)
        if bucket is None or not self.can_run(fb) or not fb.forward_mode.is_decode():
            raise ValueError(
                f"a {fb.forward_mode.name} batch of {fb.batch_size} rows has no graph; "
                "check can_run() first and run it eagerly"
            )
        if bucket not in self.graphs:
            self.capture()
        static_fb = self.forward_batches[bucket]
        seq_lens_cpu = self.buffers.load(fb, bucket)
        static_fb.seq_lens_cpu = seq_lens_cpu
        self.attn_backend.init_forward_metadata_replay_cuda_graph(
            bucket, self.buffers.req_pool_indices[:bucket], self.buffers.seq_lens[:bucket], seq_lens_cpu, static_fb
        )
        graph = self.graphs[bucket]
        graph.replay()
        self.replay_count[bucket] += 1
        self._hand_routing(graph, slice(0, fb.batch_size))
        # A copy: the next replay overwrites the static output while this batch's logits may
        # still be read (the overlap loop processes a result after launching the next batch).
        return graph.output[0][: fb.batch_size].clone()


def maybe_create_cuda_graph_runner(model_runner) -> CudaGraphRunner | None:
    """The runner for `--disable-cuda-graph` off on CUDA, or None (CPU, disabled, or unsupported).

    `--cuda-graph-stand-in` builds it on any device with the stand-in mechanism: the whole
    graph bookkeeping (buckets, padding, trace) runs, replay re-runs the captured step.
    """
    import logging

    args = model_runner.server_args
    stand_in = bool(getattr(args, "cuda_graph_stand_in", False))
    if args.disable_cuda_graph or (torch.device(model_runner.device).type != "cuda" and not stand_in):
        return None
    if not stand_in and any(type(m).__name__ == "FusedMoE" for m in model_runner.model.modules()):
        from workbench.core.layers.moe import _triton_installed

        if not _triton_installed():  # the CPU-style expert loop reads counts on the host: not capturable
            logging.getLogger(__name__).warning("CUDA graphs off: MoE experts without triton run eagerly")
            return None
    if not stand_in and any(
        getattr(m, "sliding_window_size", None) or getattr(m, "logit_cap", 0) for m in model_runner.model.modules()
    ):
        # masked_attention.py picks its path per batch from host-side lengths and loops over
        # requests: not capturable. Window and soft cap in the graph kernels are future work.
        logging.getLogger(__name__).warning("CUDA graphs off: windowed or soft-capped attention runs eagerly")
        return None
    if not stand_in and not model_runner.attn_backend.cuda_graph_capturable:
        logging.getLogger(__name__).warning(
            "CUDA graphs off: the %s attention backend cannot be captured (use flashinfer or triton)",
            model_runner.attn_backend.name,
        )
        return None
    max_bs = min(args.cuda_graph_max_bs, model_runner.max_running_requests)
    if args.cuda_graph_bs:
        max_bs = min(max(args.cuda_graph_bs), model_runner.max_running_requests)
    runner = CudaGraphRunner(
        model_runner,
        get_cuda_graph_batch_sizes(max_bs, args.cuda_graph_bs),
        StandInGraphMechanism() if stand_in else None,
    )
    runner.capture(progress=args.show_progress)
    return runner
