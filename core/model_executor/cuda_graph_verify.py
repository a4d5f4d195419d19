"""The static layout of a speculative verify pass replayed from a CUDA graph.

A verify pass (ForwardMode.TARGET_VERIFY) runs each request's last token and its drafts, causal
over the request's cached prefix, with logits at every row. Its shape varies twice: the number of
requests, and the rows per request (1 + the drafts it proposed, at most 1 + num_draft_tokens). A
graph fixes both, so, as SGLang's target-verify graphs do, every request gets exactly
`tokens_per_req` = 1 + num_draft_tokens rows, and the batch pads to a captured bucket:

    request i's row j  ->  padded row i * tokens_per_req + j      (j < its real rows)

Padding rows, after a request's real rows or in padding requests, read token 0, write their K/V
to the scratch slot 0 (never handed out) and are dropped from the logits. Attention is causal
within a request's rows, so a real row never sees a padding row that follows it; a padding
request has no prefix (its row in req_to_token is the reserved all-zero one) and sees only its own
rows. The graph's logits are gathered back to the real rows by the same index (`VerifyLayout.dest`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VerifyLayout:
    """Where a verify batch's real rows go in its padded graph input."""

    bucket: int  # requests, padding requests included
    tokens_per_req: int
    dest: list[int]  # [sum(rows)] padded row of each real row, in the batch's order
    last: list[int]  # [B] padded row of each request's last real row (its next-token logits)

    @property
    def num_tokens(self) -> int:
        return self.bucket * self.tokens_per_req


def verify_layout(rows: list[int], tokens_per_req: int, bucket: int) -> VerifyLayout:
    """The padded layout of a verify batch whose request i has rows[i] rows (device-neutral)."""
    if len(rows) > bucket:
        raise ValueError(f"{len(rows)} requests do not fit a bucket of {bucket}")
    if any(not 1 <= r <= tokens_per_req for r in rows):
        raise ValueError(f"every request needs 1..{tokens_per_req} verify rows, got {rows}")
    dest = [i * tokens_per_req + j for i, r in enumerate(rows) for j in range(r)]
    last = [i * tokens_per_req + r - 1 for i, r in enumerate(rows)]
    return VerifyLayout(bucket, tokens_per_req, dest, last)


@dataclass
class StaticVerifyBuffers:
    """The verify graphs' inputs, sized for the largest bucket; bucket bs uses the first bs
    requests' rows. Extend metadata the attention kernels read lives here too: each request's
    prefix length (refreshed per replay), its row count and its first row (fixed)."""

    tokens_per_req: int
    input_ids: torch.Tensor  # [max_bs * tokens_per_req]
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor  # [max_bs]
    seq_lens: torch.Tensor  # [max_bs] prefix + tokens_per_req
    prefix_lens: torch.Tensor  # [max_bs]
    extend_lens: torch.Tensor  # [max_bs] all tokens_per_req
    extend_start_loc: torch.Tensor  # [max_bs] i * tokens_per_req
    pad_row: int

    @classmethod
    def allocate(cls, max_bs: int, tokens_per_req: int, device, pad_row: int) -> StaticVerifyBuffers:
        n = max_bs * tokens_per_req

        def z(size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.int64, device=device)

        k = tokens_per_req
        buf = cls(
            k,
            z(n),
            z(n),
            z(n),
            z(max_bs),
            z(max_bs),
            z(max_bs),
            torch.full((max_bs,), k, dtype=torch.int64, device=device),
            torch.arange(0, n, k, dtype=torch.int64, device=device),
            pad_row,
        )
        buf.fill_padding(0, max_bs)
        return buf

    def fill_padding(self, start: int, end: int) -> None:
        """Requests [start, end) become dummies: no prefix, the reserved row, tokens 0 at positions
        0..k-1 whose K/V go to the scratch slot 0."""
        if end <= start:
            return
        k = self.tokens_per_req
        self.input_ids[start * k : end * k].zero_()
        self.out_cache_loc[start * k : end * k].zero_()
        self.positions[start * k : end * k].copy_(torch.arange(k, device=self.positions.device).repeat(end - start))
        self.req_pool_indices[start:end].fill_(self.pad_row)
        self.prefix_lens[start:end].zero_()
        self.seq_lens[start:end].fill_(k)

    def load(self, fb, layout: VerifyLayout, dest: torch.Tensor) -> tuple[list[int], list[int]]:
        """Copy verify batch `fb` into the buffers (`dest`: layout.dest on the buffers' device); returns
        the padded (seq_lens, prefix lens) on the host."""
        bs, k = fb.batch_size, layout.tokens_per_req
        # Real requests' padding rows: token 0 into the scratch slot (positions stay whatever they
        # were: a dropped row's rotary angle is irrelevant). Padding requests: fill_padding.
        self.input_ids[: bs * k].zero_()
        self.out_cache_loc[: bs * k].zero_()
        self.input_ids.index_copy_(0, dest, fb.input_ids)
        self.positions.index_copy_(0, dest, fb.positions)
        self.out_cache_loc.index_copy_(0, dest, fb.out_cache_loc)
        self.req_pool_indices[:bs].copy_(fb.req_pool_indices, non_blocking=True)
        prefix = list(fb.extend_prefix_lens_cpu)
        self.prefix_lens[:bs].copy_(torch.tensor(prefix, dtype=torch.int64), non_blocking=True)
        self.seq_lens[:bs].copy_(torch.tensor([p + k for p in prefix], dtype=torch.int64), non_blocking=True)
        self.fill_padding(bs, layout.bucket)
        pad = layout.bucket - bs
        return [p + k for p in prefix] + [k] * pad, prefix + [0] * pad
