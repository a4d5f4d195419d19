"""The second half of a scheduler step: fold a forward pass's result back into the requests.

Kept apart from scheduler.py so each file reads as one part of the loop: this one is
`process_batch_result` (tokens, stop checks, KV handed to the radix cache), the output
stream to the detokenizer, and the trace events that describe the step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from workbench.core.io_struct import BatchTokenIDOut
from workbench.core.layers.logits_processor import token_logprobs
from workbench.core.managers.schedule_batch import FinishReason
from workbench.core.model_executor.forward_batch_info import ForwardMode
from workbench.core.trace import clock as trace_clock
from workbench.core.trace import events as ev

if TYPE_CHECKING:
    from workbench.core.args import ServerArgs
    from workbench.core.managers.schedule_batch import Req, ScheduleBatch
    from workbench.core.managers.schedule_policy import HeldBack
    from workbench.core.managers.scheduler_contract import Disaggregation, ModelWorker, SchedulerIO, TextDecoder
    from workbench.core.managers.scheduler_narration import StepNarrator
    from workbench.core.managers.tp_worker import GenerationBatchResult
    from workbench.core.mem_cache.chunk_cache import ChunkCache
    from workbench.core.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
    from workbench.core.mem_cache.radix_cache import RadixCache
    from workbench.core.trace.tracer import Tracer

# A non-streaming request's tokens go out every this many (SGLang's DEFAULT_FORCE_STREAM_INTERVAL),
# so a long generation still frees the detokenizer's incremental state as it goes.
NON_STREAM_INTERVAL = 50


class SchedulerOutputMixin:
    # The Scheduler's state this half of the step reads and writes (set in Scheduler.__init__; bare
    # annotations, so they only tell the type checker what the Scheduler mixing this in holds).
    server_args: ServerArgs
    tp_worker: ModelWorker
    io: SchedulerIO
    tracer: Tracer
    tokenizer: TextDecoder
    tree_cache: ChunkCache | RadixCache
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool_allocator: TokenToKVPoolAllocator
    max_total_num_tokens: int
    chunked_prefill_size: int | None
    stream_interval: int
    waiting_queue: list[Req]
    chunked_req: Req | None
    held_back: list[HeldBack]
    narrator: StepNarrator
    paused: bool
    spec_verify_steps: int
    spec_verified_total: int
    spec_proposed_total: int
    spec_accepted_total: int
    disagg: Disaggregation | None
    trace_tree_digest: bool

    if TYPE_CHECKING:

        def running_reqs(self) -> list[Req]: ...

    # ==== results ====================================================================
    def process_batch_result(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        # Held KV slots that move here outside a request's release (duplicates handed to the
        # cache, rejected drafts, a finished request's unused row) are the step's kv_returned.
        with self.narrator.account("returned"):
            if batch.forward_mode == ForwardMode.DECODE:
                self.process_batch_result_decode(batch, result)
            else:
                self.process_batch_result_prefill(batch, result)

    def cache_finished(self, req: Req, kv_len: int | None = None) -> None:
        """Hand a finished request's KV to the cache, counted as its release in the step's decision."""
        why = "aborted" if req.finished_reason is not None and req.finished_reason.type == "abort" else "finished"
        with self.narrator.account(why, req.rid):
            self.tree_cache.cache_finished_req(req, kv_len=kv_len)

    def process_batch_result_prefill(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        # KV lengths and chunk counts moved at launch; a cut request's computed part is handed to
        # the cache when its next chunk is scheduled (Scheduler.get_new_batch_prefill).
        for i, req in enumerate(batch.reqs):
            if req.return_logprob and req.logprob_start_len >= 0 and result.prompt_logprobs is not None:
                self._add_input_logprobs(req, i, result, batch.prefix_lens[i], batch.extend_lens[i])
            if req is batch.chunked_req:
                continue  # part of the prompt is still to come: nothing sampled yet
            if req.sampling_params.max_new_tokens == 0:
                req.check_finished()  # prefill only (e.g. prompt logprobs): the sampled token is dropped
            else:
                self._append_token(req, i, result, batch)
            req.is_retracted = False
            if req.finished() and self.disagg is not None:
                self.disagg.on_prefilled(req)  # PD prefill: the prompt's KV to the decode side, before the tree
            if req.finished():
                # With nothing sampled every prompt token's KV is in the row, the last one included.
                self.cache_finished(req, kv_len=None if req.output_ids else len(req.origin_input_ids))
            else:
                # Publish the prompt's KV now, so requests arriving meanwhile can share it.
                self.tree_cache.cache_unfinished_req(req)
        self.stream_output([r for r in batch.reqs if r is not batch.chunked_req or r.finished()])

    def process_batch_result_decode(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        if batch.spec_drafts is not None:
            self.process_verify_result(batch, result)
            return
        fresh = []
        for i, req in enumerate(batch.reqs):
            if req.finished():
                # Overlap loop: it finished in the previous batch, which this one was built before
                # knowing. The row was computed for nothing; its KV slot is given back here (the
                # request's row and the rest of its KV went at cache_finished_req).
                assert batch.out_cache_loc is not None  # a launched decode batch has its slots
                self.token_to_kv_pool_allocator.free(batch.out_cache_loc[i : i + 1])
                continue
            self._append_token(req, i, result, batch)
            if req.finished():
                self.cache_finished(req)
            fresh.append(req)
        self.stream_output(fresh)

    def process_verify_result(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        """Speculative decoding: keep each request's drafts up to the first the target disagrees with.

        Row j of a request holds the token the target chose after its last token and drafts[:j]
        (sampled with the request's own parameters). Draft j + 1 stands when it equals row j's
        token; the first row that differs gives the request's next token instead (or, when every
        draft stood, the last row gives one more). For a draft proposed without a distribution this
        is exact: each kept token is a sample of the target's distribution given what precedes it.
        The rejected drafts' KV slots are freed; the accepted ones' stay in the request's row."""
        table = self.req_to_token_pool.req_to_token
        ids = result.next_token_ids
        offset, fresh, verdicts = 0, [], []
        spec_drafts = batch.spec_drafts
        assert spec_drafts is not None  # process_batch_result_decode sends only a verify batch here
        for i, req in enumerate(batch.reqs):
            drafts, n, start = spec_drafts[i], batch.extend_lens[i], batch.prefix_lens[i]
            rows = ids[offset : offset + n]
            offset += n
            if batch.future_ids is not None and req.future_token_id == batch.future_ids[i]:
                req.future_token_id = None  # overlap loop: its tokens are real now
            at, accepted = len(req.output_ids), 0  # drafts follow its output so far (the trace's SpecReq.at)
            while accepted < len(drafts) and rows[accepted] == drafts[accepted]:
                accepted += 1
            if drafts and not accepted:  # back off: 1, 2, 4, ... steps without drafts
                req.spec_backoff = min(max(1, 2 * req.spec_backoff), 32)
                req.spec_skip = req.spec_backoff
            elif accepted:
                req.spec_backoff = 0
            appended = 0
            for token in rows[: accepted + 1]:
                req.output_ids.append(token)
                appended += 1
                req.check_finished(self._decode_tail)
                if req.finished():
                    break
            # KV stays for the last token and the drafts now part of the output (all but the newest
            # token, as after any decode step); the slots past them go back to the pool.
            req.kv_len = start + appended
            if appended < n:
                self.token_to_kv_pool_allocator.free(table[req.req_pool_idx, start + appended : start + n].clone())
            verdicts.append((req.rid, drafts, accepted, at))
            if req.finished():
                self.cache_finished(req)
            fresh.append(req)
        self.note_spec_verdicts(verdicts)
        self.stream_output(fresh)

    def note_spec_verdicts(self, verdicts: list[tuple[str, list[int], int, int]]) -> None:
        """Per request of a verify step: (rid, the drafts proposed, how many were accepted, the output
        tokens it had when they were proposed)."""
        self.spec_verify_steps += 1
        for _, drafts, accepted, _ in verdicts:
            self.spec_proposed_total += len(drafts)
            self.spec_accepted_total += accepted
            self.spec_verified_total += 1
        if self.tracer.enabled:
            self.tracer.emit(
                ev.SpecVerify(
                    algorithm=self.server_args.speculative_algorithm or "NGRAM",
                    reqs=[ev.SpecReq(rid, drafts, accepted, at=at) for rid, drafts, accepted, at in verdicts],
                )
            )

    def _append_token(self, req: Req, i: int, result: GenerationBatchResult, batch: ScheduleBatch) -> None:
        req.output_ids.append(result.next_token_ids[i])
        if batch.future_ids is not None and req.future_token_id == batch.future_ids[i]:
            req.future_token_id = None  # a later launch may have put its own placeholder there
        out = result.sampler_output
        if req.return_logprob and out is not None and out.logprobs is not None:
            req.output_token_logprobs.append(float(out.logprobs[i]))
            if req.top_logprobs_num > 0 and out.top_logprobs is not None:
                vals, ids = out.top_logprobs
                k = req.top_logprobs_num
                req.output_top_logprobs.append(list(zip(ids[i, :k].tolist(), vals[i, :k].tolist())))
        if req.grammar is not None and not req.grammar.is_terminated():
            t0 = time.perf_counter()
            if not req.grammar.accept_token(int(req.output_ids[-1])):
                req.to_abort = "the sampled token does not fit the request's grammar"
            self.narrator.on_mask(0, 1000 * (time.perf_counter() - t0))  # the matcher's time counts too
        req.check_finished(self._decode_tail)
        if not req.finished() and req.grammar is not None and req.grammar.is_terminated():
            # the grammar is complete and took its end token (reached here under ignore_eos)
            req.finished_reason = FinishReason("stop", matched=req.output_ids[-1])

    def _decode_tail(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _add_input_logprobs(self, req: Req, i: int, result: GenerationBatchResult, start: int, n: int) -> None:
        """Prompt logprobs of the `n` tokens after `start` computed by row i (launch-time values); with
        top_logprobs_num, each position's top tokens too. A prompt prefilled in chunks gathers chunk
        by chunk, each entry at its position (a pass starting at `start` scores positions start + 1..);
        a re-prefill (after retraction) finds them complete and adds nothing."""
        prompt_len = len(req.origin_input_ids)
        if len(req.input_token_logprobs) >= prompt_len:
            return
        k = req.top_logprobs_num
        for scored in (req.input_token_logprobs, req.input_top_logprobs):
            del scored[start + 1 :]  # positions this pass scores again (none on the usual path)
            scored.extend([None] * (start + 1 - len(scored)))  # nothing predicts the first / cached tokens
        assert result.prompt_logprobs is not None  # asked for: the pass computed them for its rows
        lp = result.prompt_logprobs[i]
        req.input_token_logprobs.extend(float(x) for x in lp.token_logprobs)
        if k > 0 and lp.top_logprobs is not None:
            vals, ids = lp.top_logprobs
            req.input_top_logprobs.extend(
                list(zip(r_ids, r_vals)) for r_ids, r_vals in zip(ids[:, :k].tolist(), vals[:, :k].tolist())
            )
        end = start + n
        if end < prompt_len:
            # The next chunk's first token is scored by this chunk's last position.
            row = result.logits_output.next_token_logits[i : i + 1]
            nxt = torch.tensor([req.origin_input_ids[end]], device=row.device)
            req.input_token_logprobs.append(float(token_logprobs(row, nxt)[0]))
            if k > 0:
                vals, ids = torch.topk(torch.log_softmax(row.float(), dim=-1), k, dim=-1)
                req.input_top_logprobs.append(list(zip(ids[0].tolist(), vals[0].tolist())))

    # ==== output ======================================================================
    def stream_output(self, reqs: list[Req]) -> None:
        """Send the requests' new tokens (and final state) to the detokenizer.

        A request's first tokens and its end always go out at once (TTFT and the result). In between,
        SGLang's rule: a streaming request sends every --stream-interval tokens; a non-streaming one,
        whose client reads only the end, every NON_STREAM_INTERVAL tokens. Each send wakes the
        detokenizer and the tokenizer manager, ~0.9 ms of CPU per token on this project's 2-core
        target, taken from the cores the step computes on (batch-1 decode measured 9% faster with
        it, docs/design.md). While a view listens to the trace every token goes out, so the views'
        text of a request grows token by token."""
        every = 1 if self.tracer.enabled else NON_STREAM_INTERVAL
        rids, new_ids, reasons, prompt, completion, cached = [], [], [], [], [], []
        skip, spaces, no_trim, stops, lps, tops = [], [], [], [], [], []
        matched: list[int | str | None] = []
        status: list[int] = []
        in_lps: list[list[float | None] | None] = []
        in_tops: list[list[list[tuple[int, float]] | None] | None] = []
        any_lp = False
        for req in reqs:
            new = req.output_ids[req.sent_len :]
            if not req.finished() and (
                not new or (req.sent_len and len(new) < (self.stream_interval if req.stream else every))
            ):
                continue
            fr = req.finished_reason
            rids.append(req.rid)
            new_ids.append(new)
            reasons.append(fr.type if fr else None)
            matched.append(
                fr.matched if fr and fr.type == "stop" else (fr.message if fr and fr.type == "abort" else None)
            )
            prompt.append(len(req.origin_input_ids))
            completion.append(len(req.output_ids))
            cached.append(req.cached_tokens)
            sp = req.sampling_params
            skip.append(sp.skip_special_tokens)
            spaces.append(sp.spaces_between_special_tokens)
            no_trim.append(sp.no_stop_trim)
            stops.append(req.stop_strs)
            lps.append(req.output_token_logprobs[req.sent_len :] if req.return_logprob else [])
            tops.append(req.output_top_logprobs[req.sent_len :] if req.return_logprob else [])
            if (
                req.return_logprob
                and req.logprob_start_len >= 0
                and not req.input_logprobs_sent
                and (req.output_ids or req.finished())
            ):
                in_lps.append(req.input_token_logprobs[: len(req.origin_input_ids)])
                in_tops.append(
                    req.input_top_logprobs[: len(req.origin_input_ids)] if req.top_logprobs_num > 0 else None
                )
                req.input_logprobs_sent = True
            else:
                in_lps.append(None)
                in_tops.append(None)
            any_lp = any_lp or req.return_logprob
            req.sent_len = len(req.output_ids)
            status.append(fr.status if fr is not None and fr.type == "abort" else 0)
            if fr is not None and self.disagg is not None:
                self.disagg.on_finished(req)  # PD prefill: a room that never shipped is failed, with the reason
            if fr is not None and self.tracer.enabled and fr.type == "abort":
                self.tracer.emit(ev.ReqAborted(rid=req.rid, reason=fr.message))
        if not rids:
            return
        self.io.send(
            BatchTokenIDOut(
                rids=rids,
                new_token_ids=new_ids,
                finished_reasons=reasons,
                matched_stops=matched,
                prompt_tokens=prompt,
                completion_tokens=completion,
                cached_tokens=cached,
                skip_special_tokens=skip,
                spaces_between_special_tokens=spaces,
                no_stop_trim=no_trim,
                stop_strs=stops,
                output_token_logprobs=lps if any_lp else None,
                output_top_logprobs=tops if any_lp else None,
                input_token_logprobs=in_lps if any_lp else None,
                input_top_logprobs=in_tops if any(t is not None for t in in_tops) else None,
                error_messages=[
                    (fr_msg if r == "abort" and isinstance(fr_msg, str) else None)
                    for r, fr_msg in zip(reasons, matched)
                ]
                if any(r == "abort" for r in reasons)
                else None,
                error_status=status if any(status) else None,
                ts=trace_clock.now_ns(),
            )
        )

    # ==== trace ======================================================================
    def describe_batch_step(self, batch: ScheduleBatch) -> list:
        """Each request's share of a batch about to launch; emits its cache.match / req.scheduled."""
        t = self.tracer
        decode = batch.forward_mode == ForwardMode.DECODE
        step_reqs = []
        for i, req in enumerate(batch.reqs):
            if decode:
                drafts = len(batch.spec_drafts[i]) if batch.spec_drafts is not None else 0
                step_reqs.append(ev.StepReq(req.rid, decode=1, drafts=drafts))
                continue
            prefix = len(req.prefix_indices)
            # Chunk k of n: this one, plus what is left after it at the chunk size (an estimate when a
            # later step's budget is shared). A cut request always has more to come, even when what
            # is left would fit in one chunk (it was cut because others used the step's budget).
            rest = len(req.origin_input_ids) + len(req.output_ids) - prefix - req.extend_input_len
            chunk = self.chunked_prefill_size
            k = req.num_chunks_done
            n = k + 1 + (0 if rest <= 0 else (-(-rest // chunk) if chunk else 1))
            if req.num_chunks_done == 0:
                t.emit(ev.CacheMatch(rid=req.rid, matched=prefix, prompt_tokens=len(req.origin_input_ids)))
            # Only a first chunk reads a cached prefix; a later one's prefix is its own earlier chunks.
            t.emit(
                ev.ReqScheduled(
                    rid=req.rid,
                    prefix_hit=prefix if k == 0 else 0,
                    extend_len=req.extend_input_len,
                    chunk_index=k,
                    num_chunks=n,
                )
            )
            step_reqs.append(
                ev.StepReq(
                    req.rid, cached=prefix if k == 0 else 0, computed=req.extend_input_len, chunk_index=k, num_chunks=n
                )
            )
        return step_reqs

    def emit_batch_step(
        self,
        batch: ScheduleBatch,
        schedule_ms: float,
        forward_ms: float,
        step_reqs: list | None = None,
        step: int = -1,
    ) -> None:
        """The `batch.step` event; `step_reqs` from `describe_batch_step` at launch (computed now if None)."""
        if step_reqs is None:
            step_reqs = self.describe_batch_step(batch)
        decode = batch.forward_mode == ForwardMode.DECODE
        bs = len(batch.reqs)
        self.tracer.emit(
            ev.BatchStep(
                mode="decode" if decode else "extend",
                reqs=step_reqs,
                batch_size=bs,
                padded_size=batch.padded_size or bs,
                cuda_graph=batch.cuda_graph,
                backend=self.tp_worker.model_runner.attn_backend.name,
                schedule_ms=schedule_ms,
                forward_ms=forward_ms,
                step=step,
            )
        )

    def emit_moe_routing(self, step_reqs: list | None, routing: list | None, step: int = -1) -> None:
        """The `moe.routing` event of a step of a mixture-of-experts model: tokens per expert in each
        sparse layer, and each request's share. `step_reqs` (describe_batch_step, every row of the
        batch) gives each request's tokens in the pass, in the order the pass laid them out."""
        blocks = getattr(self.tp_worker.model_runner, "moe_blocks", None)
        if not routing or not blocks or not step_reqs:
            return
        num_experts = blocks[0][1].experts.num_experts
        sizes = [(s.decode + s.drafts) or s.computed for s in step_reqs]
        which_req = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
        counts, per_req = [], []
        for ids in routing:
            ids = ids.to("cpu", torch.int64)
            if ids.shape[0] != which_req.numel():  # padded rows (a CUDA graph bucket): not requests
                ids = ids[: which_req.numel()]
            key = which_req.unsqueeze(1) * num_experts + ids
            table = torch.bincount(key.reshape(-1), minlength=len(sizes) * num_experts).view(len(sizes), -1)
            counts.append(table.sum(0).tolist())
            per_req.append(table)
        reqs = []
        for i, s in enumerate(step_reqs):
            pairs = []
            for table in per_req:
                nz = table[i].nonzero().flatten()
                pairs.append(torch.stack([nz, table[i][nz]], 1).reshape(-1).tolist())
            reqs.append(ev.ExpertRoute(s.rid, pairs))
        self.tracer.emit(
            ev.MoeRouting(
                num_experts=num_experts,
                top_k=blocks[0][1].gate.top_k,
                layers=[layer_id for layer_id, _ in blocks],
                counts=counts,
                reqs=reqs,
                step=step,
            )
        )

    def emit_state(self) -> None:
        t = self.tracer
        chunked = [self.chunked_req.rid] if self.chunked_req is not None else []
        waiting = [r.rid for r in self.waiting_queue]
        queued = set(waiting)  # a held request may have been aborted since
        held = [ev.HeldReq(h.rid, h.waits_for, h.shared_tokens) for h in self.held_back if h.rid in queued]
        t.emit(ev.QueueState(waiting=waiting, running=[r.rid for r in self.running_reqs()], chunked=chunked, held=held))
        free = self.token_to_kv_pool_allocator.available_size()
        evictable = self.tree_cache.evictable_size()
        host = getattr(self.tree_cache, "token_to_kv_pool_host", None)  # HiCache's host tier
        t.emit(
            ev.KVUsage(
                used=self.max_total_num_tokens - free - evictable,
                evictable=evictable,
                free=free,
                total=self.max_total_num_tokens,
                host_used=host.size - host.available_size() if host is not None else 0,
                host_total=host.size if host is not None else 0,
            )
        )
        self.emit_tree_if_due()

    def emit_tree_if_due(self) -> None:
        """A CacheTree snapshot at the end of every step whose tree changed (inserts, splits,
        evictions, locks, hits, tier moves: the radix cache reports each through `_on_cache_event`),
        so a recording or a subscriber rebuilds the exact tree after every step (issue #44). Pacing
        by time is the live views' business (they redraw at their own rate), never the trace's."""
        if self.tree_dirty:
            self.emit_tree()
        digest = getattr(self.tree_cache, "digest", None)  # a ChunkCache keeps no tree
        if self.trace_tree_digest and digest is not None:
            self.tracer.emit(ev.CacheDigest(digest=digest()))

    def emit_tree(self) -> None:
        self.tracer.emit(
            ev.CacheTree(
                nodes=self.tree_cache.snapshot(),
                evictable_size=self.tree_cache.evictable_size(),
                protected_size=self.tree_cache.protected_size(),
            )
        )
        self.last_tree_snapshot_ns = time.monotonic_ns()
        self.tree_dirty = False

    def emit_snapshot(self) -> None:
        """A full picture for a subscriber that attaches late (queues, KV, the whole tree)."""
        self.tree_dirty = True
        self.last_tree_snapshot_ns = 0
        self.emit_state()
        self.tracer.flush()
