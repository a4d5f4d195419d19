"""NGRAM drafts (`--speculative-algorithm NGRAM`): propose what followed the last time the request's
own text ended the way it ends now.

No second model: for a request whose prompt + output so far ends in the n-gram g, look for the
latest earlier occurrence of g (the longest n from `max_match` down to `min_match` that has one)
within the last `window` tokens, and propose the tokens that followed it. Text that repeats itself
(code being edited, a document being summarised or quoted, structured output) gets long accepted
runs; free-form chat gets few. Verification (the target model on the drafts in one pass) keeps the
output exactly what decoding without drafts would give, so a bad draft only costs compute.
"""

from __future__ import annotations

import numpy as np

DEFAULT_MAX_MATCH = 4
DEFAULT_MIN_MATCH = 1
DEFAULT_WINDOW = 2048


def propose_ngram(
    tokens: list[int],
    num_draft: int,
    max_match: int = DEFAULT_MAX_MATCH,
    min_match: int = DEFAULT_MIN_MATCH,
    window: int = DEFAULT_WINDOW,
) -> list[int]:
    """Up to `num_draft` tokens to follow `tokens`; [] when its suffix has not occurred before."""
    if num_draft <= 0 or len(tokens) < 2:
        return []
    seq = np.asarray(tokens[-window:], dtype=np.int64)
    n_tok = len(seq)
    # candidates: earlier positions c holding the last token (c + 1 must leave a token to propose)
    cands = np.nonzero(seq[:-1] == seq[-1])[0]
    matched = cands if min_match <= 1 else cands[:0]  # the candidates of the longest match so far
    for k in range(1, max_match):  # extend the match one token further back while some candidate holds
        cands = cands[cands >= k]
        cands = cands[seq[cands - k] == seq[n_tok - 1 - k]]
        if cands.size == 0:
            break
        if k + 1 >= min_match:
            matched = cands
    if matched.size == 0:
        return []
    # the latest occurrence that is followed by a full draft, else the latest one
    full = matched[matched + num_draft < n_tok]
    best = int(full[-1] if full.size else matched[-1])
    return seq[best + 1 : best + 1 + num_draft].tolist()
