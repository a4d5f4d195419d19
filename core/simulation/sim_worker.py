"""The simulator's model worker: one of the three implementations of scheduler_contract.ModelWorker
(beside the real TpModelWorker and the tests' stand-in). A pass computes nothing: it samples its tokens
from a seeded generator (or a request's `forced_output_ids`) and advances a `SimClock` by the time the
`CostModel` predicts for the pass's shape. Also here: the drafter of a simulated speculative run and the
overlap loop's client on two timelines. The offline `Simulator` (simulator.py) and the live simulated
deployment (live.py) hand these to a real Scheduler.
"""

from __future__ import annotations

import random

import torch
from workbench.core.layers.logits_processor import LogitsOutput
from workbench.core.layers.sampler import SamplerOutput
from workbench.core.managers.schedule_batch import ModelWorkerBatch, Req
from workbench.core.managers.scheduler_contract import (
    ForwardOutput,
    GenerationBatchResult,
    PoolModelConfig,
    PoolRunner,
)
from workbench.core.simulation.cost_model import CostModel

FIRST_TOKEN = 3  # sampled ids stay clear of the usual special ids 0-2


class SimClock:
    """Simulated seconds since the run began; `ns()` is the trace's clock."""

    def __init__(self):
        self.now = 0.0

    def ns(self) -> int:
        return int(self.now * 1e9)


def sim_runner(spec, max_total_tokens: int, max_running_requests: int, context_len: int) -> PoolRunner:
    """What the Scheduler reads off a simulated worker's runner: the model's numbers and real pools."""
    config = PoolModelConfig(context_len=context_len, vocab_size=spec.vocab, eos_token_ids=[0])
    return PoolRunner(
        config,
        max_total_tokens,
        max_running_requests,
        dtype=torch.bfloat16,
        backend_name="simulated",
        kv_head_num=max(1, spec.kv_heads),
    )


class SimWorker:
    """A ModelWorker (scheduler_contract.py) that computes nothing: a pass samples its tokens from a
    seeded generator (a request's `forced_output_ids` where it has them) and advances the clock by
    the time the cost model predicts for it."""

    def __init__(
        self, runner: PoolRunner, cost: CostModel, clock: SimClock, seed: int, accept_rate: float | None = None
    ):
        self.model_runner = runner
        self.cost, self.clock, self.seed = cost, clock, seed
        self.rng = torch.Generator().manual_seed(seed)
        self.accept_rate = accept_rate  # speculative decoding: each draft kept with this probability
        self.accept_rng = random.Random(seed)
        self.tp_rank = 0
        self.drafter: SimDrafter | None = None  # set when a STANDALONE draft model is costed
        self._last_ms = 0.0
        self.busy_s = 0.0  # simulated time spent in passes
        self.passes = 0
        # HiCache: the runner's host pool (make_hiradix_cache puts it there) reports its copies' bytes; each
        # pass is charged those since the last (CostModel.hicache). The pool sizes its bytes from this.
        runner.kv_bytes_per_token = int(cost.kv_bytes_per_token_per_rank())
        self._hicache_seen = (0, 0, 0)  # host pool bytes loaded, written; storage bytes prefetched
        self.hicache_s = 0.0  # simulated time charged for HiCache copies
        # rid -> when the first pass with that request began (kept when a dict is set: the PD simulator's
        # prefill replicas, to split a request's wait from its prefill)
        self.first_pass: dict[str, float] | None = None

    def compute(self, mwb: ModelWorkerBatch):
        """The pass's predicted cost and its sampled tokens; the clock is the caller's to move."""
        new = list(mwb.extend_seq_lens_cpu)
        rows = mwb.spec_rows or [1] * len(new)
        cost = self.cost.step(new, list(mwb.seq_lens_cpu), logits_rows=sum(rows))
        if mwb.spec_rows and self.drafter is not None:  # the draft model's passes ran just before
            cost.draft = self.drafter.take_pending()
        self._charge_hicache(cost)
        self.busy_s += cost.total
        self.passes += 1
        if self.first_pass is not None:
            for req in mwb.reqs or []:
                self.first_pass.setdefault(req.rid, self.clock.now)
        vocab = self.model_runner.model_config.vocab_size
        ids = torch.randint(FIRST_TOKEN, vocab, (sum(rows),), generator=self.rng, dtype=torch.int64)
        if mwb.spec_rows and self.accept_rate is not None:
            ids = self._verify_tokens(mwb, mwb.reqs, ids, vocab)
        else:
            self._replay_tokens(mwb.reqs or [], ids)
        out = ForwardOutput(LogitsOutput(next_token_logits=torch.zeros((len(ids), 1))), SamplerOutput(ids), None)
        return cost, out

    def _charge_hicache(self, cost) -> None:
        """Charge the HiCache copies made since the last pass (the load-backs of this pass's matches,
        the backups of the last results) to this pass."""
        host = getattr(self.model_runner, "token_to_kv_pool_host", None)
        if host is None:
            return
        now = (host.bytes_loaded, host.bytes_written, getattr(host, "bytes_prefetched", 0))
        loaded, written, prefetched = (a - b for a, b in zip(now, self._hicache_seen))
        self._hicache_seen = now
        if loaded or written or prefetched:
            self.cost.hicache(cost, loaded, written, prefetched)
            self.hicache_s += cost.hicache

    def _replay_tokens(self, reqs: list[Req], ids: torch.Tensor) -> None:
        """Rows of requests with forced output (a recorded run's) get their next forced token (one row
        per request; the rest keep their sampled ones, drawn all the same so the generator's stream
        does not shift)."""
        for j, req in enumerate(reqs):
            want = req.forced_output_ids
            pos = len(req.output_ids)
            if want is not None and pos < len(want):
                ids[j] = want[pos]

    def _verify_tokens(
        self, mwb: ModelWorkerBatch, reqs: list[Req] | None, ids: torch.Tensor, vocab: int
    ) -> torch.Tensor:
        """A verify pass's tokens. A request replaying a recorded run gets its recorded tokens in its
        rows (its last token and drafts d1..dk: row j holds the output that followed d1..dj), so its
        drafts stand exactly as far as they agree with what the real target chose. Any other request:
        row j agrees with d(j+1) with probability accept_rate while every earlier draft was agreed
        with; a row that disagrees samples anything but the draft (the scheduler keeps drafts up to
        the first)."""
        assert mwb.spec_rows is not None and self.accept_rate is not None
        accept_rate = self.accept_rate
        inputs, out, offset = mwb.input_ids.tolist(), ids.tolist(), 0
        for i, n in enumerate(mwb.spec_rows):
            want = reqs[i].forced_output_ids if reqs else None
            if reqs and want is not None:
                pos = len(reqs[i].output_ids)
                recorded = want[pos : pos + n]
                out[offset : offset + len(recorded)] = recorded
                offset += n
                continue
            agreeing = True
            for j in range(n - 1):
                draft = inputs[offset + j + 1]
                agreeing = agreeing and self.accept_rng.random() < accept_rate
                if agreeing:
                    out[offset + j] = draft
                elif out[offset + j] == draft:
                    out[offset + j] = FIRST_TOKEN + (draft - FIRST_TOKEN + 1) % (vocab - FIRST_TOKEN)
            offset += n
        return torch.tensor(out, dtype=torch.int64)

    def forward_batch(self, mwb: ModelWorkerBatch) -> ForwardOutput:
        cost, out = self.compute(mwb)
        self.clock.now += cost.total  # the normal loop: host work and pass one after the other
        self._last_ms = cost.total * 1000
        return out

    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> GenerationBatchResult:
        out = self.forward_batch(mwb)
        ids = out.sampler_output.next_token_ids.tolist()
        return GenerationBatchResult(out.logits_output, out.sampler_output, ids, self._last_ms, None)


class SimDrafter:
    """Speculative decoding's drafter in a simulated run: every request proposes its full budget of
    draft tokens (random ids), and the SimWorker's verify pass keeps each with the given accept rate.
    The scheduler's own speculative path (budgets, the verify batch, accepting up to the first
    disagreement, freeing the slots of drafts thrown away) runs as it does for NGRAM.

    A request replaying a recorded run (`Req.forced_drafts`: the drafts the real drafter proposed, by
    the output length they followed, from the trace's `spec.verify`) proposes those instead, cut to
    its budget, and nothing where the recording has none (there the real request drafted nothing:
    its budget was 0 or its n-grams matched nothing); its verify rows are its recorded tokens.

    An n-gram drafter's proposals cost no pass of their own. With `draft_cost` (a STANDALONE draft
    model's CostModel) a proposal costs as many decode passes of the draft model as its longest
    draft, over the requests that draft, one token each, at their growing contexts; the time is
    added to the next verify pass (`take_pending`). The draft's catch-up on the tokens the last
    verify kept is folded into its first pass's one token (a simplification: it is a short extend
    in the real drafter)."""

    runner = None  # no draft-model KV pool of its own (the simulator sizes the pool for both)

    def __init__(self, vocab: int, seed: int, draft_cost: CostModel | None = None):
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.draft_cost = draft_cost
        self.pending_s = 0.0
        self.proposal_s: list[float] = []  # each proposal's draft passes, in order

    def _draft(self, req: Req, budget: int) -> list[int]:
        if budget <= 0:
            return []
        book = req.forced_drafts
        if book is None:
            return [self.rng.randrange(FIRST_TOKEN, self.vocab) for _ in range(budget)]
        return book.get(len(req.output_ids), [])[:budget]

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        drafts = [self._draft(r, b) for r, b in zip(reqs, budgets)]
        if self.draft_cost is not None and any(drafts):
            contexts = [len(r.origin_input_ids) + len(r.output_ids) for r, d in zip(reqs, drafts) if d]
            spent = sum(
                self.draft_cost.step([1] * len(contexts), [c + j + 1 for c in contexts]).total
                for j in range(max(map(len, drafts)))
            )
            self.proposal_s.append(spent)
            self.pending_s += spent
        return drafts

    def take_pending(self) -> float:
        spent, self.pending_s = self.pending_s, 0.0
        return spent

    def release(self) -> None:
        pass

    def held_tokens(self) -> int:
        return 0


def make_drafter(worker: SimWorker, vocab: int, draft_cost: CostModel | None) -> SimDrafter:
    """Speculative decoding's drafter for a Scheduler over `worker` (in place of the NGRAM proposals),
    seeded from the worker's seed; a draft model's passes, if costed, go into the worker's verify passes."""
    drafter = SimDrafter(vocab, worker.seed + 1, draft_cost)
    if draft_cost is not None:
        worker.drafter = drafter
    return drafter


class SimOverlapClient:
    """The overlap loop's worker client (tp_worker_overlap_thread.TpModelWorkerClient's interface) on
    two timelines: the host's (the SimClock: the scheduler's work, the trace, every stamp) and the
    device's. A launch costs the host the pass's fixed overhead (batch preparation and launch) and
    queues the pass on the device, which starts it when both it and the host are ready; resolving a
    launch moves the host to the end of that pass. So the scheduler's work on batch N-1's result
    hides behind pass N, as on a GPU, and a step takes max(host overhead, compute), not their sum.
    Placeholder ids stand for tokens still in flight, as in the real client (the simulated worker
    never reads its inputs)."""

    def __init__(self, worker: SimWorker):
        self.worker = worker
        self.device_free = 0.0
        self.num_threads = 1

    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> tuple[list[int], tuple[float, GenerationBatchResult]]:
        cost, out = self.worker.compute(mwb)
        clock = self.worker.clock
        clock.now += cost.overhead
        start = max(clock.now, self.device_free)
        self.device_free = start + cost.total - cost.overhead
        ids = out.sampler_output.next_token_ids.tolist()
        result = GenerationBatchResult(out.logits_output, out.sampler_output, ids, cost.total * 1000, None)
        bs = len(mwb.seq_lens_cpu)
        return [-(i + 1) for i in range(bs)], (self.device_free, result)

    def resolve_batch_result(self, handle: tuple[float, GenerationBatchResult]) -> GenerationBatchResult:
        end, result = handle
        clock = self.worker.clock
        clock.now = max(clock.now, end)
        return result

    def shutdown(self) -> None:
        pass


class NoTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""
