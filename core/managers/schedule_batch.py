"""Req, ScheduleBatch and ModelWorkerBatch: the scheduler's view of requests and batches.

- `Req` is one request's whole life inside the scheduler: its tokens, where its KV
  lives (`req_pool_idx`, `prefix_indices`, `kv_len`), its cache lock (`last_node`),
  and why it stopped (`finished_reason`).
- `ScheduleBatch` is a set of requests the scheduler runs together; it allocates
  KV slots and turns itself into a `ModelWorkerBatch` (plain tensors and lists:
  everything the model worker needs, nothing about scheduling).

KV bookkeeping advances when a batch is LAUNCHED (`prepare_for_extend` /
`prepare_for_decode` move `Req.kv_len`), not when its result comes back: the
overlap loop builds batch N+1 before batch N's tokens are known, and N+1 must
already write its KV after N's. A decode input whose token is not sampled yet is
a negative "future token id" (`Req.future_token_id`) that the overlap worker
replaces with the real id just before the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from workbench.core.model_executor.forward_batch_info import ForwardMode
from workbench.core.sampling.sampling_batch_info import SamplingBatchInfo, make_generator
from workbench.core.sampling.sampling_params import SamplingParams
from workbench.core.speculative.ngram import propose_ngram

if TYPE_CHECKING:
    from workbench.core.mem_cache.base_prefix_cache import BasePrefixCache
    from workbench.core.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator


@dataclass
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the stop token id or stop string
    message: str = ""
    status: int = 0  # an abort that answers the request with an HTTP error status (0: a plain abort)


_EMPTY = torch.empty((0,), dtype=torch.int64)


class Req:
    """One request inside the scheduler."""

    def __init__(
        self,
        rid: str,
        origin_input_text: str,
        origin_input_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: list[int],
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        arrival_ts: int = 0,
        stream: bool = False,
    ):
        self.rid = rid
        self.origin_input_text = origin_input_text
        self.origin_input_ids = origin_input_ids
        self.sampling_params = sampling_params
        self.finish_token_ids = set(sampling_params.finish_token_ids(eos_token_ids))
        self.stop_strs = sampling_params.stop_strs
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        self.logprob_start_len = logprob_start_len
        self.arrival_ts = arrival_ts
        self.stream = stream  # the client reads tokens as they come (SchedulerOutputMixin.stream_output)
        self.generator = make_generator(sampling_params.seed) if sampling_params.seed is not None else None
        self.grammar = None  # structured outputs: its xgrammar GrammarMatcher (Scheduler.attach_grammar)
        # Speculative decoding: after a verify step that kept none of its drafts, the request proposes
        # none for `spec_skip` steps; the pause doubles with each miss in a row (up to 32), so text that
        # does not repeat itself soon decodes plainly again.
        self.spec_skip = 0
        self.spec_backoff = 0
        # Tokens to emit instead of sampling, in turn, and drafts to propose instead of drafting (by
        # the output length they follow), for a worker that does not compute them (a recorded run
        # replayed on a simulated deployment); None: sample and draft as usual.
        self.forced_output_ids: list[int] | None = None
        self.forced_drafts: dict[int, list[int]] | None = None

        self.output_ids: list[int] = []
        self.fill_ids: list[int] = []  # tokens whose KV is wanted after this round
        self.prefix_indices: torch.Tensor = _EMPTY
        self.last_node = None
        self.req_pool_idx: int | None = None
        self.kv_len = 0  # tokens whose KV is in the pool (or being written)
        # Overlap loop: the placeholder of this request's last token while the batch sampling it
        # is still in flight (None once the token is known, and always in the normal loop).
        self.future_token_id: int | None = None
        self.extend_input_len = 0
        self.cached_tokens = 0  # prefix-cache hit of the first prefill
        self.is_retracted = False
        self.num_chunks_done = 0  # prefill chunks run in this round
        self.finished_reason: FinishReason | None = None
        self.to_abort: str | None = None
        self.sent_len = 0  # output tokens already sent to the detokenizer
        self.output_token_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        self.input_token_logprobs: list[float | None] = []
        # with top_logprobs_num: the prompt positions' top (id, logprob) pairs, aligned with the above
        self.input_top_logprobs: list[list[tuple[int, float]] | None] = []
        self.input_logprobs_sent = False
        # Disaggregated serving (core/disaggregation/): the room naming it on both sides, the prefill
        # server's bootstrap (host, port) on the decode side, and whether the prefill side handed its KV over.
        self.bootstrap_room: int | None = None
        self.bootstrap_addr: tuple[str, int] | None = None
        self.kv_shipped = False
        # Priority scheduling (scheduler_priority.py): set from the request, or the least urgent value.
        self.priority: int | None = None
        # Multi-LoRA (core/lora/): the adapter this request runs under (None: the base model) and the
        # uid of its load, which keys the radix cache's namespace (KV of one adapter never serves another).
        self.lora_path: str | None = None
        self.lora_uid: int | None = None

    # ---- lifecycle -------------------------------------------------------------
    def finished(self) -> bool:
        return self.finished_reason is not None

    def init_next_round_input(self, tree_cache=None) -> None:
        """Set fill_ids for the next prefill round and (re)match the cached prefix.

        With `tree_cache=None` the current prefix_indices are kept (a chunked request
        continuing: its computed part is already recorded as its prefix).
        """
        self.fill_ids = self.origin_input_ids + self.output_ids
        if tree_cache is not None:
            key = self.fill_ids[: self.prefix_match_limit()]
            if self.lora_uid is not None:
                match = tree_cache.match_prefix(key, extra_key=self.lora_uid)
            else:
                match = tree_cache.match_prefix(key)
            self.prefix_indices, self.last_node = match.device_indices, match.last_node
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    def prefix_match_limit(self) -> int:
        """How many leading tokens of `fill_ids` may come from the prefix cache."""
        # At least one token must be computed to get logits to sample from. Prompt logprobs from
        # logprob_start_len on need the logits of the position before it too (they score it).
        limit = len(self.origin_input_ids) + len(self.output_ids) - 1
        if self.return_logprob and self.logprob_start_len >= 0:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return max(limit, 0)

    def check_finished(self, tail_decode=None) -> None:
        """Stop on max_new_tokens, a stop/EOS token, or a stop string in the decoded tail."""
        if self.finished():
            return
        if self.to_abort is not None:
            self.finished_reason = FinishReason("abort", message=self.to_abort)
            return
        sp = self.sampling_params
        if len(self.output_ids) >= sp.max_new_tokens:
            self.finished_reason = FinishReason("length", matched=sp.max_new_tokens)
            return
        if len(self.output_ids) < sp.min_new_tokens:
            return
        last = self.output_ids[-1]
        if last in self.finish_token_ids:
            self.finished_reason = FinishReason("stop", matched=last)
            return
        if self.stop_strs and tail_decode is not None:
            longest = max(len(s) for s in self.stop_strs)
            # A token decodes to >= 1 char, so `longest + 1` tokens cover any match ending now.
            tail = tail_decode(self.output_ids[-(longest + 1) :])
            for s in self.stop_strs:
                if s in tail:
                    self.finished_reason = FinishReason("stop", matched=s)
                    return

    def reset_for_retract(self) -> None:
        self.prefix_indices = _EMPTY
        self.last_node = None
        self.req_pool_idx = None
        self.kv_len = 0
        self.future_token_id = None
        self.extend_input_len = 0
        self.num_chunks_done = 0
        self.is_retracted = True

    def __repr__(self) -> str:
        return f"Req(rid={self.rid}, input={len(self.origin_input_ids)}, output={len(self.output_ids)})"


@dataclass
class ModelWorkerBatch:
    """Everything one forward + sample needs, and nothing about scheduling."""

    forward_mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    sampling_info: SamplingBatchInfo
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_all_logits: bool = False
    # With return_all_logits: which requests' rows it covers (prompt logprobs asked for); None: every row
    # (a verify pass). The LM head runs over those requests' rows only, so the others do not pay for it.
    all_logits_reqs: list[bool] | None = None
    sample: bool = True
    # Speculative verify pass: each request's rows (its last token + its drafts), sampled one row each.
    spec_rows: list[int] | None = None
    # The rows' requests (set at launch), for a worker that reads per-request state: one that emits a
    # request's `forced_output_ids` instead of sampling. The real worker reads only the tensors above.
    reqs: list[Req] | None = None
    # Multi-LoRA: per request, the adapter it runs under (None: the base model); None when none has one.
    lora_paths: list[str | None] | None = None


class DraftProposer(Protocol):
    """What a batch asks of a STANDALONE draft model (the part of scheduler_contract.Drafter it uses;
    named here, as the contract imports this module)."""

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]: ...


@dataclass
class ScheduleBatch:
    """A set of requests run together in one forward pass."""

    reqs: list[Req]
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool_allocator: TokenToKVPoolAllocator
    tree_cache: BasePrefixCache
    vocab_size: int
    eos_token_ids: list[int]
    forward_mode: ForwardMode = ForwardMode.DECODE
    chunked_req: Req | None = None  # the request whose prefill is cut in this batch
    cuda_graph: bool = False
    padded_size: int = 0
    extend_logprob_reqs: list[int] = field(default_factory=list)
    # Recorded at launch (prepare_for_*), read when the result is processed: by then the
    # requests' own fields may already describe the next batch (overlap loop).
    out_cache_loc: torch.Tensor | None = None
    prefix_lens: list[int] = field(default_factory=list)  # per row: KV tokens before this pass
    extend_lens: list[int] = field(default_factory=list)  # per row: tokens computed in this pass
    future_ids: list[int] | None = None  # per row: placeholder of its sampled token
    spec_num_draft: int = 0  # speculative decoding: the most draft tokens per request per step (0: off)
    spec_drafts: list[list[int]] | None = None  # per request: the drafts this launch verifies
    drafter: DraftProposer | None = None  # STANDALONE: the draft model (speculative/standalone.py); None: NGRAM

    def batch_size(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    # ---- memory ---------------------------------------------------------------
    def alloc_token_slots(self, n: int) -> torch.Tensor:
        """n KV slots, evicting unlocked cache entries first if the pool is short."""
        alloc = self.token_to_kv_pool_allocator
        if alloc.available_size() < n:
            self.tree_cache.evict(n - alloc.available_size())
        out = alloc.alloc(n)
        if out is None:
            raise RuntimeError(
                f"KV pool out of memory: {n} slots wanted, "
                f"{alloc.available_size()} free, {self.tree_cache.evictable_size()} evictable; "
                f"the scheduler's budget is wrong"
            )
        return out

    # ---- extend (prefill) -------------------------------------------------------
    def prepare_for_extend(self) -> ModelWorkerBatch:
        self.forward_mode = ForwardMode.EXTEND
        new_rows = [r for r in self.reqs if r.req_pool_idx is None]
        if new_rows:
            rows = self.req_to_token_pool.alloc(len(new_rows))
            if rows is None:
                raise RuntimeError("no free request rows; the scheduler's budget is wrong")
            for r, row in zip(new_rows, rows):
                r.req_pool_idx = row
        ext_lens = [r.extend_input_len for r in self.reqs]
        out_cache_loc = self.alloc_token_slots(sum(ext_lens))
        table = self.req_to_token_pool.req_to_token
        ids: list[int] = []
        pos: list[int] = []
        prefix_lens: list[int] = []
        seq_lens: list[int] = []
        offset = 0
        for r, n in zip(self.reqs, ext_lens):
            p = len(r.prefix_indices)
            if p and r.kv_len < p:  # prefix slots from the cache go into this row
                table[r.req_pool_idx, :p] = r.prefix_indices
            table[r.req_pool_idx, p : p + n] = out_cache_loc[offset : offset + n]
            offset += n
            ids += r.fill_ids[p : p + n]
            pos += range(p, p + n)
            prefix_lens.append(p)
            seq_lens.append(p + n)
            r.kv_len = p + n
        self.out_cache_loc, self.prefix_lens, self.extend_lens = out_cache_loc, prefix_lens, ext_lens
        self.future_ids = None
        return_logprob = any(r.return_logprob for r in self.reqs)
        asked = [r.return_logprob and r.logprob_start_len >= 0 for r in self.reqs]  # prompt logprobs
        return ModelWorkerBatch(
            forward_mode=self.forward_mode,
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            req_pool_indices=torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=out_cache_loc,
            seq_lens_cpu=seq_lens,
            extend_seq_lens_cpu=ext_lens,
            extend_prefix_lens_cpu=prefix_lens,
            sampling_info=self._sampling_info(),
            return_logprob=return_logprob,
            top_logprobs_num=max((r.top_logprobs_num for r in self.reqs if r.return_logprob), default=0),
            return_all_logits=any(asked),
            all_logits_reqs=asked if any(asked) else None,
            lora_paths=self._lora_paths(),
        )

    # ---- decode -------------------------------------------------------------------
    def new_decode_tokens_needed(self) -> int:
        return len(self.reqs)

    def prepare_for_decode(self) -> ModelWorkerBatch:
        self.forward_mode = ForwardMode.DECODE
        drafts = self._propose_drafts() if self.spec_num_draft else None
        if drafts is not None:
            return self._prepare_for_verify(drafts)
        self.spec_drafts = None
        out_cache_loc = self.alloc_token_slots(len(self.reqs))
        table = self.req_to_token_pool.req_to_token
        prefix_lens = [r.kv_len for r in self.reqs]
        rows = [r.req_pool_idx for r in self.reqs]
        # One indexed write for the whole batch (a per-request tensor write cost ~5 us each at bs 256).
        table[torch.tensor(rows, device=table.device), torch.tensor(prefix_lens, device=table.device)] = (
            out_cache_loc.to(table.dtype)
        )
        for r in self.reqs:
            r.kv_len += 1
        seq_lens = [p + 1 for p in prefix_lens]
        # The last token may still be in flight (overlap loop): then its placeholder goes in.
        input_ids = [r.output_ids[-1] if r.future_token_id is None else r.future_token_id for r in self.reqs]
        self.out_cache_loc, self.prefix_lens, self.extend_lens = out_cache_loc, prefix_lens, [1] * len(self.reqs)
        self.future_ids = None
        return_logprob = any(r.return_logprob for r in self.reqs)
        return ModelWorkerBatch(
            forward_mode=self.forward_mode,
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(prefix_lens, dtype=torch.int64),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=out_cache_loc,
            seq_lens_cpu=seq_lens,
            extend_seq_lens_cpu=[1] * len(self.reqs),
            extend_prefix_lens_cpu=prefix_lens,
            sampling_info=self._sampling_info(),
            return_logprob=return_logprob,
            top_logprobs_num=max((r.top_logprobs_num for r in self.reqs if r.return_logprob), default=0),
            lora_paths=self._lora_paths(),
        )

    # ---- speculative decoding (NGRAM) ---------------------------------------------------
    def _propose_drafts(self) -> list[list[int]] | None:
        """Each request's drafts for this step, or None to decode plainly. A step with a request that
        wants logprobs, has a grammar or waits on an in-flight token decodes plainly (its rows would
        need per-row logprobs / masks); drafts never pass max_new_tokens or the KV room left.
        NGRAM proposes from each request's own text; STANDALONE asks the draft model (`drafter`)."""
        if any(r.return_logprob or r.grammar is not None or r.future_token_id is not None for r in self.reqs):
            return None
        room = self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size() - len(self.reqs)
        budgets = []
        for r in self.reqs:
            budget = max(0, min(self.spec_num_draft, r.sampling_params.max_new_tokens - len(r.output_ids) - 1, room))
            if r.spec_skip > 0:  # its last drafts all failed: wait a few steps before drafting again
                r.spec_skip -= 1
                budget = 0
            room -= budget
            budgets.append(budget)
        if self.drafter is not None:
            drafts = self.drafter.propose(self.reqs, budgets)
        else:
            drafts = [
                propose_ngram(r.origin_input_ids + r.output_ids, b) if b > 0 else [] for r, b in zip(self.reqs, budgets)
            ]
        return drafts if any(drafts) else None

    def _prepare_for_verify(self, drafts: list[list[int]]) -> ModelWorkerBatch:
        """One extend-like pass over each request's last token and its drafts: the target's token at
        every position, so the scheduler keeps the drafts it agrees with (process_batch_result_decode)."""
        rows = [1 + len(d) for d in drafts]
        out_cache_loc = self.alloc_token_slots(sum(rows))
        table = self.req_to_token_pool.req_to_token
        prefix_lens = [r.kv_len for r in self.reqs]
        ids: list[int] = []
        pos: list[int] = []
        offset = 0
        for r, d, n in zip(self.reqs, drafts, rows):
            table[r.req_pool_idx, r.kv_len : r.kv_len + n] = out_cache_loc[offset : offset + n]
            ids += [r.output_ids[-1]] + d
            pos += range(r.kv_len, r.kv_len + n)
            r.kv_len += n
            offset += n
        seq_lens = [p + n for p, n in zip(prefix_lens, rows)]
        self.out_cache_loc, self.prefix_lens, self.extend_lens = out_cache_loc, prefix_lens, rows
        self.future_ids, self.spec_drafts = None, drafts
        # Row j of a request is sampled as if drafts[:j] were already its output (penalties, min tokens).
        per_row = [(r, r.output_ids + d[:j]) for r, d, n in zip(self.reqs, drafts, rows) for j in range(n)]
        info = self._sampling_info(per_row)
        return ModelWorkerBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,  # to the model runner: causal attention over a prefix
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            req_pool_indices=torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=out_cache_loc,
            seq_lens_cpu=seq_lens,
            extend_seq_lens_cpu=rows,
            extend_prefix_lens_cpu=prefix_lens,
            sampling_info=info,
            return_all_logits=True,
            spec_rows=rows,
            lora_paths=self._lora_paths(),
        )

    def _lora_paths(self) -> list[str | None] | None:
        """Per request, its adapter (multi-LoRA); None when every request runs the base model."""
        paths = [r.lora_path for r in self.reqs]
        return paths if any(p is not None for p in paths) else None

    def _sampling_info(self, per_row: list[tuple[Req, list[int]]] | None = None) -> SamplingBatchInfo:
        """One row per request, or per (request, output so far) in `per_row` (a verify pass's rows)."""
        per_row = per_row if per_row is not None else [(r, r.output_ids) for r in self.reqs]
        return SamplingBatchInfo.from_reqs(
            [r.sampling_params for r, _ in per_row],
            output_ids=[out for _, out in per_row],
            prompt_ids=[r.origin_input_ids for r, _ in per_row],
            vocab_size=self.vocab_size,
            eos_ids=[sorted(r.finish_token_ids) for r, _ in per_row],
            generators=[r.generator for r, _ in per_row],
            device=self.req_to_token_pool.device,
        )

    # ---- membership ----------------------------------------------------------------
    def filter_batch(self, keep: list[Req] | None = None) -> None:
        """Drop finished requests (or keep exactly `keep`)."""
        self.reqs = [r for r in self.reqs if not r.finished()] if keep is None else keep

    def merge_batch(self, other: ScheduleBatch) -> None:
        self.reqs.extend(other.reqs)

    def copy(self) -> ScheduleBatch:
        """A snapshot of this launch (its rows and what was recorded for them).

        The running batch object is reused from step to step (filtered, merged, launched
        again), so the overlap loop keeps this copy to process the launch's result with.
        """
        return ScheduleBatch(
            list(self.reqs),
            self.req_to_token_pool,
            self.token_to_kv_pool_allocator,
            self.tree_cache,
            self.vocab_size,
            self.eos_token_ids,
            self.forward_mode,
            self.chunked_req,
            self.cuda_graph,
            self.padded_size,
            list(self.extend_logprob_reqs),
            self.out_cache_loc,
            list(self.prefix_lens),
            list(self.extend_lens),
            list(self.future_ids) if self.future_ids is not None else None,
            self.spec_num_draft,
            self.spec_drafts,
            self.drafter,
        )
