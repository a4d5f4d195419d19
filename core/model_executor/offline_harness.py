"""Drive a ModelRunner directly, without the scheduler process.

Used by the correctness tests (greedy tokens vs transformers, prefix reuse) and
the model benchmark. It does by hand, simply, what the scheduler does for real:
allocate a pool row and KV slots, run extend passes (optionally a prefix first,
then the rest on top of it), then batched decode passes until every request stops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from workbench.core.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from workbench.core.model_executor.model_runner import ModelRunner
from workbench.core.sampling.sampling_batch_info import SamplingBatchInfo, make_generator
from workbench.core.sampling.sampling_params import SamplingParams


@dataclass
class OfflineResult:
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass
class _Seq:
    prompt: list[int]
    params: SamplingParams
    row: int
    kv_len: int = 0  # tokens whose K/V is in the pool
    result: OfflineResult = field(default_factory=OfflineResult)
    generator: torch.Generator | None = None
    done: bool = False


class OfflineHarness:
    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def generate(
        self,
        prompts: Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams],
        prefix_lens: Sequence[int] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        share_prefix: bool = False,
    ) -> list[OfflineResult]:
        """Generate for every prompt in one continuous batch; returns per-prompt results.

        prefix_lens: each prompt's first n tokens are prefilled in a pass of their own first. With
        share_prefix, prompts whose prefixes are equal point their pool rows at the same KV slots,
        computed once, as the radix cache makes requests with a common system prompt do.
        """
        r = self.runner
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        rows = r.req_to_token_pool.alloc(len(prompts))
        if rows is None:
            raise RuntimeError("not enough request rows for this batch")
        seqs = [
            _Seq(list(p), sp, row, generator=make_generator(sp.seed) if sp.seed is not None else None)
            for p, sp, row in zip(prompts, params, rows)
        ]
        try:
            if prefix_lens is not None:
                with_prefix = [(s, list(s.prompt[:n])) for s, n in zip(seqs, prefix_lens) if n > 0]
                if share_prefix:
                    self._share_prefixes(with_prefix)
                elif with_prefix:
                    self._extend([s for s, _ in with_prefix], [t for _, t in with_prefix], sample=False)
                self._extend(
                    seqs,
                    [list(s.prompt[n:]) for s, n in zip(seqs, prefix_lens)],
                    return_logprob=return_logprob,
                    top_logprobs_num=top_logprobs_num,
                )
            else:
                self._extend(
                    seqs, [s.prompt for s in seqs], return_logprob=return_logprob, top_logprobs_num=top_logprobs_num
                )
            while any(not s.done for s in seqs):
                self._decode([s for s in seqs if not s.done], return_logprob, top_logprobs_num)
        finally:
            used = [r.req_to_token_pool.req_to_token[s.row, : s.kv_len] for s in seqs]
            if used:
                r.token_to_kv_pool_allocator.free(torch.unique(torch.cat(used)))  # shared slots once
            r.req_to_token_pool.free(rows)
        return [s.result for s in seqs]

    def _share_prefixes(self, with_prefix: list[tuple[_Seq, list[int]]]) -> None:
        """Prefill each distinct prefix once (in one pass for its first holders); the later
        holders' rows point at the same slots."""
        first: dict[tuple[int, ...], _Seq] = {}
        for s, toks in with_prefix:
            first.setdefault(tuple(toks), s)
        leaders = [(s, toks) for s, toks in with_prefix if first[tuple(toks)] is s]
        if leaders:
            self._extend([s for s, _ in leaders], [t for _, t in leaders], sample=False)
        table = self.runner.req_to_token_pool.req_to_token
        for s, toks in with_prefix:
            lead = first[tuple(toks)]
            if lead is not s:
                table[s.row, : len(toks)] = table[lead.row, : len(toks)]
                s.kv_len = len(toks)

    # ---- passes ---------------------------------------------------------------
    def _extend(
        self,
        seqs: list[_Seq],
        new_tokens: list[list[int]],
        sample: bool = True,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> None:
        r = self.runner
        total = sum(len(t) for t in new_tokens)
        loc = self._alloc(total)
        ids, pos, offset = [], [], 0
        for s, toks in zip(seqs, new_tokens):
            n = len(toks)
            r.req_to_token_pool.req_to_token[s.row, s.kv_len : s.kv_len + n] = loc[offset : offset + n]
            ids += toks
            pos += range(s.kv_len, s.kv_len + n)
            offset += n
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=len(seqs),
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            req_pool_indices=torch.tensor([s.row for s in seqs], dtype=torch.int64),
            seq_lens=torch.tensor([s.kv_len + len(t) for s, t in zip(seqs, new_tokens)], dtype=torch.int64),
            out_cache_loc=loc,
            seq_lens_cpu=[s.kv_len + len(t) for s, t in zip(seqs, new_tokens)],
            extend_seq_lens_cpu=[len(t) for t in new_tokens],
            extend_prefix_lens_cpu=[s.kv_len for s in seqs],
        )
        logits = r.forward(fb)
        for s, t in zip(seqs, new_tokens):
            s.kv_len += len(t)
        if sample:
            self._sample(seqs, logits, return_logprob, top_logprobs_num)

    def _decode(self, seqs: list[_Seq], return_logprob: bool, top_logprobs_num: int) -> None:
        r = self.runner
        loc = self._alloc(len(seqs))
        for s, slot in zip(seqs, loc):
            r.req_to_token_pool.req_to_token[s.row, s.kv_len] = slot
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=len(seqs),
            input_ids=torch.tensor([s.result.output_ids[-1] for s in seqs], dtype=torch.int64),
            positions=torch.tensor([s.kv_len for s in seqs], dtype=torch.int64),
            req_pool_indices=torch.tensor([s.row for s in seqs], dtype=torch.int64),
            seq_lens=torch.tensor([s.kv_len + 1 for s in seqs], dtype=torch.int64),
            out_cache_loc=loc,
            seq_lens_cpu=[s.kv_len + 1 for s in seqs],
            extend_seq_lens_cpu=[1] * len(seqs),
            extend_prefix_lens_cpu=[s.kv_len for s in seqs],
        )
        logits = r.forward(fb)
        for s in seqs:
            s.kv_len += 1
        self._sample(seqs, logits, return_logprob, top_logprobs_num)

    def _sample(self, seqs, logits, return_logprob, top_logprobs_num) -> None:
        r = self.runner
        eos = r.model_config.eos_token_ids
        info = SamplingBatchInfo.from_reqs(
            [s.params for s in seqs],
            output_ids=[s.result.output_ids for s in seqs],
            prompt_ids=[s.prompt for s in seqs],
            vocab_size=r.model_config.vocab_size,
            eos_ids=[s.params.finish_token_ids(eos) for s in seqs],
            generators=[s.generator for s in seqs],
            device=r.device,
        )
        out = r.sample(logits, info, return_logprob, top_logprobs_num)
        ids = out.next_token_ids.tolist()
        for i, (s, tok) in enumerate(zip(seqs, ids)):
            s.result.output_ids.append(tok)
            if out.logprobs is not None:
                s.result.logprobs.append(float(out.logprobs[i]))
            if out.top_logprobs is not None:
                vals, tids = out.top_logprobs
                s.result.top_logprobs.append(list(zip(tids[i].tolist(), vals[i].tolist())))
            stop_ids = set(s.params.stop_token_ids or [])
            if not s.params.ignore_eos:
                stop_ids |= set(eos)
            if len(s.result.output_ids) >= s.params.max_new_tokens or tok in stop_ids:
                s.done = True

    def _alloc(self, n: int) -> torch.Tensor:
        loc = self.runner.token_to_kv_pool_allocator.alloc(n)
        if loc is None:
            raise RuntimeError(f"KV pool exhausted: {n} slots wanted")
        return loc
