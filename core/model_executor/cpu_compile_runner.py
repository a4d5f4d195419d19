"""`torch.compile`d decode steps on CPU (`--enable-torch-compile`), one graph per batch-size bucket.

The device-neutral bucket and padding logic is shared with the CUDA graph runner
(cuda_graph_runner.py); why this stays opt-in on CPU is in TorchCompileDecodeRunner's docstring.
"""

from __future__ import annotations

import torch
from workbench.core.model_executor.cuda_graph_runner import get_batch_size_buckets, pad_decode_batch, pick_bucket

# Attention is one opaque custom op: dynamo sees fixed shapes (q, k, v: [bucket, H, D]),
# while the ragged part (this step's KV slot table, whose length L changes every step)
# is handed over out of band in `_DECODE_CONTEXT`, so it never causes a recompile.
_DECODE_CONTEXT: dict = {}


@torch.library.custom_op("workbench::decode_attention", mutates_args=())
def _decode_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scaling: float
) -> torch.Tensor:
    from workbench.core.layers.attention.torch_native_backend import decode_attention

    pool, loc, meta = _DECODE_CONTEXT["pool"], _DECODE_CONTEXT["out_cache_loc"], _DECODE_CONTEXT["meta"]
    pool.set_kv_buffer(layer_id, loc, k, v)
    out = decode_attention(q, pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id), meta, scaling)
    return out.contiguous()


@_decode_attention_op.register_fake
def _decode_attention_fake(q, k, v, layer_id, scaling):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


class _OpaqueAttnBackend:
    """What RadixAttention calls while the compiled step is traced: the custom op."""

    def forward(self, q, k, v, layer, forward_batch):
        return torch.ops.workbench.decode_attention(q, k, v, layer.layer_id, layer.scaling)


class _CompiledBatch:
    """The only forward-batch attribute the model reads inside the compiled step."""

    def __init__(self):
        self.attn_backend = _OpaqueAttnBackend()


class TorchCompileDecodeRunner:
    """Decode passes through `torch.compile(dynamic=False)`, one graph per batch-size bucket.

    Graphs compile lazily on a bucket's first use (`capture()` compiles them all
    up front); `compile_time_s` records how long each took. Batches larger than
    the last bucket, extend passes, and all-position logits run eagerly.

    Opt-in (`--enable-torch-compile`) and, on the 2-core CPU target, not a win:
    a bucket takes 50-120 s to compile, and a SmolLM2-135M decode step ran ~1.2-1.5x
    slower than eager (inductor's GEMMs on plain weights lose to the eager path's
    oneDNN-packed ones by more than its fused elementwise kernels gain; a variant
    with per-layer graphs and packed-GEMM custom ops was slower still). It is kept
    as the device-neutral home of the bucket/pad logic a CUDA-graph runner reuses.
    """

    def __init__(self, model_runner, max_bs: int):
        import torch._dynamo

        self.model_runner = model_runner
        self.buckets = get_batch_size_buckets(max_bs)
        self.compile_time_s: dict[int, float] = {}
        self._batch = _CompiledBatch()
        # One graph per bucket: allow that many recompiles of the step.
        limit = len(self.buckets) + 4
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, limit)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, limit * 8
        )
        model = model_runner.model
        model.model.rotary_emb.table(model_runner.dtype)  # cast the RoPE table before tracing

        def step(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            hidden = model.model(input_ids, positions, self._batch)
            return model.compute_logits(hidden)

        self._step = torch.compile(step, dynamic=False, fullgraph=True)

    def can_run(self, fb) -> bool:
        return fb.forward_mode.is_decode() and not fb.return_all_logits and fb.batch_size <= self.buckets[-1]

    def bucket_for(self, bs: int) -> int | None:
        """The compiled batch size a bs-row decode pads to (None: too big, eager)."""
        return pick_bucket(bs, self.buckets)

    def forward(self, fb) -> torch.Tensor:
        """Next-token logits [B, V] float32 of a decode batch."""
        import time

        mr = self.model_runner
        bucket = pick_bucket(fb.batch_size, self.buckets)
        slots = mr.req_to_token_pool.req_to_token.index_select(0, fb.req_pool_indices)[:, : max(fb.seq_lens_cpu)]
        padded = pad_decode_batch(bucket, fb.input_ids, fb.positions, fb.out_cache_loc, fb.seq_lens_cpu, slots)
        from workbench.core.layers.attention.torch_native_backend import decode_metadata_from_slots

        meta = decode_metadata_from_slots(
            padded.slot_table, padded.seq_lens, padded.seq_lens_cpu, mr.token_to_kv_pool.head_num
        )
        _DECODE_CONTEXT.update(pool=mr.token_to_kv_pool, out_cache_loc=padded.out_cache_loc, meta=meta)
        try:
            first = bucket not in self.compile_time_s
            t0 = time.perf_counter()
            logits = self._step(padded.input_ids, padded.positions)
            if first:
                self.compile_time_s[bucket] = time.perf_counter() - t0
        finally:
            _DECODE_CONTEXT.clear()
        return logits[: fb.batch_size]

    def capture(self, progress: bool = False) -> None:
        """Compile every bucket now, on dummy rows that only touch the scratch KV slot 0."""
        from workbench.core.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        mr = self.model_runner
        row = mr.req_to_token_pool.alloc(1)
        if row is None:
            raise RuntimeError("no free request row to capture with")
        try:
            mr.req_to_token_pool.req_to_token[row[0], 0] = 0
            for bs in self.buckets:
                if bs in self.compile_time_s:
                    continue
                dev = mr.req_to_token_pool.device
                zeros = torch.zeros(bs, dtype=torch.int64, device=dev)
                fb = ForwardBatch(
                    forward_mode=ForwardMode.DECODE,
                    batch_size=bs,
                    input_ids=zeros,
                    positions=zeros,
                    req_pool_indices=torch.full((bs,), int(row[0]), dtype=torch.int64, device=dev),
                    seq_lens=torch.ones(bs, dtype=torch.int64, device=dev),
                    out_cache_loc=zeros,
                    seq_lens_cpu=[1] * bs,
                    extend_seq_lens_cpu=[1] * bs,
                    extend_prefix_lens_cpu=[0] * bs,
                )
                with torch.inference_mode():
                    self.forward(fb)
                if progress:
                    print(f"compiled decode bucket bs={bs} in {self.compile_time_s[bs]:.1f}s", flush=True)
        finally:
            mr.req_to_token_pool.free(row)
