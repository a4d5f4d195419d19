"""The prompts of every `workbench bench` command, in one place.

Token-id prompts are built from a seeded random generator, so both sides of a comparison (and two runs
of one bench) get the same ids. The peer benches' workloads (i), (ii), (iii) are `Workload`s: prompts with
the number of new tokens each run decodes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_TOPIC_WORDS = (
    "serving batching cache tree token prefix decode prefill kernel memory queue request "
    "latency throughput scheduler radix chunk model weight"
).split()
_QUESTION_WORDS = "why how what when which explain describe compare list name".split()
_ENGLISH_WORDS = (
    "the of and to in is it that for on with as was by at be this from or an are not have but what "
    "all were when we there can more if will one about up out so them some time would into two "
    "like other then than its now only over also new after way first may any these our see"
).split()


def mixed_prompts(
    tok, n: int, rng: random.Random, lengths: tuple[int, ...] = (16, 32, 64, 128, 256, 384)
) -> list[list[int]]:
    """`n` prompts of words drawn at random, each cut to a length drawn from `lengths`."""
    out = []
    for _ in range(n):
        length = rng.choice(lengths)
        text = " ".join(rng.choice(_TOPIC_WORDS) for _ in range(length))
        out.append(tok.encode(text, add_special_tokens=False)[:length])
    return out


def prefix_prompts(tok, n: int, prefix_len: int, suffix_len: int, rng: random.Random) -> list[list[int]]:
    """`n` prompts sharing one `prefix_len`-token system prompt, each with its own `suffix_len` tokens."""
    base = tok.encode("You are a helpful assistant for a systems course. " * 64, add_special_tokens=False)
    system = base[:prefix_len]
    out = []
    for i in range(n):
        words = " ".join(rng.choice(_QUESTION_WORDS) for _ in range(suffix_len)) + f" {i}"
        out.append(system + tok.encode(words, add_special_tokens=False)[:suffix_len])
    return out


def repeated_text_prompt(tok, n: int, salt: int) -> list[int]:
    """One `n`-token prompt of a repeated sentence, starting with `salt` (distinct salts: no shared prefix)."""
    text = f"{salt} " + "the scheduler batches requests and the radix cache shares prefixes " * (n // 8 + 2)
    return tok.encode(text, add_special_tokens=False)[:n]


def random_ids(rng: random.Random, n: int, length: int, low: int, high: int) -> list[list[int]]:
    """`n` prompts of `length` ids drawn uniformly from [low, high) with the stdlib generator."""
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(n)]


def torch_random_ids(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Deterministic token ids from torch's generator (skipping the lowest ids, where special tokens live)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    low = min(100, vocab // 2)
    return torch.randint(low, min(vocab, 30000), (n, length), generator=g).tolist()


class PromptBuilder:
    """Random prompts of a given token length from a tokenizer (or words without one), as text."""

    def __init__(self, tokenizer, rng: random.Random):
        self.tok = tokenizer
        self.rng = rng
        if tokenizer is not None:
            special = set(getattr(tokenizer, "all_special_ids", []) or [])
            vocab = len(tokenizer)
            self.ids = [i for i in range(vocab) if i not in special]

    def text(self, n_tokens: int) -> str:
        """About `n_tokens` tokens of text (decoded random ids; random words without a tokenizer)."""
        if n_tokens <= 0:
            return ""
        if self.tok is None:
            return " ".join(self.rng.choice(_ENGLISH_WORDS) for _ in range(n_tokens))
        ids = [self.rng.choice(self.ids) for _ in range(n_tokens)]
        return self.tok.decode(ids, skip_special_tokens=True)

    def count(self, text: str) -> int:
        """How many tokens `text` is (words without a tokenizer)."""
        if self.tok is None:
            return len(text.split())
        return len(self.tok.encode(text, add_special_tokens=False))


# ---- the peer benches' workloads ----------------------------------------------------------------------
@dataclass
class Workload:
    """Prompts and the new tokens each run decodes; `decode_only` for (iii), where decode tok/s is
    measured with the 1-new-token run subtracted."""

    key: str
    label: str
    prompts: list[list[int]]
    new_tokens: int
    decode_only: bool = False


def build_workloads(tok, quick: bool) -> list[Workload]:
    """(i), (ii), (iii) on the tokenizer's ids (tiny sizes with --quick)."""
    rng = random.Random(0)
    n = 4 if quick else 32
    lens = (16, 32) if quick else (32, 64, 128, 256)
    new_i, new_ii, new_iii = (8, 8, 8) if quick else (128, 64, 128)
    prefix, own, single = (64, 8, 16) if quick else (512, 32, 64)
    return [
        Workload("i", f"(i) {n} × {min(lens)}–{max(lens)} tok × {new_i} new", mixed_prompts(tok, n, rng, lens), new_i),
        Workload(
            "ii",
            f"(ii) {n} × ({prefix} shared + {own}) × {new_ii} new",
            prefix_prompts(tok, n, prefix, own, rng),
            new_ii,
        ),
        Workload(
            "iii",
            f"(iii) bs 1, {single} tok, decode of {new_iii} new",
            mixed_prompts(tok, 1, rng, (single,)),
            new_iii,
            decode_only=True,
        ),
    ]
