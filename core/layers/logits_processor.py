"""LogitsProcessor: hidden states -> next-token logits, and prompt logprobs.

The LM head is the most expensive matmul of a decode step for a small model
(V = 49,152 for SmolLM2), and in prefill only each request's last position is
needed to sample. So the head runs on the last positions only, unless the
caller asks for every position (prompt logprobs), which costs T x V floats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LogitsOutput:
    """Logits of one forward pass."""

    next_token_logits: torch.Tensor  # [B, V] float32, at each request's last position
    all_logits: torch.Tensor | None = None  # [T, V] float32, every position (when asked)
    # mixtures of experts: each sparse layer's [T, top_k] expert ids for this pass (trace: moe.routing)
    routing: list[torch.Tensor] | None = None


@dataclass
class PromptLogprobs:
    """Logprobs of one request's prompt tokens under the model.

    token_logprobs[i] is the logprob of prompt token i + 1 given tokens 0..i (the
    first prompt token has no logprob: nothing predicts it).
    """

    token_ids: torch.Tensor  # [L - 1] int64, the tokens scored
    token_logprobs: torch.Tensor  # [L - 1] float32
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None  # (values, ids), [L - 1, k]


class LogitsProcessor(nn.Module):
    """Applies the LM head. `vocab_size` trims a padded head (rows >= vocab_size)."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(
        self,
        hidden_states: torch.Tensor,
        lm_head_weight: torch.Tensor,
        last_index: torch.Tensor,
        return_all_positions: bool = False,
    ) -> LogitsOutput:
        """Compute logits.

        hidden_states: [T, H], the final-norm output of every token in the batch.
        lm_head_weight: [V', H] with V' >= vocab_size (tied embeddings work as is).
        last_index: [B] int64, the row in T of each request's last position
            (for decode it is simply arange(B)).
        return_all_positions: also return [T, V] logits (for prompt logprobs).
        """
        weight = lm_head_weight[: self.vocab_size]
        if return_all_positions:
            all_logits = self._head(hidden_states, weight)
            return LogitsOutput(next_token_logits=all_logits.index_select(0, last_index), all_logits=all_logits)
        last_hidden = hidden_states.index_select(0, last_index)
        return LogitsOutput(next_token_logits=self._head(last_hidden, weight))

    @staticmethod
    def _head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # The matmul runs in the model's dtype (bf16 is ~2x faster on CPU); the
        # sampler and logprobs want float32.
        return torch.matmul(hidden.to(weight.dtype), weight.t()).float()


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[i, token_ids[i]] for every row: [N, V], [N] -> [N] float32."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(1, token_ids.long().view(-1, 1)).squeeze(1)


def compute_prompt_logprobs(
    all_logits: torch.Tensor,
    input_ids: torch.Tensor,
    extend_seq_lens: Sequence[int],
    top_logprobs_num: int = 0,
) -> list[PromptLogprobs]:
    """Per-request logprobs of the prompt tokens from a prefill's `all_logits`.

    all_logits: [T, V], input_ids: [T], the batch's tokens flattened request after
    request; extend_seq_lens: how many of the T rows belong to each request.
    Within a segment, position t scores input token t + 1. With chunked prefill the
    first token of the next chunk is scored by this chunk's last position: use
    `token_logprobs(next_token_logits, next_chunk_first_ids)` for that one.
    """
    if sum(extend_seq_lens) != all_logits.shape[0] or input_ids.numel() != all_logits.shape[0]:
        raise ValueError(
            f"segments {list(extend_seq_lens)} do not cover {all_logits.shape[0]} positions "
            f"({input_ids.numel()} input ids)"
        )
    logprobs = torch.log_softmax(all_logits.float(), dim=-1)
    out: list[PromptLogprobs] = []
    start = 0
    for n in extend_seq_lens:
        lp = logprobs[start : start + n - 1] if n > 1 else logprobs[start:start]
        targets = input_ids[start + 1 : start + n].long().to(lp.device)
        item = PromptLogprobs(token_ids=targets, token_logprobs=lp.gather(1, targets.view(-1, 1)).squeeze(1))
        if top_logprobs_num > 0:
            k = min(int(top_logprobs_num), logprobs.shape[1])
            vals, ids = torch.topk(lp, k, dim=-1, sorted=True)
            item.top_logprobs = (vals, ids)
        out.append(item)
        start += n
    return out
