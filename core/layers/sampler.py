"""Sampler: next-token choice from a batch of logits.

Order of operations, per row:
1. penalties (repetition, frequency, presence) and `min_new_tokens` (stop ids to -inf);
2. greedy rows (temperature 0 or top_k 1): argmax of the penalized logits, exactly;
3. sampled rows: divide by temperature, softmax, then top-k, top-p and min-p, each
   acting on what the previous filter left (renormalized), then renormalize and
   draw with torch.multinomial.

Randomness: a row whose request has a seed draws from its own generator, one
row at a time, so the same seed gives the same tokens whatever else is in the
batch; the other sampled rows share one draw from the sampler's generator (or
torch's global one).

Logprobs are those of the RAW model distribution: log_softmax of the logits as
they came in, before penalties, min_new_tokens and temperature (as SGLang does
by default). They describe the model, not the sampling procedure.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from workbench.core.sampling.sampling_batch_info import SamplingBatchInfo


@dataclass
class SamplerOutput:
    """What one sampling step returns (all tensors on the logits' device)."""

    next_token_ids: torch.Tensor                              # [B] int64
    logprobs: Optional[torch.Tensor] = None                   # [B] float32, raw logprob of the chosen id
    top_logprobs: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (values [B, k], ids [B, k]), sorted


class Sampler(nn.Module):
    """Turns logits [B, V] into one token per row, following `SamplingBatchInfo`.

    `generator` is the shared source of randomness for unseeded rows (seed it from
    the server's `random_seed` for a reproducible server); None uses torch's
    global generator.
    """

    def __init__(self, generator: Optional[torch.Generator] = None):
        super().__init__()
        self.generator = generator

    def forward(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> SamplerOutput:
        """Choose the next token of every row.

        logits: [B, V] (cast to float32; not modified).
        return_logprob: also return the raw logprob of each chosen token.
        top_logprobs_num: also return the k most likely raw (logprob, id) pairs per
            row, sorted descending (k clamped to V; a caller with per-request k
            passes the largest and slices).
        """
        if logits.dim() != 2 or logits.shape[0] != len(info):
            raise ValueError(f"logits must be [{len(info)}, V], got {tuple(logits.shape)}")
        logits = logits.float()

        raw_logprobs = None
        if return_logprob or top_logprobs_num > 0:
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        next_ids = self._choose(logits, info)

        out = SamplerOutput(next_token_ids=next_ids)
        if raw_logprobs is not None:
            if return_logprob:
                out.logprobs = raw_logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
            if top_logprobs_num > 0:
                k = min(int(top_logprobs_num), raw_logprobs.shape[1])
                vals, ids = torch.topk(raw_logprobs, k, dim=-1, largest=True, sorted=True)
                out.top_logprobs = (vals, ids)
        return out

    # ------------------------------------------------------------------ internals

    def _choose(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        modify = info.need_penalties or info.need_min_new_tokens
        if info.is_all_greedy and not modify:
            return torch.argmax(logits, dim=-1)

        if modify:
            # Work on a copy: the caller's logits (and the raw logprobs) stay untouched.
            logits = logits.clone()
            info.apply_penalties(logits)
            info.apply_min_new_tokens(logits)

        if info.is_all_greedy:
            return torch.argmax(logits, dim=-1)

        next_ids = torch.argmax(logits, dim=-1)  # correct for greedy rows; others overwritten
        sampled_rows = torch.nonzero(~info.is_greedy, as_tuple=False).squeeze(1)
        probs = self._filtered_probs(logits.index_select(0, sampled_rows), info, sampled_rows)
        next_ids[sampled_rows] = self._draw(probs, info, sampled_rows.tolist())
        return next_ids

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, info: SamplingBatchInfo,
                        rows: torch.Tensor) -> torch.Tensor:
        """Tempered, filtered and renormalized probabilities for the sampled rows."""
        probs = torch.softmax(logits / info.temperatures.index_select(0, rows), dim=-1)
        vocab = probs.shape[1]

        if info.need_top_k or info.need_top_p:
            # Filters are decided in sorted order and mapped back to vocab order, so
            # the draw below sees probabilities in a batch-independent layout.
            top_ks = info.top_ks.index_select(0, rows)
            width = vocab if info.need_top_p else int(top_ks.max())
            sorted_p, sorted_idx = torch.topk(probs, width, dim=-1, sorted=True)
            pos = torch.arange(width, device=probs.device).unsqueeze(0)
            keep_sorted = pos < top_ks.unsqueeze(1)
            if info.need_top_p:
                top_ps = info.top_ps.index_select(0, rows).unsqueeze(1)
                kept_p = sorted_p * keep_sorted
                # Mass before each position, relative to what top-k left: a token is
                # kept while the tokens ranked above it hold less than top_p. The
                # first token always passes (0 < top_p); rows with top_p == 1 skip
                # the test so float rounding in the cumsum cannot drop tail tokens.
                before = (torch.cumsum(kept_p, dim=-1) - kept_p) / kept_p.sum(dim=-1, keepdim=True)
                keep_sorted &= (before <= top_ps) | (top_ps >= 1.0)
            keep = torch.zeros_like(probs, dtype=torch.bool)
            keep.scatter_(1, sorted_idx, keep_sorted)
            probs = probs * keep

        if info.need_min_p:
            # Relative to the top probability, so renormalizing first changes nothing.
            min_ps = info.min_ps.index_select(0, rows).unsqueeze(1)
            threshold = probs.max(dim=-1, keepdim=True).values * min_ps
            probs = torch.where(probs >= threshold, probs, 0.0)

        return probs / probs.sum(dim=-1, keepdim=True)

    def _draw(self, probs: torch.Tensor, info: SamplingBatchInfo,
              rows: list[int]) -> torch.Tensor:
        """One multinomial draw per row; seeded rows use their own generator."""
        out = torch.empty(len(rows), dtype=torch.int64, device=probs.device)
        shared = [j for j, r in enumerate(rows) if info.generators[r] is None]
        if shared:
            idx = torch.tensor(shared, dtype=torch.int64, device=probs.device)
            draw = torch.multinomial(probs.index_select(0, idx), 1, generator=self.generator)
            out[idx] = draw.squeeze(1)
        for j, r in enumerate(rows):
            gen = info.generators[r]
            if gen is not None:
                out[j] = torch.multinomial(probs[j], 1, generator=gen)[0]
        return out
