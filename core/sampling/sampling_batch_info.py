"""SamplingBatchInfo: one batch's sampling parameters as tensors, ready for the Sampler.

Built once per batch from the requests' `SamplingParams` plus what the penalties
need to know about each request's tokens (prompt ids, output ids, the ids that
`min_new_tokens` must hold back). A running decode batch can keep it across
steps with `cumulate_output_tokens`, `filter_batch` and `merge_batch` instead of
rebuilding it from lists every step.

Seeded requests: a request with `seed` samples with its own `torch.Generator`,
so its tokens do not depend on which other requests share the batch. The
generator's state must live as long as the request (it advances every step),
so the owner of the request (the scheduler's `Req`) should keep the generator
and pass it back in `generators`; `make_generator` creates one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Union

import torch
from workbench.core.sampling.sampling_params import SamplingParams

DeviceLike = Union[str, torch.device]  # noqa: UP007


def make_generator(seed: int, device: DeviceLike = "cpu") -> torch.Generator:
    """A torch.Generator on `device` seeded with `seed` (one per seeded request)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


@dataclass(eq=False)
class SamplingBatchInfo:
    """Per-batch sampling tensors (row i = request i). Build with `from_reqs`.

    Rows that need no penalty hold neutral values (penalty 0, repetition 1), so the
    penalty arithmetic is exact identity on them; the optional tensors are None when
    no row in the batch needs them, which is what the Sampler's fast paths test.
    """

    vocab_size: int
    device: torch.device
    temperatures: torch.Tensor  # [B, 1] float32; 1.0 on greedy rows (never divided)
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64; vocab_size where disabled
    min_ps: torch.Tensor  # [B] float32
    is_greedy: torch.Tensor  # [B] bool
    output_lens: torch.Tensor  # [B] int64, tokens generated so far
    generators: list[torch.Generator | None]  # per row; None = the sampler's shared generator
    is_all_greedy: bool = False
    need_top_p: bool = False
    need_top_k: bool = False
    need_min_p: bool = False
    # Penalties (None when no row uses that penalty).
    frequency_penalties: torch.Tensor | None = None  # [B, 1] float32
    presence_penalties: torch.Tensor | None = None  # [B, 1] float32
    repetition_penalties: torch.Tensor | None = None  # [B, 1] float32
    output_counts: torch.Tensor | None = None  # [B, V] int32, counts in the OUTPUT
    seen_tokens: torch.Tensor | None = None  # [B, V] bool, in prompt + output
    # min_new_tokens (None when no row asks for it).
    min_new_tokens: torch.Tensor | None = None  # [B] int64
    stop_token_mask: torch.Tensor | None = None  # [B, V] bool, ids to hold back
    # logit_bias (None when no row has one): added to the logits after the penalties.
    logit_bias: torch.Tensor | None = None  # [B, V] float32, 0 where a row sets nothing
    # Structured outputs: the grammar's allowed tokens this step (core/constrained/grammar.py),
    # set fresh before every step by the scheduler (None: no row constrained). Not carried by
    # filter/merge: it is only valid for the step it was filled for.
    vocab_mask: torch.Tensor | None = None  # [B, ceil(V/32)] int32 bitmask: bit j of word w allows 32w+j

    # ------------------------------------------------------------------ build

    @classmethod
    def from_reqs(
        cls,
        params: Sequence[SamplingParams],
        output_ids: Sequence[Sequence[int]] | None = None,
        prompt_ids: Sequence[Sequence[int]] | None = None,
        vocab_size: int = 0,
        device: DeviceLike = "cpu",
        eos_ids: Sequence[Sequence[int]] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> SamplingBatchInfo:
        """Build the batch's tensors.

        params: one `SamplingParams` per request (assumed verified).
        output_ids / prompt_ids: each request's generated / prompt tokens so far;
            needed only for penalties and min_new_tokens (None = all empty).
        vocab_size: width of the logits the Sampler will see.
        eos_ids: per request, the ids `min_new_tokens` holds back (normally
            `params[i].finish_token_ids(tokenizer_eos_ids)`); None falls back to
            each request's `stop_token_ids`.
        generators: per request, its persistent generator (None for unseeded).
            When the whole argument is None, fresh generators are made from the
            seeds: fine for one step, but a multi-step caller must keep them.
        """
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        device = torch.device(device)
        bs = len(params)
        output_ids = output_ids if output_ids is not None else [[] for _ in range(bs)]
        prompt_ids = prompt_ids if prompt_ids is not None else [[] for _ in range(bs)]
        for name, seq in (
            ("output_ids", output_ids),
            ("prompt_ids", prompt_ids),
            ("eos_ids", eos_ids),
            ("generators", generators),
        ):
            if seq is not None and len(seq) != bs:
                raise ValueError(f"{name} has {len(seq)} entries for {bs} requests")

        greedy = [p.is_greedy for p in params]
        temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        top_ks = [vocab_size if (p.top_k < 0 or p.top_k >= vocab_size) else int(p.top_k) for p in params]
        top_ps = [float(p.top_p) for p in params]
        min_ps = [float(p.min_p) for p in params]
        sampled = [not g for g in greedy]

        if generators is None:
            gens: list[torch.Generator | None] = [
                make_generator(p.seed, device) if p.seed is not None else None for p in params
            ]
        else:
            gens = list(generators)

        def f32(values, shape=None):
            t = torch.tensor(values, dtype=torch.float32, device=device)
            return t.view(shape) if shape is not None else t

        info = cls(
            vocab_size=vocab_size,
            device=device,
            temperatures=f32(temps, (bs, 1)),
            top_ps=f32(top_ps),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=f32(min_ps),
            is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            output_lens=torch.tensor([len(o) for o in output_ids], dtype=torch.int64, device=device),
            generators=gens,
            is_all_greedy=all(greedy),
            # Filters only matter on sampled rows; greedy rows ignore them.
            need_top_p=any(s and p < 1.0 for s, p in zip(sampled, top_ps)),
            need_top_k=any(s and k < vocab_size for s, k in zip(sampled, top_ks)),
            need_min_p=any(s and m > 0.0 for s, m in zip(sampled, min_ps)),
        )

        freq = [float(p.frequency_penalty) for p in params]
        pres = [float(p.presence_penalty) for p in params]
        rep = [float(p.repetition_penalty) for p in params]
        need_counts = [f != 0.0 or q != 0.0 for f, q in zip(freq, pres)]
        need_seen = [r != 1.0 for r in rep]
        if any(f != 0.0 for f in freq):
            info.frequency_penalties = f32(freq, (bs, 1))
        if any(q != 0.0 for q in pres):
            info.presence_penalties = f32(pres, (bs, 1))
        if any(need_seen):
            info.repetition_penalties = f32(rep, (bs, 1))
            # Only rows with a real penalty get their tokens scattered: long prompts
            # of other rows would cost time for an identity update.
            rows = [list(prompt_ids[i]) + list(output_ids[i]) if need_seen[i] else [] for i in range(bs)]
            info.seen_tokens = _scatter_rows(rows, bs, vocab_size, device, torch.bool)
        if any(need_counts):
            rows = [list(output_ids[i]) if need_counts[i] else [] for i in range(bs)]
            info.output_counts = _scatter_rows(rows, bs, vocab_size, device, torch.int32)

        mins = [int(p.min_new_tokens) for p in params]
        if any(m > 0 and m > len(o) for m, o in zip(mins, output_ids)):
            info.min_new_tokens = torch.tensor(mins, dtype=torch.int64, device=device)
            stops = [
                list(eos_ids[i]) if eos_ids is not None else list(params[i].stop_token_ids or []) for i in range(bs)
            ]
            rows = [stops[i] if mins[i] > 0 else [] for i in range(bs)]
            info.stop_token_mask = _scatter_rows(rows, bs, vocab_size, device, torch.bool)

        if any(p.logit_bias for p in params):
            bias = torch.zeros((bs, vocab_size), dtype=torch.float32)
            for i, p in enumerate(params):
                for t, b in (p.logit_bias or {}).items():
                    if not 0 <= int(t) < vocab_size:
                        raise ValueError(f"logit_bias token id {t} is outside the vocabulary (size {vocab_size})")
                    bias[i, int(t)] = float(b)
            info.logit_bias = bias.to(device)
        return info

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return int(self.temperatures.shape[0])

    @property
    def need_penalties(self) -> bool:
        """Whether any row has a frequency, presence or repetition penalty."""
        return (
            self.frequency_penalties is not None
            or self.presence_penalties is not None
            or self.repetition_penalties is not None
        )

    @property
    def need_min_new_tokens(self) -> bool:
        """Whether any row may still be holding back its stop ids."""
        return self.min_new_tokens is not None

    @property
    def need_logit_bias(self) -> bool:
        """Whether any row has a logit_bias."""
        return self.logit_bias is not None

    @property
    def has_seeded(self) -> bool:
        return any(g is not None for g in self.generators)

    # ------------------------------------------------------------------ apply

    def apply_penalties(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalize `logits` [B, V] in place and return it.

        repetition (HF): for tokens seen in prompt + output, positive logits are
        divided by the penalty and negative ones multiplied by it;
        frequency (OpenAI): minus penalty * count of the token in the output;
        presence (OpenAI): minus penalty for every token present in the output.
        """
        if self.repetition_penalties is not None:
            assert self.seen_tokens is not None
            rep = torch.where(self.seen_tokens, self.repetition_penalties, 1.0)
            logits.copy_(torch.where(logits > 0, logits / rep, logits * rep))
        if self.frequency_penalties is not None:
            assert self.output_counts is not None
            logits.sub_(self.frequency_penalties * self.output_counts)
        if self.presence_penalties is not None:
            assert self.output_counts is not None
            logits.sub_(self.presence_penalties * (self.output_counts > 0))
        return logits

    def apply_logit_bias(self, logits: torch.Tensor) -> torch.Tensor:
        """Add each row's logit_bias to `logits` [B, V], in place."""
        if self.logit_bias is not None:
            logits.add_(self.logit_bias)
        return logits

    def apply_vocab_mask(self, logits: torch.Tensor) -> torch.Tensor:
        """Set the tokens a row's grammar does not allow to -inf, in place."""
        if self.vocab_mask is not None:
            from workbench.core.constrained.grammar import apply_token_bitmask

            apply_token_bitmask(logits, self.vocab_mask)
        return logits

    def apply_min_new_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """Set the stop ids of rows short of `min_new_tokens` to -inf, in place."""
        if self.min_new_tokens is not None:
            assert self.stop_token_mask is not None
            active = (self.output_lens < self.min_new_tokens).unsqueeze(1)
            logits.masked_fill_(self.stop_token_mask & active, float("-inf"))
        return logits

    # ------------------------------------------------------------------ keep across steps

    def cumulate_output_tokens(self, next_token_ids: torch.Tensor) -> None:
        """Account for one freshly sampled token per row (a decode step's output)."""
        ids = next_token_ids.to(device=self.device, dtype=torch.int64).view(-1)
        rows = torch.arange(ids.numel(), device=self.device)
        self.output_lens += 1
        if self.output_counts is not None:
            self.output_counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
        if self.seen_tokens is not None:
            self.seen_tokens[rows, ids] = True

    def filter_batch(self, keep_indices: Sequence[int] | torch.Tensor) -> None:
        """Keep only the given rows (in that order), e.g. after requests finish."""
        keep_list = [int(i) for i in keep_indices]
        keep = torch.tensor(keep_list, dtype=torch.int64, device=self.device)
        for f in _TENSOR_FIELDS:
            t = getattr(self, f)
            if t is not None:
                setattr(self, f, t.index_select(0, keep))
        self.generators = [self.generators[i] for i in keep_list]
        self._refresh_flags()

    def merge_batch(self, other: SamplingBatchInfo) -> None:
        """Append `other`'s rows after this batch's rows (running batch + new prefill)."""
        if other.vocab_size != self.vocab_size:
            raise ValueError(f"cannot merge batches with vocab sizes {self.vocab_size} and {other.vocab_size}")
        n_self, n_other = len(self), len(other)  # before the loop grows self's tensors
        for f in _TENSOR_FIELDS:
            a, b = getattr(self, f), getattr(other, f)
            if a is None and b is None:
                continue
            a = a if a is not None else self._neutral(f, n_self)
            b = b if b is not None else other._neutral(f, n_other)
            setattr(self, f, torch.cat([a, b.to(self.device)], dim=0))
        self.generators = self.generators + other.generators
        self._refresh_flags()

    def _neutral(self, name: str, bs: int) -> torch.Tensor:
        """A tensor for `name` whose rows make the corresponding step a no-op."""
        v, dev = self.vocab_size, self.device
        if name == "repetition_penalties":
            return torch.ones((bs, 1), dtype=torch.float32, device=dev)
        if name in ("frequency_penalties", "presence_penalties"):
            return torch.zeros((bs, 1), dtype=torch.float32, device=dev)
        if name == "logit_bias":
            return torch.zeros((bs, v), dtype=torch.float32, device=dev)
        if name == "output_counts":
            return torch.zeros((bs, v), dtype=torch.int32, device=dev)
        if name in ("seen_tokens", "stop_token_mask"):
            return torch.zeros((bs, v), dtype=torch.bool, device=dev)
        if name == "min_new_tokens":
            return torch.zeros((bs,), dtype=torch.int64, device=dev)
        raise KeyError(name)

    def _refresh_flags(self) -> None:
        sampled = ~self.is_greedy
        self.is_all_greedy = not bool(sampled.any())
        self.need_top_p = bool((sampled & (self.top_ps < 1.0)).any())
        self.need_top_k = bool((sampled & (self.top_ks < self.vocab_size)).any())
        self.need_min_p = bool((sampled & (self.min_ps > 0.0)).any())


# Row-indexed tensors that filter/merge must carry along (all but `generators`).
_TENSOR_FIELDS = tuple(
    f.name
    for f in fields(SamplingBatchInfo)
    if f.name
    not in (
        "vocab_size",
        "device",
        "generators",
        "is_all_greedy",
        "need_top_p",
        "need_top_k",
        "need_min_p",
        "vocab_mask",
    )
)


def _scatter_rows(
    rows: Sequence[Sequence[int]], bs: int, vocab_size: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """[B, V] tensor: counts (int dtype) or presence (bool) of each row's token ids."""
    lens = [len(r) for r in rows]
    flat = [int(t) for r in rows for t in r]
    out = torch.zeros((bs, vocab_size), dtype=torch.int32 if dtype != torch.bool else torch.bool, device=device)
    if not flat:
        return out
    ids = torch.tensor(flat, dtype=torch.int64, device=device)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        bad = next(t for t in flat if t < 0 or t >= vocab_size)
        raise ValueError(f"token id {bad} is outside the vocabulary (size {vocab_size})")
    row_idx = torch.repeat_interleave(
        torch.arange(bs, device=device), torch.tensor(lens, dtype=torch.int64, device=device)
    )
    if dtype == torch.bool:
        out[row_idx, ids] = True
    else:
        out.index_put_((row_idx, ids), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
    return out
