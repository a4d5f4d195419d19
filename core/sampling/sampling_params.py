"""Per-request sampling parameters, with SGLang's names.

`SamplingParams` crosses process boundaries (TokenizerManager -> Scheduler), so it
is a msgspec Struct. It carries the user's values unchanged; the interpretation
(which rows are greedy, which filters are active) lives in `SamplingBatchInfo`.

Conventions shared with the sampler:
- greedy: `temperature < SAMPLING_EPS` (in practice 0) or `top_k == 1`;
- `top_k == -1` disables top-k; a `top_k` larger than the vocabulary does too;
- the ids that end a request (and that `min_new_tokens` holds back) are
  `stop_token_ids` plus the tokenizer's EOS ids unless `ignore_eos`
  (see `finish_token_ids`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable

import msgspec

_F32_MAX = 3.4028234663852886e38
_F32_TINY = 1.1754943508222875e-38  # smallest normal float32

# Temperatures below this are treated as greedy: dividing logits by a tiny
# temperature overflows float32 and turns the softmax into NaNs.
SAMPLING_EPS = 1e-6

# torch.Generator.manual_seed accepts this range (signed or unsigned 64-bit).
_SEED_MIN = -(1 << 63)
_SEED_MAX = (1 << 64) - 1


class SamplingParams(msgspec.Struct, kw_only=True):
    """How one request samples its tokens and when it stops (SGLang's names)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = disabled
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    # token id -> a value added to its logit before the choice (OpenAI's and SGLang's logit_bias;
    # JSON's string keys are read as ids). Logprobs stay those of the model, unbiased.
    logit_bias: dict[int, float] | None = None
    # Structured outputs (at most one; core/constrained/grammar.py): a JSON Schema (as a string,
    # "$$ANY$$" for any JSON object), a regular expression, or an xgrammar EBNF grammar.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    # ------------------------------------------------------------------ derived

    @property
    def is_greedy(self) -> bool:
        """True when this request always takes the most likely token."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def stop_strs(self) -> list[str]:
        """`stop` as a list (empty when unset)."""
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop]
        return list(self.stop)

    def finish_token_ids(self, tokenizer_eos_ids: Iterable[int] = ()) -> list[int]:
        """Token ids that end this request: `stop_token_ids` plus EOS unless `ignore_eos`.

        These are also the ids `min_new_tokens` must suppress: an id that would not
        end the request need not be held back. Order is kept, duplicates dropped.
        """
        ids: list[int] = list(self.stop_token_ids or [])
        if not self.ignore_eos:
            ids.extend(tokenizer_eos_ids)
        return list(dict.fromkeys(int(i) for i in ids))

    def normalize(self) -> SamplingParams:
        """Put the loosely typed fields into one canonical shape, in place; returns self.

        `stop` becomes a list of non-empty strings (or None) and `stop_token_ids` a
        de-duplicated list of ints (or None). EOS is not merged in: whether it ends
        the request depends on `ignore_eos`, which `finish_token_ids` applies.
        """
        strs = [s for s in self.stop_strs if s]
        self.stop = strs or None
        if self.stop_token_ids is not None:
            ids = list(dict.fromkeys(int(i) for i in self.stop_token_ids))
            self.stop_token_ids = ids or None
        return self

    # ------------------------------------------------------------------ checks

    def verify(self, vocab_size: int | None = None, max_context: int | None = None) -> None:
        """Raise ValueError naming the first invalid parameter.

        `vocab_size` bounds `stop_token_ids`; `max_context` (the model's context
        length) bounds `max_new_tokens`. Either may be None to skip that check.
        """
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{name} must be a number, got {v!r}")
            if not math.isfinite(v):
                raise ValueError(f"{name} must be finite, got {v!r}")
            # The sampler computes in float32: a value that overflows it, or is too small to be
            # anything but zero or a denormal there, would turn logits into inf/NaN.
            if abs(v) > _F32_MAX or 0 < abs(v) < _F32_TINY:
                raise ValueError(f"{name} is outside float32's normal range, got {v!r}")
        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an integer, got {v!r}")

        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if max_context is not None and self.max_new_tokens > max_context:
            raise ValueError(
                f"max_new_tokens ({self.max_new_tokens}) exceeds the model's context length ({max_context})"
            )
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens ({self.max_new_tokens})"
            )
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
                raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
            for t in self.stop_token_ids:
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise ValueError(f"stop_token_ids must hold non-negative integers, got {t!r}")
                if vocab_size is not None and t >= vocab_size:
                    raise ValueError(f"stop_token_ids entry {t} is outside the vocabulary (size {vocab_size})")
        if self.logit_bias is not None:
            for t, b in self.logit_bias.items():
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise ValueError(f"logit_bias keys must be token ids, got {t!r}")
                if vocab_size is not None and t >= vocab_size:
                    raise ValueError(f"logit_bias token id {t} is outside the vocabulary (size {vocab_size})")
                if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}")
        grammars = [k for k in ("json_schema", "regex", "ebnf") if getattr(self, k) is not None]
        if len(grammars) > 1:
            raise ValueError(f"set at most one of json_schema, regex and ebnf, got {', '.join(grammars)}")
        for k in grammars:
            if not isinstance(getattr(self, k), str) or not getattr(self, k):
                raise ValueError(f"{k} must be a non-empty string")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise ValueError(f"seed must be an integer, got {self.seed!r}")
            if not _SEED_MIN <= self.seed <= _SEED_MAX:
                raise ValueError(f"seed must fit in 64 bits, got {self.seed}")


# ---- requests as SGLang's clients send them ------------------------------------------------------
# SGLang 0.5's sampling keys that this engine does not implement (structural tags, stop regexes,
# custom logit processors). SGLang's own frontend sends several of them on
# every request, unset: a key whose value is null (or empty) is ignored, and one that is actually
# set is refused with its name, never silently dropped.
UNSUPPORTED_SGLANG_KEYS = (
    "structural_tag",
    "stop_regex",
    "custom_params",
)
# SGLang's name -> ours
SGLANG_ALIASES = {"sampling_seed": "seed"}
# Accepted for SGLang compatibility, with only the value this engine has (it streams every token).
_FIXED_KEYS = {"stream_interval": (None, 1)}


def sampling_params_from_dict(sp: dict | None) -> SamplingParams:
    """A request's `sampling_params` dict -> SamplingParams, with SGLang's rules: a null value means
    the default, `sampling_seed` is `seed`, and the keys of UNSUPPORTED_SGLANG_KEYS are accepted while
    unset. Raises ValueError naming the key for an unknown key, a set unsupported one, or a bad type."""
    if sp is None:
        return SamplingParams()
    if not isinstance(sp, dict):
        raise ValueError("sampling_params must be a JSON object")
    fields = SamplingParams.__struct_fields__
    kept: dict = {}
    unknown: list[str] = []
    for key, value in sp.items():
        if key in UNSUPPORTED_SGLANG_KEYS:
            if value is None or value == [] or value == {} or value == "":
                continue
            raise ValueError(
                f"sampling parameter {key!r} is not supported by this server yet (structural tags, "
                f"stop regexes and custom processors are not implemented): leave it unset or null"
            )
        if key in _FIXED_KEYS:
            if value not in _FIXED_KEYS[key]:
                raise ValueError(f"sampling parameter {key!r} must be 1 or null here (every token is streamed)")
            continue
        name = SGLANG_ALIASES.get(key, key)
        if name not in fields:
            unknown.append(key)
        elif value is not None:  # null: the default, as SGLang reads it
            if name == "json_schema" and isinstance(value, dict):  # a schema object, not its text
                value = json.dumps(value)
            kept[name] = value
    if unknown:
        valid = sorted(set(fields) | set(SGLANG_ALIASES) | set(UNSUPPORTED_SGLANG_KEYS) | set(_FIXED_KEYS))
        raise ValueError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}; valid: {', '.join(valid)}")
    try:
        return msgspec.convert(kept, SamplingParams, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid sampling_params: {exc}") from None
