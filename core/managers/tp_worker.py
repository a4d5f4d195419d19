"""TpModelWorker: the scheduler's handle on one tensor-parallel rank's ModelRunner.

It turns a ModelWorkerBatch into a ForwardBatch, runs the forward pass and samples.
`forward_batch_generation` is the synchronous call the normal event loop uses;
the overlap loop drives `forward_batch` from a background thread instead
(`tp_worker_overlap_thread.TpModelWorkerClient`).
"""

from __future__ import annotations

import time

import torch
from workbench.core.layers.logits_processor import LogitsOutput, PromptLogprobs, compute_prompt_logprobs
from workbench.core.managers.schedule_batch import ModelWorkerBatch
from workbench.core.managers.scheduler_contract import ForwardOutput, GenerationBatchResult
from workbench.core.model_executor.forward_batch_info import ForwardBatch
from workbench.core.model_executor.model_runner import ModelRunner

__all__ = ["ForwardOutput", "GenerationBatchResult", "TpModelWorker"]


class TpModelWorker:
    """The real ModelWorker (scheduler_contract.py): one rank's ModelRunner, forward + sample."""

    def __init__(self, server_args, tp_rank: int = 0, tp_size: int = 1, prepared=None):
        self.model_runner = ModelRunner(server_args, tp_rank=tp_rank, tp_size=tp_size, prepared=prepared)
        self.tp_rank = tp_rank

    @torch.inference_mode()
    def forward_batch(self, mwb: ModelWorkerBatch) -> ForwardOutput:
        """Forward + sample `mwb`; `mwb.input_ids` must hold real token ids (no placeholders)."""
        fb = ForwardBatch(
            forward_mode=mwb.forward_mode,
            batch_size=len(mwb.seq_lens_cpu),
            input_ids=mwb.input_ids,
            positions=mwb.positions,
            req_pool_indices=mwb.req_pool_indices,
            seq_lens=mwb.seq_lens,
            out_cache_loc=mwb.out_cache_loc,
            seq_lens_cpu=mwb.seq_lens_cpu,
            extend_seq_lens_cpu=mwb.extend_seq_lens_cpu,
            extend_prefix_lens_cpu=mwb.extend_prefix_lens_cpu,
            return_all_logits=mwb.return_all_logits,
            all_logits_reqs=mwb.all_logits_reqs,
            lora_paths=mwb.lora_paths,
        )
        logits = self.model_runner.forward(fb)
        if mwb.spec_rows is not None:
            # Speculative verify: a token at every position (the target's choice after each draft).
            if logits.all_logits is None:  # a verify batch asks for them (return_all_logits)
                raise RuntimeError("a speculative verify pass needs the logits of every position")
            rows = LogitsOutput(next_token_logits=logits.all_logits, routing=logits.routing)
            return ForwardOutput(rows, self.model_runner.sample(rows, mwb.sampling_info), None)
        sampler_out = self.model_runner.sample(logits, mwb.sampling_info, mwb.return_logprob, mwb.top_logprobs_num)
        prompt_lp = None
        if mwb.return_all_logits and logits.all_logits is not None:
            prompt_lp = self._prompt_logprobs(mwb, logits.all_logits)
        return ForwardOutput(logits, sampler_out, prompt_lp)

    @staticmethod
    def _prompt_logprobs(mwb: ModelWorkerBatch, all_logits: torch.Tensor) -> list[PromptLogprobs | None]:
        """Per request of the batch, its prompt logprobs (None for one that did not ask): all_logits
        holds the rows of the requests in mwb.all_logits_reqs only (every request's when None)."""
        asked = mwb.all_logits_reqs or [True] * len(mwb.extend_seq_lens_cpu)
        ids, lens, start = [], [], 0
        for n, a in zip(mwb.extend_seq_lens_cpu, asked):
            if a:
                ids.append(mwb.input_ids[start : start + n])
                lens.append(n)
            start += n
        computed = iter(compute_prompt_logprobs(all_logits, torch.cat(ids), lens, mwb.top_logprobs_num))
        return [next(computed) if a else None for a in asked]

    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> GenerationBatchResult:
        t0 = time.perf_counter()
        out = self.forward_batch(mwb)
        return GenerationBatchResult(
            out.logits_output,
            out.sampler_output,
            out.sampler_output.next_token_ids.tolist(),
            (time.perf_counter() - t0) * 1000,
            out.prompt_logprobs,
        )
