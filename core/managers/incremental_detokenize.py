"""Incremental detokenization: token ids in, text deltas out, one scheduler step at a time.

Pure logic, no sockets: `DetokenizerManager` feeds it `BatchTokenIDOut` messages.

Two things make streaming text harder than `tokenizer.decode(ids)`:

* A character can be split across tokens (byte-level BPE encodes an emoji as
  several byte tokens). Each request keeps two offsets into its ids
  (`surr_offset`, `read_offset`): the text of ids[surr_offset:] minus the text
  of ids[surr_offset:read_offset] is what the new ids added, decoded *with*
  their left context so tokenizers that change a token's text by position
  (leading spaces) stay right. That difference is committed only when it does
  not end with U+FFFD, i.e. when no character is still waiting for its bytes.
* Stop strings. The scheduler finishes a request when a stop string appears;
  here the text is trimmed right before it. While streaming, the tail of the
  text that could still grow into a stop string is held back, so a client never
  sees text that a later token turns into (part of) a stop string.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from workbench.core.io_struct import BatchTokenIDOut

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"

# Default bound on per-request states kept alive (finished requests are dropped
# at once; this only catches requests whose finish message never came).
DEFAULT_MAX_STATES = 1 << 16

# A real character needs at most 4 bytes, hence at most 4 byte tokens. The window of
# uncommitted ids can still grow past that when every message ends inside a character
# (several ids per message: speculative steps), so past this many ids the window is
# committed up to its last complete character (`_complete_end`); a tail that stays
# U+FFFD even 4 ids back is invalid UTF-8 from the model and is committed as is, so
# the window cannot grow without bound.
_MAX_UNCOMMITTED_IDS = 16

# (sequences, skip_special_tokens, spaces_between_special_tokens) -> texts
BatchDecodeFn = Callable[[list[list[int]], bool, bool], list[str]]


@dataclass(slots=True)
class DecodeStatus:
    """Per-request incremental decoding state.

    `decoded_text` is the text of decode_ids[:read_offset] (only whole
    characters); `sent_offset` is how much of it has been sent downstream.
    """

    decode_ids: list[int] = field(default_factory=list)
    surr_offset: int = 0
    read_offset: int = 0
    decoded_text: str = ""
    sent_offset: int = 0


def make_batch_decoder(tokenizer, use_rust_batch: bool = True) -> BatchDecodeFn:
    """A function decoding many id lists at once with `tokenizer`.

    For a plain HF fast tokenizer the Rust `decode_batch` is used directly
    (several times faster than transformers' per-sequence Python loop); any
    tokenizer that customises decoding goes through its own `batch_decode`.
    """
    backend = _plain_rust_backend(tokenizer) if use_rust_batch else None
    if backend is not None:

        def decode_rust(seqs: list[list[int]], skip: bool, spaces: bool) -> list[str]:
            # spaces_between_special_tokens only exists for slow tokenizers.
            return backend.decode_batch(seqs, skip_special_tokens=skip)

        return decode_rust

    def decode_hf(seqs: list[list[int]], skip: bool, spaces: bool) -> list[str]:
        return tokenizer.batch_decode(seqs, skip_special_tokens=skip, spaces_between_special_tokens=spaces)

    return decode_hf


def _plain_rust_backend(tokenizer):
    """The `tokenizers.Tokenizer` behind `tokenizer` if decoding it directly is exact."""
    if type(tokenizer).__module__.startswith("tokenizers") and hasattr(tokenizer, "decode_batch"):
        return tokenizer  # already the Rust tokenizer (see load_decode_tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "decode_batch"):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None  # a Python post-processing step the backend does not do
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    if cls._decode is not PreTrainedTokenizerFast._decode or cls.decode is not PreTrainedTokenizerFast.decode:
        return None
    return backend


def stop_safe_end(text: str, sent_offset: int, stop_strs: Sequence[str]) -> int:
    """How far `text` may be streamed without risking (part of) a stop string.

    Stops before the first whole stop string in text[sent_offset:] and, if
    there is none, before the longest suffix that is a proper prefix of a stop
    string (it may still complete into one with the next tokens).
    """
    end = len(text)
    for s in stop_strs:
        if s:
            pos = text.find(s, sent_offset)
            if pos != -1 and pos < end:
                end = pos
    if end < len(text):
        return end
    pending = len(text) - sent_offset
    hold = 0
    for s in stop_strs:
        for k in range(min(len(s) - 1, pending), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return len(text) - hold


class IncrementalDetokenizer:
    """Turns each `BatchTokenIDOut` into the text deltas of its requests.

    Keeps one `DecodeStatus` per unfinished rid, dropped when the request
    finishes and, as a safety net, evicted least-recently-used beyond
    `max_states`.
    """

    def __init__(self, tokenizer, max_states: int = DEFAULT_MAX_STATES, use_rust_batch: bool = True):
        self.tokenizer = tokenizer
        self.max_states = max_states
        self.decode_status: OrderedDict[str, DecodeStatus] = OrderedDict()
        self._batch_decode = make_batch_decoder(tokenizer, use_rust_batch)
        self._warned_eviction = False

    def __len__(self) -> int:
        return len(self.decode_status)

    def release(self, rid: str) -> None:
        """Forget a request (abort, or its finish message went elsewhere)."""
        self.decode_status.pop(rid, None)

    def _status(self, rid: str) -> DecodeStatus:
        st = self.decode_status.get(rid)
        if st is None:
            st = DecodeStatus()
            self.decode_status[rid] = st
            if len(self.decode_status) > self.max_states:
                old_rid, _ = self.decode_status.popitem(last=False)
                if not self._warned_eviction:
                    self._warned_eviction = True
                    logger.warning(
                        "detokenizer holds more than %d requests; evicting the "
                        "least recently used (%s). Its text restarts from its next token.",
                        self.max_states,
                        old_rid,
                    )
        else:
            self.decode_status.move_to_end(rid)
        return st

    def process(self, batch: BatchTokenIDOut) -> list[str]:
        """Text deltas for `batch`, aligned with `batch.rids`; updates the states.

        A delta is the text that became final since the previous message for
        that rid (possibly ""). The request's state is released when it finishes.
        """
        n = len(batch.rids)
        statuses: list[DecodeStatus] = []
        prev_lens: list[int] = []
        ends: list[int] = []
        for i in range(n):
            st = self._status(batch.rids[i])
            prev_lens.append(len(st.decode_ids))
            st.decode_ids.extend(batch.new_token_ids[i])
            statuses.append(st)
            ends.append(self._read_end(st, batch.finished_reasons[i], batch.matched_stops[i], batch.no_stop_trim[i]))

        # One decode call per distinct pair of decoding options: surrogate
        # windows and read windows of every request in that group together.
        groups: dict[tuple[bool, bool], list[int]] = {}
        for i in range(n):
            key = (bool(batch.skip_special_tokens[i]), bool(batch.spaces_between_special_tokens[i]))
            groups.setdefault(key, []).append(i)
        surr_texts: list[str] = [""] * n
        read_texts: list[str] = [""] * n
        try:
            for (skip, spaces), idxs in groups.items():
                seqs = [statuses[i].decode_ids[statuses[i].surr_offset : statuses[i].read_offset] for i in idxs]
                seqs += [statuses[i].decode_ids[statuses[i].surr_offset : ends[i]] for i in idxs]
                texts = self._batch_decode(seqs, skip, spaces)
                m = len(idxs)
                for j, i in enumerate(idxs):
                    surr_texts[i] = texts[j]
                    read_texts[i] = texts[m + j]
        except Exception:
            # Leave every state as it was so the caller may retry request by request.
            for st, k in zip(statuses, prev_lens):
                del st.decode_ids[k:]
            raise

        for i in range(n):
            st = statuses[i]
            if (
                batch.finished_reasons[i] is None
                and ends[i] - st.read_offset > _MAX_UNCOMMITTED_IDS
                and read_texts[i][len(surr_texts[i]) :].endswith(REPLACEMENT_CHAR)
            ):
                key = (bool(batch.skip_special_tokens[i]), bool(batch.spaces_between_special_tokens[i]))
                ends[i], read_texts[i] = self._complete_end(st, ends[i], read_texts[i], *key)

        deltas = []
        for i in range(n):
            deltas.append(
                self._advance(
                    statuses[i],
                    ends[i],
                    surr_texts[i],
                    read_texts[i],
                    batch.finished_reasons[i],
                    batch.matched_stops[i],
                    batch.no_stop_trim[i],
                    batch.stop_strs[i],
                )
            )
            if batch.finished_reasons[i] is not None:
                self.decode_status.pop(batch.rids[i], None)
        return deltas

    def _complete_end(self, st: DecodeStatus, end: int, read_text: str, skip: bool, spaces: bool) -> tuple[int, str]:
        """A long window ending inside a character: the end 1-4 ids back where the text is whole,
        and that text (the last ids wait for their character's other bytes); `end` itself when
        none is (invalid bytes: committed as they are)."""
        for back in range(1, 5):
            if end - back <= st.read_offset:
                break
            text = self._batch_decode([st.decode_ids[st.surr_offset : end - back]], skip, spaces)[0]
            if not text.endswith(REPLACEMENT_CHAR):
                return end - back, text
        return end, read_text

    @staticmethod
    def _read_end(
        st: DecodeStatus, finished_reason: str | None, matched_stop: int | str | None, no_stop_trim: bool
    ) -> int:
        """End of the ids to decode this step: all of them, except a matched stop token."""
        end = len(st.decode_ids)
        if (
            finished_reason is not None
            and not no_stop_trim
            and isinstance(matched_stop, int)
            and not isinstance(matched_stop, bool)
            and end > st.read_offset
            and st.decode_ids[-1] == matched_stop
        ):
            end -= 1
        return end

    @staticmethod
    def _advance(
        st: DecodeStatus,
        end: int,
        surr_text: str,
        read_text: str,
        finished_reason: str | None,
        matched_stop: int | str | None,
        no_stop_trim: bool,
        stop_strs: Sequence[str],
    ) -> str:
        new_text = read_text[len(surr_text) :]
        finished = finished_reason is not None
        if finished:
            # Flush everything, even a dangling partial character.
            text = st.decoded_text + new_text
            if isinstance(matched_stop, str) and matched_stop and not no_stop_trim:
                pos = text.find(matched_stop)
                if pos != -1:
                    text = text[:pos]
            out_end = len(text)
        else:
            if not new_text.endswith(REPLACEMENT_CHAR) or end - st.read_offset > _MAX_UNCOMMITTED_IDS:
                st.decoded_text += new_text
                st.surr_offset = st.read_offset
                st.read_offset = end
            text = st.decoded_text
            # With no_stop_trim the stop string is part of the output anyway.
            out_end = len(text) if no_stop_trim or not stop_strs else stop_safe_end(text, st.sent_offset, stop_strs)
        if out_end <= st.sent_offset:
            return ""
        delta = text[st.sent_offset : out_end]
        st.sent_offset = out_end
        return delta


# Tokenizer classes whose decode is exactly the Rust tokenizer's (no Python post-processing).
_PLAIN_FAST_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def load_decode_tokenizer(model_dir):
    """What the detokenizer decodes with: the bare `tokenizers.Tokenizer` when the directory's
    tokenizer is a plain fast one (no transformers — and so no torch — in the detokenizer process:
    seconds off every start and ~250 MiB of memory), else transformers' AutoTokenizer."""
    import json
    from pathlib import Path

    d = Path(model_dir)
    try:
        cfg = json.loads((d / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        cfg = None
    if (
        cfg is not None
        and cfg.get("tokenizer_class") in _PLAIN_FAST_CLASSES
        and not cfg.get("clean_up_tokenization_spaces", False)
        and (d / "tokenizer.json").is_file()
    ):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(d / "tokenizer.json"))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d))
