"""Speculative decoding: NGRAM (drafts from the request's own text) and STANDALONE (drafts from a
second model), verified by the target. Here, the fast part: the proposer against hand-made sequences and
the flags' checks. Through real engines: tests/e2e/test_speculative_tiny_e2e.py (a tiny model: the same
tokens with and without drafts, the same sampled distribution) and tests/e2e/test_speculative_e2e.py
(the default model).
"""

from __future__ import annotations

import pytest
from workbench.core.args import ServerArgs
from workbench.core.speculative.ngram import propose_ngram


# ---- the proposer ---------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_longest_match():
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]
    assert propose_ngram([1, 2, 3, 4, 9, 2, 3, 5, 2, 3], 2) == [5, 2]  # latest occurrence of "2 3"
    assert propose_ngram([5, 1, 9, 1, 2, 8, 1, 2], 2) == [8, 1]  # "1 2" beats the later lone "1"
    assert propose_ngram([1, 2, 3], 2) == []  # nothing repeats
    assert propose_ngram([1, 2, 1, 2], 0) == [] and propose_ngram([7], 3) == []
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 3, min_match=4) == []  # the suffix matches 3 tokens, not 4
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 3, min_match=3) == [4, 1, 2]
    assert propose_ngram([3, 9, 9, 9, 3], 2, window=3) == []  # the earlier 3 is outside the window


def test_flags_are_checked_with_a_way_forward():
    assert ServerArgs(speculative_algorithm="ngram").speculative_algorithm == "NGRAM"
    assert ServerArgs(speculative_algorithm="NGRAM").resolved_num_draft_tokens() == 4
    assert ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=6).resolved_num_draft_tokens() == 6
    assert ServerArgs().resolved_num_draft_tokens() == 0
    with pytest.raises(ValueError, match="NGRAM"):
        ServerArgs(speculative_algorithm="EAGLE")
    with pytest.raises(ValueError, match="draft-model-path"):
        ServerArgs(speculative_algorithm="STANDALONE")
    with pytest.raises(ValueError, match="--tp-size 1"):
        ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path="/x", tp_size=2)
    with pytest.raises(ValueError, match="between 1 and 64"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=0)
