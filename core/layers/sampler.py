"""Sampler: next-token choice from a batch of logits.

Order of operations, per row:
1. penalties (repetition, frequency, presence), `logit_bias` (added), `min_new_tokens`
   (stop ids to -inf) and a grammar's mask (structured outputs: disallowed tokens to -inf);
2. greedy rows (temperature 0 or top_k 1): argmax of the penalized logits, exactly;
3. sampled rows: divide by temperature, softmax, then top-k, top-p and min-p, each
   acting on what the previous filter left (renormalized), then renormalize and
   draw one token (inverse CDF of one uniform; see `_sample_rows` for why not
   torch.multinomial).

Randomness: each sampled row uses exactly one U[0, 1) per step. A row whose
request has a seed draws it from its own generator, so the same seed gives the
same tokens whatever else is in the batch; the other sampled rows share one
draw from the sampler's generator (or torch's global one).

Logprobs are those of the RAW model distribution: log_softmax of the logits as
they came in, before penalties, min_new_tokens and temperature (as SGLang does
by default). They describe the model, not the sampling procedure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from workbench.core.sampling.sampling_batch_info import SamplingBatchInfo


@dataclass
class SamplerOutput:
    """What one sampling step returns (all tensors on the logits' device)."""

    next_token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32, raw logprob of the chosen id
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None  # (values [B, k], ids [B, k]), sorted


class Sampler(nn.Module):
    """Turns logits [B, V] into one token per row, following `SamplingBatchInfo`.

    `generator` is the shared source of randomness for unseeded rows (seed it from
    the server's `random_seed` for a reproducible server); None uses torch's
    global generator.
    """

    def __init__(self, generator: torch.Generator | None = None):
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
        modify = info.need_penalties or info.need_min_new_tokens or info.need_logit_bias or info.vocab_mask is not None
        if info.is_all_greedy and not modify:
            return torch.argmax(logits, dim=-1)

        if modify:
            # Work on a copy: the caller's logits (and the raw logprobs) stay untouched.
            logits = logits.clone()
            info.apply_penalties(logits)
            info.apply_logit_bias(logits)
            info.apply_min_new_tokens(logits)
            info.apply_vocab_mask(logits)  # last: a grammar's -inf is final

        if info.is_all_greedy:
            return torch.argmax(logits, dim=-1)

        next_ids = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        greedy_rows = torch.nonzero(info.is_greedy).squeeze(1)
        if greedy_rows.numel():
            next_ids[greedy_rows] = torch.argmax(_rows(logits, greedy_rows), dim=-1)
        rows = torch.nonzero(~info.is_greedy).squeeze(1)
        uniforms = self._uniforms(info, rows.tolist(), logits.device)
        next_ids[rows] = _sample_rows(_rows(logits, rows), info, rows, uniforms)
        return next_ids

    def _uniforms(self, info: SamplingBatchInfo, rows: list[int], device: torch.device) -> torch.Tensor:
        """One U[0, 1) draw per sampled row; seeded rows draw from their own generator."""
        u = torch.empty(len(rows), dtype=torch.float32, device=device)
        shared = [j for j, r in enumerate(rows) if info.generators[r] is None]
        if shared:
            idx = torch.tensor(shared, dtype=torch.int64, device=device)
            u[idx] = torch.rand(len(shared), generator=self.generator, device=device)
        for j, r in enumerate(rows):
            gen = info.generators[r]
            if gen is not None:
                u[j] = torch.rand(1, generator=gen, device=gen.device)[0]
        return u


# Prefix widths tried for top-k / top-p, smallest first; rows whose filter does
# not settle inside a width move on to the next, and finally to a full sort.
# Measured on SmolLM2-135M chat output at temperature 1: the top_p=0.95 nucleus
# has a median of ~150 tokens and reached ~3,200, never 4,096; a full sort of
# 49k probabilities costs ~5x a topk(4096) and ~40x a topk(256) on CPU.
_PREFIX_WIDTHS = (256, 1024, 4096)


def _sample_rows(
    logits: torch.Tensor, info: SamplingBatchInfo, rows: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """Token ids for the sampled rows: temperature, softmax, filters, inverse-CDF draw.

    Sampling is by inverse CDF with one uniform per row rather than torch.multinomial:
    on CPU multinomial costs milliseconds per 49k-wide row, a cumsum + searchsorted
    a fraction of that, and a row's token then depends only on its probabilities
    and its one uniform. The CDF runs in token-id order, so ties in the sort used by
    the filters cannot change which token a given uniform picks.
    """
    probs = torch.softmax(logits / info.temperatures.index_select(0, rows), dim=-1)
    n, vocab = probs.shape
    top_ks = info.top_ks.index_select(0, rows)
    top_ps = info.top_ps.index_select(0, rows)
    min_ps = info.min_ps.index_select(0, rows)
    out = torch.empty(n, dtype=torch.int64, device=probs.device)

    if info.need_top_k or info.need_top_p:
        prefix = (top_ks < vocab) | (top_ps < 1.0)
    else:
        prefix = torch.zeros(n, dtype=torch.bool, device=probs.device)

    dense = torch.nonzero(~prefix).squeeze(1)
    if dense.numel():
        p = _rows(probs, dense)
        if info.need_min_p:
            p = _apply_min_p(p, p.max(dim=-1, keepdim=True).values, min_ps.index_select(0, dense))
        out[dense] = _inverse_cdf(p, uniforms.index_select(0, dense))

    pending = torch.nonzero(prefix).squeeze(1)
    widths = sorted({min(w, vocab) for w in _PREFIX_WIDTHS} | {vocab})
    for width in widths:
        if pending.numel() == 0:
            break
        p = _rows(probs, pending)
        ks, tps = top_ks.index_select(0, pending), top_ps.index_select(0, pending).unsqueeze(1)
        sorted_p, sorted_ids = torch.topk(p, width, dim=-1, sorted=True)
        keep = torch.arange(width, device=p.device).unsqueeze(0) < ks.unsqueeze(1)
        kept_p = sorted_p * keep
        # What top-k leaves: exact from the prefix when k <= width; the whole row when
        # top-k is off. Rows with width < k < V cannot know it yet and go wider.
        total = torch.where(ks <= width, kept_p.sum(dim=-1), p.sum(dim=-1)).unsqueeze(1)
        # A token is cut once the tokens ranked above it already hold top_p of what
        # top-k left; the first never is (0 < top_p). top_p == 1 rows skip the test
        # so float rounding in the cumsum cannot drop tail tokens.
        cut = ((torch.cumsum(kept_p, dim=-1) - kept_p) >= tps * total) & (tps < 1.0)
        keep &= ~cut
        settled = (ks <= width) | (cut.any(dim=-1) & (ks >= vocab)) | (width >= vocab)
        done = torch.nonzero(settled).squeeze(1)
        if done.numel():
            kp = _rows(sorted_p * keep, done)
            ids = _rows(sorted_ids, done)
            if info.need_min_p:
                # Column 0 is the row's top token, always kept.
                kp = _apply_min_p(kp, kp[:, :1], min_ps.index_select(0, pending.index_select(0, done)))
            ids, order = torch.sort(ids, dim=-1)
            kp = kp.gather(1, order)
            pos = _inverse_cdf(kp, uniforms.index_select(0, pending.index_select(0, done)))
            out[pending.index_select(0, done)] = ids.gather(1, pos.unsqueeze(1)).squeeze(1)
        pending = pending.index_select(0, torch.nonzero(~settled).squeeze(1))
    return out


def _rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t[idx] without the [B, V] copy when `idx` (sorted, unique) is every row."""
    return t if idx.numel() == t.shape[0] else t.index_select(0, idx)


def _apply_min_p(probs: torch.Tensor, top: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities below min_p x the row's top probability."""
    return torch.where(probs >= top * min_ps.unsqueeze(1), probs, 0.0)


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Column index drawn from each row's unnormalized non-negative `weights`.

    Picks the first column whose cumulative weight exceeds u * total. Zero-weight
    columns add nothing to the CDF, so they can never be that first column; the
    target is kept strictly below the total so rounding cannot run off the end.
    """
    cdf = torch.cumsum(weights, dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # Only NaN weights (a broken forward pass) can land past the end; keep the id
    # valid so one bad row cannot crash the batch's bookkeeping.
    return idx.clamp_(max=weights.shape[1] - 1)
