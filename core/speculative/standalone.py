"""STANDALONE drafts (`--speculative-algorithm STANDALONE --speculative-draft-model-path DIR`): a
second, smaller model with the target's tokenizer proposes each request's next tokens greedily.

The draft model runs in the scheduler process on a ModelRunner of its own, with its own request
rows and KV pool, so the target's pool, radix cache and KV invariants never see it. Each request
keeps a draft state: the draft pool row and how many of its tokens (prompt + output) the draft
has K/V for. A step's proposal for k drafts is one extend pass over the tokens the draft has not
seen yet (the first step: the whole prompt; later: the drafts the target kept and its own token)
and k - 1 decode passes, batched over the requests. The draft tokens' own K/V is dropped after
the proposal (the target decides which drafts stand; the next extend catches up), so the draft
state only ever covers a prefix of the request's real tokens, which only grows: still valid after
a retraction, and released when its request leaves the running batch.

Drafts are greedy (the draft model's argmax): a point-mass proposal, for which keeping a draft
exactly when the target's sampled token equals it is exact rejection sampling, so the output has
the target's distribution (docs/speculative.md). The draft model's quality only moves speed.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass
class _DraftSeq:
    row: int  # the request's row in the draft's req_to_token
    kv_len: int = 0  # leading tokens of prompt + output whose draft K/V is in the draft pool


class StandaloneDrafter:
    """Greedy drafts from a small model; `propose(reqs, budgets)` -> one list of draft ids per request."""

    def __init__(self, server_args, target_vocab_size: int, max_running_requests: int, max_total_tokens: int):
        from workbench.core.model_executor.model_runner import ModelRunner

        per_step = max_running_requests * (server_args.resolved_num_draft_tokens() + 1)
        draft_args = dataclasses.replace(
            server_args,
            model_path=server_args.speculative_draft_model_path,
            speculative_algorithm=None,
            speculative_draft_model_path=None,
            speculative_num_steps=None,
            speculative_num_draft_tokens=None,
            max_total_tokens=max_total_tokens + per_step,
            enable_torch_compile=False,
            disable_cuda_graph=True,
        )
        self.runner = ModelRunner(draft_args, max_req_rows=max_running_requests + 1)
        vocab = self.runner.model_config.vocab_size
        if vocab != target_vocab_size:
            raise ValueError(
                f"the draft model's vocabulary has {vocab} entries, the target's {target_vocab_size}: "
                "STANDALONE needs a draft model with the target's tokenizer"
            )
        self.context_len = self.runner.model_config.context_len
        self.states: dict[str, _DraftSeq] = {}
        self.passes = 0  # draft forward passes run (extend + decode)

    # ---- bookkeeping ------------------------------------------------------------------------
    def release(self, keep: set[str] = frozenset()) -> None:
        """Free the draft rows and K/V of every request not in `keep` (finished, aborted, retracted)."""
        for rid in [rid for rid in self.states if rid not in keep]:
            self._free(self.states.pop(rid))

    def _free(self, s: _DraftSeq) -> None:
        r = self.runner
        if s.kv_len:
            r.token_to_kv_pool_allocator.free(r.req_to_token_pool.req_to_token[s.row, : s.kv_len].clone())
        r.req_to_token_pool.free([s.row])

    def _truncate(self, s: _DraftSeq, n: int) -> None:
        """Drop the draft K/V of positions n.. of one request."""
        r = self.runner
        if s.kv_len > n:
            r.token_to_kv_pool_allocator.free(r.req_to_token_pool.req_to_token[s.row, n : s.kv_len].clone())
            s.kv_len = n

    def held_tokens(self) -> int:
        """Draft KV slots in use (0 between steps once every request left: tested for leaks)."""
        return sum(s.kv_len for s in self.states.values())

    # ---- proposing --------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, reqs, budgets: list[int]) -> list[list[int]]:
        self.release({r.rid for r in reqs})
        drafts: list[list[int]] = [[] for _ in reqs]
        todo = []
        for i, (req, k) in enumerate(zip(reqs, budgets)):
            tokens = req.origin_input_ids + req.output_ids
            k = min(k, self.context_len - len(tokens))
            if k <= 0:
                continue
            s = self.states.get(req.rid)
            if s is None:
                rows = self.runner.req_to_token_pool.alloc(1)
                if rows is None:
                    continue
                s = self.states[req.rid] = _DraftSeq(rows[0])
            todo.append((i, s, tokens, k))
        if not todo:
            return drafts
        try:
            self._run(todo, drafts)
        except _DraftPoolFull:
            logger.info("draft model's KV pool is full: no drafts this step")
            for i, s, _, _ in todo:
                drafts[i] = []
            self.release()
        return drafts

    def _run(self, todo, drafts: list[list[int]]) -> None:
        """One extend over each request's unseen tokens, then decode passes until every budget is met."""
        from workbench.core.model_executor.forward_batch_info import ForwardMode

        new = [tokens[s.kv_len :] for _, s, tokens, _ in todo]
        last = self._pass(ForwardMode.EXTEND, [s for _, s, _, _ in todo], new)
        for (i, _, _, _), tok in zip(todo, last):
            drafts[i].append(tok)
        active = [(i, s, tokens, k) for i, s, tokens, k in todo if k > 1]
        while active:
            last = self._pass(ForwardMode.DECODE, [s for _, s, _, _ in active], [[drafts[i][-1]] for i, *_ in active])
            for (i, _, _, _), tok in zip(active, last):
                drafts[i].append(tok)
            active = [a for a in active if len(drafts[a[0]]) < a[3]]
        for _, s, tokens, _ in todo:
            self._truncate(s, len(tokens))  # keep only the real tokens' K/V

    def _pass(self, mode, seqs: list[_DraftSeq], new_tokens: list[list[int]]) -> list[int]:
        from workbench.core.model_executor.forward_batch_info import ForwardBatch

        r = self.runner
        total = sum(len(t) for t in new_tokens)
        loc = r.token_to_kv_pool_allocator.alloc(total)
        if loc is None:
            raise _DraftPoolFull()
        ids, pos, offset = [], [], 0
        for s, toks in zip(seqs, new_tokens):
            n = len(toks)
            r.req_to_token_pool.req_to_token[s.row, s.kv_len : s.kv_len + n] = loc[offset : offset + n]
            ids += toks
            pos += range(s.kv_len, s.kv_len + n)
            offset += n
        prefix = [s.kv_len for s in seqs]
        seq_lens = [p + len(t) for p, t in zip(prefix, new_tokens)]
        for s, n in zip(seqs, seq_lens):
            s.kv_len = n
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(seqs),
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            req_pool_indices=torch.tensor([s.row for s in seqs], dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=loc,
            seq_lens_cpu=seq_lens,
            extend_seq_lens_cpu=[len(t) for t in new_tokens],
            extend_prefix_lens_cpu=prefix,
        )
        self.passes += 1
        return r.forward(fb).next_token_logits.argmax(dim=-1).tolist()


class _DraftPoolFull(RuntimeError):
    pass
