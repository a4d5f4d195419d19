"""The real Scheduler in-process: a stand-in model worker and a list-based I/O (test-only code).

    h = SchedulerHarness(max_total_tokens=256, chunked_prefill_size=64)
    h.submit("a", prompt, max_new_tokens=4)
    h.run_until_idle()
    assert h.tokens("a") == expected_tokens(prompt, 4)

`Scheduler(server_args, None, worker=StandInWorker(...), io=ListIO(roundtrip=True))` is the same
object `run_scheduler_process` builds, minus the model and the sockets (the worker, its runner and
the I/O implement core/managers/scheduler_contract.py's Protocols); `step()` is one iteration of
its event loop (`step_normal`, or `step_overlap` with `overlap=True`), followed by the KV
integrity check (`Scheduler.check_kv_invariants`).

The stand-in worker is a tiny "model" that really uses the KV cache: an extend or decode pass
writes each input token's id into the KV slot the scheduler gave it (`kv_tokens[out_cache_loc]`)
and computes every row's next token from the token ids it reads back through the request's
`req_to_token` row, exactly as attention reads K/V. So a wrong prefix hit, a chunk written to the
wrong slots or a slot reused while still referenced changes the tokens, and `expected_tokens`
(the same rule over a plain list) is the reference. Slots given back to the allocator are
poisoned from the next pass on (as a real KV slot keeps its contents until a later pass writes
it: in the overlap loop the scheduler frees slots while the pass in flight may still read them);
reading one yields POISON, which the rule never produces.
"""

from __future__ import annotations

import torch
from workbench.core.args import ServerArgs
from workbench.core.io_struct import BatchTokenIDOut, TokenizedGenerateReqInput
from workbench.core.layers.logits_processor import LogitsOutput
from workbench.core.layers.sampler import SamplerOutput
from workbench.core.managers.schedule_batch import ModelWorkerBatch
from workbench.core.managers.scheduler import Scheduler
from workbench.core.managers.scheduler_contract import (
    ForwardOutput,
    GenerationBatchResult,
    ListIO,
    PoolModelConfig,
    PoolRunner,
    StepClock,
)
from workbench.core.mem_cache.memory_pool import TokenToKVPoolAllocator
from workbench.core.model_executor.forward_batch_info import ForwardMode
from workbench.core.sampling.sampling_params import SamplingParams
from workbench.core.trace import events as ev
from workbench.core.trace.tracer import Tracer

VOCAB = 1000
EOS = 2
POISON = 1  # what a pass "samples" after reading a freed or never-written KV slot
_FIRST = 3  # the rule's tokens are in [_FIRST, VOCAB): never EOS, never POISON


def next_token(seq: list[int]) -> int:
    """The stand-in model: the next token is a hash of the whole sequence (every token counts)."""
    h = 17
    for t in seq:
        h = (h * 31 + t + 1) % 1_000_003
    return _FIRST + h % (VOCAB - _FIRST)


def repetitive_token(seq: list[int]) -> int:
    """A stand-in model whose output soon repeats (the next token depends on the last two only, over
    8 values), so NGRAM drafts are often right: for the speculative decoding tests."""
    a, b = (seq[-2], seq[-1]) if len(seq) >= 2 else (0, seq[-1] if seq else 0)
    return _FIRST + (a * 7 + b * 13 + 5) % 8


def expected_tokens(prompt: list[int], n: int, rule=next_token) -> list[int]:
    """The reference: `n` greedy tokens of the stand-in model (`rule`) after `prompt`."""
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(rule(seq))
        seq.append(out[-1])
    return out


class PoisoningAllocator(TokenToKVPoolAllocator):
    """The real allocator; slots it takes back are marked unwritten in the stand-in KV when the next
    pass starts (`poison_freed`). Poisoning them at once was stricter than a real KV pool: in the
    overlap loop the scheduler thread frees a request's duplicate prompt slots (the tree had them
    already) while the pass in flight may still read the row it was launched with, whose slots
    still hold their K/V on a real device until a later pass writes them."""

    def __init__(self, size: int, kv_tokens: torch.Tensor):
        self.kv_tokens = kv_tokens
        self.freed: list[torch.Tensor] = []  # appended by the scheduler's thread, taken by the worker's
        # HiCache's load-back and a PD decode server's install write slots they were just handed outside
        # any pass, so a slot handed out again must not be poisoned by the next pass (the harness turns
        # this on for those two only: elsewhere every handed-out slot is written by the pass that uses it).
        self.unpoison_on_alloc = False
        super().__init__(size)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        out = super().alloc(need_size)
        if out is not None and self.unpoison_on_alloc and self.freed:
            self.freed = [t[~torch.isin(t, out)] for t in self.freed]
        return out

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel():
            self.freed.append(free_index.clone())
        super().free(free_index)

    def poison_freed(self) -> None:
        while self.freed:
            self.kv_tokens[self.freed.pop(0)] = -1


class StandInRunner(PoolRunner):
    """The shared pool-only runner (scheduler_contract.PoolRunner, ModelRunner's pool sizes) whose
    allocator poisons freed slots in `kv_tokens`, the stand-in KV (slot -> token id written)."""

    def __init__(self, server_args: ServerArgs, context_len: int):
        tokens = server_args.max_total_tokens
        self.kv_tokens = torch.full((tokens + 1,), -1, dtype=torch.int64)
        self.poisoning = PoisoningAllocator(tokens, self.kv_tokens)
        config = PoolModelConfig(context_len=context_len, vocab_size=VOCAB, eos_token_ids=[EOS])
        super().__init__(config, tokens, server_args.max_running_requests, allocator=self.poisoning)
        # The stand-in KV seen as a one-layer pool: what disaggregated serving hands from prefill to decode.
        self.token_to_kv_pool = TokenIdKV(self.kv_tokens)


class TokenIdKV:
    """`kv_tokens` in MHATokenToKVPool's shape (one layer, one head of size 1; V unused): a PD prefill side
    copies its prompt's entries out and a decode side writes them into its own slots, so a handover that
    moves the wrong slots (or none) changes the tokens the decode side computes."""

    layer_num = head_num = head_dim = 1
    dtype = torch.int64

    def __init__(self, kv_tokens: torch.Tensor):
        self.k_buffer = [kv_tokens.view(-1, 1, 1)]
        self.v_buffer = [torch.zeros_like(self.k_buffer[0])]


class StandInWorker:
    """A ModelWorker (scheduler_contract.py) in place of TpModelWorker: `forward_batch` (the overlap
    thread's call) and `forward_batch_generation` (the normal loop's) over a ModelWorkerBatch, no model."""

    def __init__(self, runner: StandInRunner, rule=next_token):
        self.model_runner = runner
        self.rule = rule
        self.tp_rank = 0
        self.passes: list[tuple[str, list[int]]] = []  # (mode, extend lengths) of every pass

    def forward_batch(self, mwb: ModelWorkerBatch) -> ForwardOutput:
        r = self.model_runner
        r.poisoning.poison_freed()  # slots freed before this pass hold nothing now
        r.kv_tokens[mwb.out_cache_loc] = mwb.input_ids  # "write K/V" of this pass's tokens
        table = r.req_to_token_pool.req_to_token
        ids = []
        rows = mwb.spec_rows or [1] * len(mwb.seq_lens_cpu)  # a speculative verify: a token per position
        for row, seq_len, n in zip(mwb.req_pool_indices.tolist(), mwb.seq_lens_cpu, rows):
            seq = r.kv_tokens[table[row, :seq_len]].tolist()  # "attend" over the row's KV
            for end in range(seq_len - n + 1, seq_len + 1):
                ids.append(POISON if min(seq[:end], default=0) < 0 else self.rule(seq[:end]))
        self.passes.append(
            ("decode" if mwb.forward_mode == ForwardMode.DECODE else "extend", list(mwb.extend_seq_lens_cpu))
        )
        next_ids = torch.tensor(ids, dtype=torch.int64)
        logits = LogitsOutput(next_token_logits=torch.zeros((len(ids), 1)))
        return ForwardOutput(logits, SamplerOutput(next_token_ids=next_ids), None)

    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> GenerationBatchResult:
        out = self.forward_batch(mwb)
        return GenerationBatchResult(
            out.logits_output, out.sampler_output, out.sampler_output.next_token_ids.tolist(), 0.0, None
        )


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(f"t{i}" for i in ids)


class SchedulerHarness:
    """A Scheduler with a stand-in worker and list I/O, stepped by hand."""

    def __init__(
        self,
        *,
        context_len: int = 1024,
        overlap: bool = False,
        check: bool = True,
        rule=next_token,
        step_clock: StepClock | None = None,
        **server_args,
    ):
        server_args.setdefault("max_total_tokens", 4096)
        server_args.setdefault("chunked_prefill_size", -1)
        self.args = ServerArgs(device="cpu", disable_overlap_schedule=not overlap, **server_args)
        self.runner = StandInRunner(self.args, context_len)
        self.runner.poisoning.unpoison_on_alloc = (
            self.args.enable_hierarchical_cache or self.args.disaggregation_mode == "decode"
        )
        self.worker = StandInWorker(self.runner, rule)
        self.io = ListIO(roundtrip=True)  # messages through msgspec both ways, as over ZMQ
        self.events: list = []
        tracer = Tracer("scheduler", sink=self.events.extend, enabled=True)
        self.s = Scheduler(
            self.args,
            None,
            worker=self.worker,
            io=self.io,
            tokenizer=_Tokenizer(),
            tracer=tracer,
            step_clock=step_clock,
        )
        self.overlap = overlap
        if overlap:
            self.s.init_overlap_worker()
        self.check = check
        self.batches: list[tuple[str, list[tuple[str, int]]]] = []  # (mode, [(rid, extend_len)])
        self.out: dict[str, list[int]] = {}
        self.sends: dict[str, list[int]] = {}  # per request: how many new tokens each message carried
        self.finish: dict[str, str | None] = {}
        self.cached: dict[str, int] = {}
        self.errors: dict[str, str | None] = {}
        self.replies: list = []

    # ---- input ---------------------------------------------------------------------
    def submit(
        self,
        rid: str,
        prompt: list[int],
        max_new_tokens: int = 4,
        stream: bool = False,
        priority: int | None = None,
        **sp,
    ) -> None:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, **sp)
        self.io.inbox.append(
            TokenizedGenerateReqInput(
                rid=rid,
                input_text="",
                input_ids=list(prompt),
                sampling_params=params,
                stream=stream,
                priority=priority,
            )
        )

    def send(self, msg) -> None:
        self.io.inbox.append(msg)

    # ---- stepping ----------------------------------------------------------------------
    def step(self):
        """One loop iteration; returns the batch it scheduled (None if none), as (mode, [(rid, extend)])."""
        s = self.s
        step = s.forward_ct
        (s.step_overlap if self.overlap else s.step_normal)()
        self._collect()
        b = s.last_batch if s.forward_ct != step else None  # a paused iteration leaves last_batch as is
        desc = None
        if b is not None:
            mode = "decode" if b.forward_mode == ForwardMode.DECODE else "extend"
            desc = (mode, [(r.rid, b.extend_lens[i]) for i, r in enumerate(b.reqs)])
            self.batches.append(desc)
        if self.check:
            s.check_kv_invariants()
        return desc

    def run_until_idle(self, limit: int = 500) -> None:
        for _ in range(limit):
            self.step()
            if not self.s.has_work() and not self.io.inbox:
                self.step()  # the idle iteration (runs the idle-time check when enabled)
                return
        raise AssertionError(f"the scheduler did not drain in {limit} steps")

    def _collect(self) -> None:
        for msg in self.io.outbox:
            if isinstance(msg, BatchTokenIDOut):
                for i, rid in enumerate(msg.rids):
                    self.out.setdefault(rid, []).extend(msg.new_token_ids[i])
                    self.sends.setdefault(rid, []).append(len(msg.new_token_ids[i]))
                    self.cached[rid] = msg.cached_tokens[i]
                    if msg.finished_reasons[i] is not None:
                        self.finish[rid] = msg.finished_reasons[i]
                        self.errors[rid] = msg.error_messages[i] if msg.error_messages else None
            else:
                self.replies.append(msg)
        self.io.outbox.clear()

    # ---- reading -------------------------------------------------------------------------
    def tokens(self, rid: str) -> list[int]:
        return self.out.get(rid, [])

    def extend_batches(self) -> list[list[tuple[str, int]]]:
        return [reqs for mode, reqs in self.batches if mode == "extend"]

    def trace(self, kind) -> list:
        return [e for e in self.events if isinstance(e, kind)]

    def assert_idle_and_clean(self) -> None:
        """Nothing running, every slot free or evictable in the cache, no row or lock held."""
        s = self.s
        assert not s.has_work()
        counts = s.check_kv_invariants()
        assert counts["locked"] == 0 and counts["held"] == 0 and counts["rows_used"] == 0, counts
        assert counts["free"] + counts["evictable"] == counts["total"], counts


__all__ = [
    "SchedulerHarness",
    "StandInWorker",
    "StandInRunner",
    "ListIO",
    "expected_tokens",
    "repetitive_token",
    "next_token",
    "POISON",
    "EOS",
    "VOCAB",
    "ev",
]
