"""ModelRunner: loads the weights, sizes the KV pools, and runs forward passes.

It is the only place that touches the model: the scheduler hands it a
ForwardBatch and gets logits back; the sampler turns those into tokens.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from workbench.core.args import ServerArgs, choose_cpu_dtype
from workbench.core.distributed.parallel_state import (
    all_reduce_min_int,
    init_tp_group,
    set_moe_ep_size,
    set_tp_group,
    tensor_model_parallel_broadcast_,
)
from workbench.core.distributed.topology import validate_tp_for_model
from workbench.core.layers.logits_processor import LogitsOutput, LogitsProcessor
from workbench.core.layers.moe import sparse_moe_blocks
from workbench.core.layers.sampler import Sampler
from workbench.core.mem_cache.huge_pages import Rehomed, rehome_parameters
from workbench.core.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from workbench.core.model_executor.cpu_allocator import tune_glibc_malloc
from workbench.core.model_executor.cpu_compile_runner import TorchCompileDecodeRunner
from workbench.core.model_executor.cuda_graph_runner import maybe_create_cuda_graph_runner
from workbench.core.model_executor.forward_batch_info import ForwardBatch
from workbench.core.model_executor.model_config import ModelConfig
from workbench.core.model_loader import iter_weights, prepare_model
from workbench.core.models.registry import get_model_class
from workbench.core.trace.startup import report_phase

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_GB = 0.5


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        name = choose_cpu_dtype() if device == "cpu" else "bfloat16"
    return DTYPES[name]


class ModelRunner:
    def __init__(
        self,
        server_args: ServerArgs,
        tp_rank: int = 0,
        tp_size: int = 1,
        prepared=None,
        max_req_rows: int | None = None,
    ):
        self.server_args = server_args
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.device = server_args.resolved_device()
        self.torch_device = torch.device(self.device)
        self.dtype = resolve_dtype(server_args.dtype, self.device)
        kv_name = server_args.kv_cache_dtype
        self.kv_dtype = self.dtype if kv_name == "auto" else DTYPES[kv_name]
        if server_args.dtype == "auto":
            logger.info("dtype auto -> %s on %s", str(self.dtype).replace("torch.", ""), self.device)
        if server_args.num_threads:
            torch.set_num_threads(server_args.num_threads)
        torch.manual_seed(server_args.random_seed)

        self.huge_pages = Rehomed(skipped="not a CPU model")  # set by load_model on CPU
        t0 = time.monotonic()
        self.prepared = prepared or prepare_model(server_args.model_path, progress=server_args.show_progress)
        gen_eos = _generation_eos(self.prepared.model_dir)
        self.model_config = ModelConfig.from_hf(self.prepared.config, server_args.context_length, gen_eos)
        self.init_torch_distributed()
        report_phase("weights", os.path.basename(str(self.prepared.model_dir).rstrip("/")))
        self.load_model()
        self.load_time_s = time.monotonic() - t0
        report_phase("warmup")
        self.moe_blocks = sparse_moe_blocks(self.model)  # (layer id, block) of each MoE layer

        self.init_memory_pool(max_req_rows)
        self.attn_backend = self._make_attn_backend()
        self.logits_processor = LogitsProcessor(self.model_config.vocab_size)
        self.sampler = Sampler()
        self.batch_invariant = server_args.enable_deterministic_inference
        self.lora_manager = self._init_lora() if server_args.enable_lora else None
        if self.batch_invariant:
            self._enable_batch_invariant_mode()
        self.decode_runner: TorchCompileDecodeRunner | None = None
        compile_ok = not self.batch_invariant and self.lora_manager is None  # (they run op by op)
        if server_args.enable_torch_compile and self.tp_size == 1 and compile_ok:
            self.decode_runner = TorchCompileDecodeRunner(
                self, min(server_args.torch_compile_max_bs, self.max_running_requests)
            )
        # Decode through CUDA graphs (CUDA only; captured here, before the first request).
        self.graph_runner = maybe_create_cuda_graph_runner(self) if self.lora_manager is None else None

    # ---- set-up -------------------------------------------------------------
    def init_torch_distributed(self) -> None:
        """Join the TP group (tp_size > 1) before any layer is built: layers read their rank at build time."""
        validate_tp_for_model(self.prepared.config, self.tp_size)
        set_moe_ep_size(self.server_args.ep_size)
        if self.tp_size == 1:
            set_tp_group(0, 1)
            return
        if not self.server_args.dist_init_addr:
            raise ValueError("tp_size > 1 needs --dist-init-addr HOST:PORT (the Engine picks one on a single node)")
        backend = "gloo"
        if self.device == "cuda":
            import torch.distributed as dist

            per_node = self.tp_size // self.server_args.nnodes
            # "cuda" then means this rank's GPU everywhere (.to("cuda") uses the current device).
            torch.cuda.set_device(self.tp_rank % per_node)
            backend = "nccl" if dist.is_nccl_available() else "gloo"
        init_tp_group(self.tp_rank, self.tp_size, self.server_args.dist_init_addr, backend)

    def load_model(self) -> None:
        cls = get_model_class(self.model_config.architecture)
        with torch.device("cpu"):
            torch.set_default_dtype(self.dtype)
            try:
                self.model = cls(self.model_config.hf_config)
            finally:
                torch.set_default_dtype(torch.float32)
        self.model.load_weights(iter_weights(self.prepared.model_dir, progress=self.server_args.show_progress))
        self.model.to(self.device).eval()
        # RoPE tables stay float32 (positions must be exact); everything else is in self.dtype.
        # Packed oneDNN weights: ~2x faster decode GEMMs on CPU (see layers/linear.py).
        pack = self.device == "cpu" and os.environ.get("WORKBENCH_CPU_PACK", "1") != "0"
        if self.device == "cpu":  # batch-1 decode streams every weight: on 2 MiB pages it streams faster
            self.huge_pages = rehome_parameters(self.model)
        self.model.process_weights_after_loading(pack=pack)
        if self.device == "cpu":
            tune_glibc_malloc()  # warm activation pages across passes (see cpu_allocator.py)

    def init_memory_pool(self, max_req_rows: int | None) -> None:
        mc = self.model_config
        kv_heads = max(1, mc.num_key_value_heads // self.tp_size)
        bytes_per_token = 2 * mc.num_layers * kv_heads * mc.head_dim * torch.finfo(self.kv_dtype).bits // 8
        if self.server_args.max_total_tokens:
            tokens = self.server_args.max_total_tokens
        else:
            budget_gb = self.server_args.kv_cache_memory_gb or DEFAULT_CPU_KV_GB
            if self.device == "cuda":
                free, _ = torch.cuda.mem_get_info()
                budget_gb = free * self.server_args.mem_fraction_static / 2**30
            tokens = int(budget_gb * 2**30 // bytes_per_token)
        # Every rank must run the same schedule, so all use the smallest pool any rank can hold.
        self.max_total_num_tokens = tokens = all_reduce_min_int(tokens)
        self.max_running_requests = min(self.server_args.max_running_requests, max_req_rows or 10**9)
        # One extra row beyond the running cap: a request being retracted/chunked never starves.
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests + 1, mc.context_len + 8, self.device)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(tokens, self.device)
        self.token_to_kv_pool = MHATokenToKVPool(
            tokens, self.kv_dtype, kv_heads, mc.head_dim, mc.num_layers, self.device
        )

    def _enable_batch_invariant_mode(self) -> None:
        """--enable-deterministic-inference: batch-invariant linears, norms, LM head and attention
        (core/layers/batch_invariant.py); refuses what has no batch-invariant path, saying what to drop."""
        from workbench.core.layers import batch_invariant

        reason = batch_invariant.unavailable_reason(self.device, self.dtype)
        reason = reason or batch_invariant.model_unsupported_reason(self.model)
        if reason is None and not isinstance(self.attn_backend, batch_invariant.DeterministicCpuAttnBackend):
            reason = (
                f"--enable-deterministic-inference attends with the cpu_paged kernels, not "
                f"{self.attention_backend_name}; drop --attention-backend"
            )
        if reason:
            raise ValueError(reason)
        batch_invariant.enable_batch_invariant_mode(self.model)
        self.logits_processor._head = batch_invariant.lm_head_logits  # type: ignore[method-assign]
        logger.info("deterministic inference: batch-invariant linears, norms and attention")

    def _init_lora(self):
        """--enable-lora: the adapter manager (core/lora/), its hooks in the model's linears, and the
        --lora-paths adapters loaded. The fused batch-1 decode, torch.compile and CUDA graphs run the
        base weights only, so batches with an adapter take the op-by-op path."""
        from workbench.core.lora.manager import LoRAManager

        if self.server_args.enable_deterministic_inference:
            raise ValueError("--enable-lora has no batch-invariant path; drop --enable-deterministic-inference")
        if self.server_args.enable_hierarchical_cache:
            raise ValueError("--enable-lora keys the radix cache by adapter, which HiCache does not: drop one of them")
        return LoRAManager(self.model, self.server_args, self.dtype, self.torch_device, self.tp_rank)

    def _make_attn_backend(self):
        from workbench.core.layers.attention.registry import choose_attention_backend, create_attn_backend

        mc = self.model_config
        q_heads, kv_heads = max(1, mc.num_attention_heads // self.tp_size), self.token_to_kv_pool.head_num
        if self.server_args.enable_deterministic_inference and self.server_args.attention_backend in (
            None,
            "cpu_paged",
        ):
            from workbench.core.layers import batch_invariant, cpu_ops

            if self.device == "cpu" and not cpu_ops.shape_unsupported_reason(q_heads, kv_heads, mc.head_dim):
                self.attention_backend_name = "cpu_paged"
                return batch_invariant.DeterministicCpuAttnBackend(group_size=q_heads // max(1, kv_heads))
        name = choose_attention_backend(
            self.server_args.attention_backend,
            torch.device(self.device).type,
            self.dtype,
            q_heads,
            kv_heads,
            mc.head_dim,
        )
        self.attention_backend_name = name  # the one in effect (get_server_info reports it)
        return create_attn_backend(name, self.device, q_heads, kv_heads, mc.head_dim, self.dtype, self.kv_dtype)

    # ---- execution ----------------------------------------------------------
    def forward(self, fb: ForwardBatch) -> LogitsOutput:
        """One pass: next-token logits (and, for a mixture of experts, where its tokens were routed)."""
        if self.lora_manager is None:
            out = self._forward(fb)
        else:  # group the rows by adapter for the linears' LoRA hooks, for this pass only
            self.lora_manager.prepare(fb.lora_paths, fb.extend_seq_lens_cpu, self.torch_device)
            try:
                out = self._forward(fb)
            finally:
                self.lora_manager.finish()
        if self.moe_blocks:
            ids = [block.experts.last_topk_ids for _, block in self.moe_blocks]
            recorded = [layer_ids for layer_ids in ids if layer_ids is not None]
            # Every sparse layer records its tokens' experts in each pass; short of that, no routing.
            out.routing = recorded if len(recorded) == len(ids) else None
        return out

    @torch.inference_mode()
    def _forward(self, fb: ForwardBatch) -> LogitsOutput:
        if self.torch_device.type != "cpu":
            fb.to(self.torch_device)
        fb.req_to_token_pool = self.req_to_token_pool
        fb.token_to_kv_pool = self.token_to_kv_pool
        fb.attn_backend = self.attn_backend
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            if fb.forward_mode.is_target_verify():
                rows, last = self.graph_runner.replay_verify(fb)
                return LogitsOutput(next_token_logits=last, all_logits=rows)
            return LogitsOutput(next_token_logits=self.graph_runner.replay(fb))
        if self.decode_runner is not None and self.decode_runner.can_run(fb):
            return LogitsOutput(next_token_logits=self.decode_runner.forward(fb))
        self.attn_backend.init_forward_metadata(fb)
        hidden = self.model(fb.input_ids, fb.positions, fb)
        is_decode = fb.forward_mode.is_decode()
        if fb.return_all_logits and fb.all_logits_reqs is not None and not is_decode:
            return self._some_rows_logits(hidden, fb)
        if fb.return_all_logits:
            last = torch.arange(fb.batch_size) if is_decode else fb.last_token_index
            if self.tp_size > 1:  # the head is vocab-sharded: compute_logits gathers the shards
                all_logits = self.model.compute_logits(hidden)
                return LogitsOutput(
                    next_token_logits=all_logits.index_select(0, last.to(hidden.device)), all_logits=all_logits
                )
            out = self.logits_processor(
                hidden, self.model.lm_head.weight, last.to(hidden.device), return_all_positions=True
            )
            cap = getattr(self.model, "final_logit_softcapping", 0.0)
            if cap:  # Gemma 2: what compute_logits applies on the other paths
                out.next_token_logits = torch.tanh(out.next_token_logits / cap) * cap
                out.all_logits = torch.tanh(out.all_logits / cap) * cap
            return out
        # Next-token logits only (the common case): the model's packed LM head on the last rows.
        if not is_decode:
            hidden = hidden.index_select(0, fb.last_token_index.to(hidden.device))
        return LogitsOutput(next_token_logits=self.model.compute_logits(hidden))

    def _some_rows_logits(self, hidden: torch.Tensor, fb: ForwardBatch) -> LogitsOutput:
        """Prompt logprobs asked by some requests of a prefill: every row of theirs (all_logits, in
        batch order) and the last row of each request (next_token_logits, on the common path, so a
        request that did not ask samples from the same logits as in a batch without such requests)."""
        assert fb.all_logits_reqs is not None
        rows = [
            r
            for start, n, asked in zip(fb.extend_start_loc_cpu, fb.extend_seq_lens_cpu, fb.all_logits_reqs)
            if asked
            for r in range(start, start + n)
        ]
        picked = hidden.index_select(0, torch.tensor(rows, dtype=torch.int64, device=hidden.device))
        if self.tp_size > 1:  # the head is vocab-sharded: compute_logits gathers the shards
            all_logits = self.model.compute_logits(picked)
        else:
            all_logits = self.logits_processor._head(
                picked, self.model.lm_head.weight[: self.logits_processor.vocab_size]
            )
            cap = getattr(self.model, "final_logit_softcapping", 0.0)
            if cap:  # Gemma 2: what compute_logits applies on the other paths
                all_logits = torch.tanh(all_logits / cap) * cap
        last = hidden.index_select(0, fb.last_token_index.to(hidden.device))
        return LogitsOutput(next_token_logits=self.model.compute_logits(last), all_logits=all_logits)

    @property
    def kv_head_num(self) -> int:
        """KV heads this rank's pool holds (the model's, split over the TP ranks)."""
        return self.token_to_kv_pool.head_num

    def graph_plan(self, forward_mode, batch_size: int, return_all_logits: bool = False) -> tuple[bool, int]:
        """(CUDA graph replayed?, padded batch size) for a pass, as `forward` will run it (for the trace)."""
        if self.graph_runner is not None and batch_size > 0:
            bucket = self.graph_runner.plan(forward_mode, batch_size, return_all_logits)
            if bucket is not None:
                return True, bucket
        runner = self.decode_runner
        if runner is not None and forward_mode.is_decode() and not return_all_logits and batch_size > 0:
            bucket = runner.bucket_for(batch_size)
            if bucket is not None:
                return False, bucket
        return False, batch_size

    @torch.inference_mode()
    def sample(
        self, logits_output: LogitsOutput, sampling_info, return_logprob: bool = False, top_logprobs_num: int = 0
    ):
        out = self.sampler(logits_output.next_token_logits, sampling_info, return_logprob, top_logprobs_num)
        if self.tp_size > 1:
            # Every rank must append the same token; rank 0's choice is the one streamed out.
            tensor_model_parallel_broadcast_(out.next_token_ids)
        return out


def _generation_eos(model_dir) -> list[int]:
    """EOS ids from generation_config.json (chat models often add <|im_end|> / <|eot_id|> there)."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return []
    return [eos] if isinstance(eos, int) else list(eos or [])
