"""Speculative decoding through real engines on a tiny random-weight model (moved out of the fast tier,
tests/fast/test_speculative.py, for the fast tier's time): output with speculation equal to output without
it token for token (greedy, float32, 16 prompts batched, with chunked prefill and with a retraction forced),
no KV leaked, drafts actually accepted; sampled output with the same distribution (a chi-square test); and
`bench spec --quick`. The proposer and the flags stay in the fast tier; the default model's runs are in
tests/e2e/test_speculative_e2e.py."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from pipeline_helpers import assert_no_kv_leak
from tiny_models import make_tiny_llama

from workbench import Engine


# ---- greedy: the same tokens ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("spec") / "llama", tie_word_embeddings=False, seed=3)


def _prompts() -> list[list[int]]:
    """16 prompts, most of them repetitive (so drafts exist), of 6 to 40 tokens."""
    out = []
    for i in range(16):
        unit = [10 + (7 * i + j) % 200 for j in range(2 + i % 4)]
        out.append((unit * 12)[: 6 + (i * 5) % 35])
    return out


def _run(model_dir, prompts, sp, events: list | None = None, **kw) -> tuple[list[list[int]], dict]:
    """Outputs of one engine (and its counters); with `events`, the trace is appended to it."""
    from pipeline_helpers import drain_events

    with Engine(model_path=str(model_dir), dtype="float32", show_progress=False, **kw) as engine:
        sub = engine.subscribe(with_snapshot=False) if events is not None else None
        try:
            outs = engine.generate(input_ids=prompts, sampling_params=sp)
            if sub is not None:
                events += drain_events(sub)
        finally:
            if sub is not None:
                sub.close()
        assert_no_kv_leak(engine)
        state = engine.get_internal_state()
    return [o["output_ids"] for o in outs], state


GREEDY = {"max_new_tokens": 48, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def plain_outputs(tiny_dir):
    """Greedy output without drafts (the same whatever the pool size or chunking: tested elsewhere)."""
    return _run(tiny_dir, _prompts(), GREEDY, max_total_tokens=4096)[0]


@pytest.mark.parametrize(
    "setting",
    [
        dict(max_total_tokens=4096),
        dict(max_total_tokens=4096, chunked_prefill_size=16),  # prompts up to 40 tokens: prefilled in chunks
        # 16 x (up to 40 + 48) tokens in 600, admitted greedily: decode must retract
        dict(max_total_tokens=600, max_running_requests=16, schedule_conservativeness=0.05),
        dict(max_total_tokens=4096, chunked_prefill_size=16, disable_overlap_schedule=False),
        # verify passes replayed from graphs (the CPU stand-in of CUDA graphs): 5 rows per request,
        # batches of up to 8 requests padded to a bucket, larger ones eager
        dict(max_total_tokens=4096, cuda_graph_stand_in=True, cuda_graph_max_bs=8),
    ],
    ids=["batched", "chunked-prefill", "retraction", "overlap-loop", "verify-graphs"],
)
def test_greedy_output_is_the_same_with_and_without_drafts(tiny_dir, plain_outputs, setting):
    from workbench.core.trace import events as ev

    events: list = []
    spec, state = _run(
        tiny_dir, _prompts(), GREEDY, events, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4, **setting
    )
    assert spec == plain_outputs
    assert state["spec_verified"] > 0 and state["spec_accepted"] > 0  # drafts ran and some stood
    assert state["spec_accepted"] <= state["spec_proposed"]
    verdicts = [r for e in events if isinstance(e, ev.SpecVerify) for r in e.reqs]
    assert verdicts and all(r.accepted <= len(r.drafts) for r in verdicts)
    if "chunked_prefill_size" in setting:
        assert max(e.chunk_index for e in events if isinstance(e, ev.ReqScheduled)) >= 1
    if setting["max_total_tokens"] == 600:  # the case only tests something if the pool really retracts
        assert any(isinstance(e, ev.ReqRetracted) for e in events)
    if setting.get("cuda_graph_stand_in"):  # some verify steps replayed a graph, padded to a bucket
        steps = {(e.proc, e.step): e for e in events if isinstance(e, ev.BatchStep)}
        verify_steps = [steps[(e.proc, e.step)] for e in events if isinstance(e, ev.SpecVerify) and not e.snapshot]
        graphed = [s for s in verify_steps if s.cuda_graph]
        assert graphed and all(s.padded_size in (1, 2, 4, 8) and s.padded_size >= s.batch_size for s in graphed)
        assert all(not s.cuda_graph for s in verify_steps if s.batch_size > 8)


# ---- STANDALONE: drafts from a second model ------------------------------------------------------
@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A smaller model with the target's (tiny) tokenizer: one layer, other weights."""
    return make_tiny_llama(tmp_path_factory.mktemp("draft") / "llama", num_hidden_layers=1, seed=11)


@pytest.mark.parametrize(
    "draft,setting",
    [
        ("itself", dict(max_total_tokens=4096)),
        ("small", dict(max_total_tokens=4096, chunked_prefill_size=16)),
        ("small", dict(max_total_tokens=600, max_running_requests=16, schedule_conservativeness=0.05)),
    ],
    ids=["itself-batched", "small-chunked-prefill", "small-retraction"],
)
def test_standalone_drafts_keep_the_output(tiny_dir, draft_dir, plain_outputs, setting, draft):
    """The target as its own draft model (every draft right) and a one-layer model of other weights
    (most drafts wrong): the same tokens as without drafts; both pools whole after."""
    from workbench.core.trace import events as ev

    events: list = []
    spec, state = _run(
        tiny_dir,
        _prompts(),
        GREEDY,
        events,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(tiny_dir if draft == "itself" else draft_dir),
        speculative_num_draft_tokens=3,
        **setting,
    )
    assert spec == plain_outputs
    assert state["spec_verified"] > 0 and state["kv_check_error"] == ""  # the draft pool is checked too
    if draft == "itself":  # the target's own argmax: every draft stands
        assert state["spec_accepted"] == state["spec_proposed"] > 0
    else:
        assert state["spec_accepted"] < state["spec_proposed"]
    if setting["max_total_tokens"] == 600:
        assert any(isinstance(e, ev.ReqRetracted) for e in events)


# ---- sampled: the same distribution ----------------------------------------------------------------
def test_sampled_output_has_the_same_distribution(tiny_dir):
    """Top-2 sampling at temperature 1 makes the output repeat itself, so drafts are often right;
    the 4-token continuations of 600 samples each way must not tell the two apart (chi-square)."""
    prompt = [5, 6, 5, 6, 5, 6, 5]
    sp = {"max_new_tokens": 5, "temperature": 1.0, "top_k": 2, "ignore_eos": True}
    n = 600
    plain, _ = _run(tiny_dir, [prompt] * n, sp, max_total_tokens=8192, max_running_requests=128)
    spec, state = _run(
        tiny_dir, [prompt] * n, sp, max_total_tokens=8192, max_running_requests=128, speculative_algorithm="NGRAM"
    )
    assert state["spec_accepted"] > 50  # the check below is about verified tokens, many of them
    a = Counter(tuple(o[1:5]) for o in plain)
    b = Counter(tuple(o[1:5]) for o in spec)
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]  # pool rare outcomes
    rare_a = n - sum(a[k] for k in keys)
    rare_b = n - sum(b[k] for k in keys)
    table = [(a[k], b[k]) for k in keys] + ([(rare_a, rare_b)] if rare_a + rare_b else [])
    chi2 = sum((x - y) ** 2 / (x + y) for x, y in table if x + y)  # equal sample sizes
    dof = len(table) - 1
    # p < 0.001 rejects; the Wilson-Hilferty approximation of the chi-square quantile
    z = 3.09
    crit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert dof >= 3 and chi2 < crit, (chi2, crit, table)


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE"])
def test_bench_spec_quick_runs_and_checks_the_tokens(tiny_dir, draft_dir, capsys, algo):
    import argparse

    from workbench.bench.spec_bench import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    extra = ["--speculative-algorithm", algo, "--speculative-draft-model-path", str(draft_dir)]
    args = parser.parse_args(
        ["spec", "--quick", "--model", str(tiny_dir), "--dtype", "float32"] + (extra if algo == "STANDALONE" else [])
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "plain tok/s" in out and "accept len" in out and f"{algo} tok/s" in out
    lines = [ln for ln in out.splitlines() if ln.startswith(("repetitive", "chat"))]
    assert len(lines) == 2 and all(ln.rstrip().endswith("yes") for ln in lines)  # same tokens both ways
