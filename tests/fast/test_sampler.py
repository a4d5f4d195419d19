"""Sampler, SamplingBatchInfo, SamplingParams.verify and LogitsProcessor on synthetic tensors."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from workbench.core.layers import sampler as sampler_mod
from workbench.core.layers.logits_processor import LogitsProcessor, compute_prompt_logprobs, token_logprobs
from workbench.core.layers.sampler import Sampler
from workbench.core.sampling.sampling_batch_info import SamplingBatchInfo, make_generator
from workbench.core.sampling.sampling_params import SamplingParams

V = 64


def _info(params, **kw):
    kw.setdefault("vocab_size", V)
    return SamplingBatchInfo.from_reqs(params, **kw)


def _logits_from_probs(probs, vocab=V, rest=1e-9):
    """Logits whose softmax is `probs` on the first ids and ~0 on the others."""
    p = torch.full((vocab,), rest, dtype=torch.float64)
    p[: len(probs)] = torch.tensor(probs, dtype=torch.float64)
    return torch.log(p / p.sum()).float()


def _support(probs, n=600, seed=0, **params):
    """Set of ids drawn in n unseeded draws from one distribution with `params`."""
    logits = _logits_from_probs(probs).expand(n, V).contiguous()
    info = _info([SamplingParams(**params)] * n)
    ids = Sampler(make_generator(seed)).forward(logits, info).next_token_ids
    return set(ids.tolist())


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    torch.manual_seed(0)
    logits = torch.randn(6, V) * 3
    greedy = _info([SamplingParams(temperature=0.0)] * 6)
    assert greedy.is_all_greedy and not greedy.need_penalties
    ids = Sampler().forward(logits, greedy).next_token_ids
    assert torch.equal(ids, logits.argmax(-1))

    top1 = _info([SamplingParams(temperature=1.3, top_k=1, seed=i) for i in range(6)])
    assert top1.is_all_greedy
    assert torch.equal(Sampler().forward(logits, top1).next_token_ids, logits.argmax(-1))


def test_mixed_batch_greedy_rows_stay_argmax():
    torch.manual_seed(1)
    logits = torch.randn(8, V)
    params = [SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=2.0) for i in range(8)]
    info = _info(params)
    assert not info.is_all_greedy
    sampler = Sampler(make_generator(3))
    sampled_differs = False
    for _ in range(5):
        ids = sampler.forward(logits, info).next_token_ids
        assert torch.equal(ids[0::2], logits[0::2].argmax(-1))
        sampled_differs |= not torch.equal(ids[1::2], logits[1::2].argmax(-1))
    assert sampled_differs  # temperature 2 on flat logits must not look greedy


def test_input_logits_are_not_modified():
    logits = torch.randn(2, V)
    before = logits.clone()
    info = _info(
        [SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, min_new_tokens=3)] * 2,
        output_ids=[[1, 2], [3]],
        prompt_ids=[[4], [5]],
        eos_ids=[[0], [0]],
    )
    Sampler(make_generator(0)).forward(logits, info)
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- filters


def test_top_p_keeps_smallest_prefix_reaching_top_p():
    probs = [0.5, 0.3, 0.15, 0.05]
    assert _support(probs, top_p=0.4) == {0}
    assert _support(probs, top_p=0.7) == {0, 1}
    assert _support(probs, top_p=0.85) == {0, 1, 2}
    assert _support(probs, top_p=0.97) == {0, 1, 2, 3}


def test_top_k_keeps_k_most_likely():
    probs = [0.1, 0.4, 0.2, 0.3]
    assert _support(probs, top_k=2) == {1, 3}
    assert _support(probs, top_k=3) == {1, 2, 3}


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = [0.4, 0.3, 0.2, 0.08, 0.02]
    assert _support(probs, min_p=0.3) == {0, 1, 2}  # threshold 0.12
    assert _support(probs, min_p=0.6) == {0, 1}  # threshold 0.24
    assert _support(probs, min_p=1.0) == {0}


def test_top_p_applies_to_what_top_k_left():
    # After top_k=2 the distribution is (4/7, 3/7): top_p=0.5 keeps only the first.
    assert _support([0.4, 0.3, 0.2, 0.1], top_k=2, top_p=0.5) == {0}
    assert _support([0.4, 0.3, 0.2, 0.1], top_k=3, top_p=0.5) == {0, 1}


def test_temperature_reshapes_the_distribution():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    n = 4000
    info = _info([SamplingParams(temperature=0.5)] * n, vocab_size=3)
    ids = Sampler(make_generator(11)).forward(logits.expand(n, 3).contiguous(), info).next_token_ids
    freq = torch.bincount(ids, minlength=3).float() / n
    expected = torch.softmax(logits / 0.5, -1)
    assert torch.allclose(freq, expected, atol=0.03), (freq, expected)


def _allowed(row_logits, p: SamplingParams):
    """Reference: the token set a row may sample, computed the slow obvious way."""
    probs = torch.softmax(row_logits.double() / p.temperature, -1)
    order = sorted(range(len(probs)), key=lambda i: -probs[i].item())
    if p.top_k > 0:
        order = order[: p.top_k]
    total = sum(probs[i].item() for i in order)
    kept, mass = [], 0.0
    for i in order:
        if mass / total >= p.top_p and p.top_p < 1.0:
            break
        kept.append(i)
        mass += probs[i].item()
    top = probs[kept[0]].item()
    return {i for i in kept if probs[i].item() >= p.min_p * top}


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    temperature=st.floats(0.3, 2.0),
    top_p=st.sampled_from([1.0, 0.9, 0.6, 0.3]),
    top_k=st.sampled_from([-1, 2, 5, 9]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
    widths=st.sampled_from([(256, 4096), (2, 5), (3,)]),
)
def test_sampled_token_is_always_in_reference_support(seed, temperature, top_p, top_k, min_p, widths):
    # Small prefix widths force the wider-prefix fallbacks on a 12-token vocabulary.
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 12, generator=g) * 2
    p = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    info = SamplingBatchInfo.from_reqs([p] * 4, vocab_size=12)
    sampler = Sampler(make_generator(seed))
    with mock.patch.object(sampler_mod, "_PREFIX_WIDTHS", widths):
        for _ in range(5):
            ids = sampler.forward(logits, info).next_token_ids
            for r in range(4):
                allowed = _allowed(logits[r], p)
                # Borderline cases (a cumulative mass within float error of top_p) are skipped.
                assert ids[r].item() in allowed or _near_boundary(logits[r], p)


@pytest.mark.parametrize("widths", [(256, 4096), (2, 4)])
@pytest.mark.parametrize(
    "kw", [dict(top_k=3), dict(top_p=0.8), dict(top_k=5, top_p=0.7, min_p=0.2), dict(min_p=0.1), dict()]
)
def test_sampling_frequencies_match_filtered_distribution(widths, kw):
    probs = torch.tensor([0.3, 0.2, 0.15, 0.12, 0.08, 0.06, 0.05, 0.04])
    logits = torch.log(probs)
    p = SamplingParams(temperature=0.8, **kw)
    allowed = sorted(_allowed(logits, p))
    expected = torch.zeros(8)
    tempered = torch.softmax(logits / 0.8, -1)
    expected[allowed] = tempered[allowed] / tempered[allowed].sum()
    n = 6000
    info = SamplingBatchInfo.from_reqs([p] * n, vocab_size=8)
    with mock.patch.object(sampler_mod, "_PREFIX_WIDTHS", widths):
        ids = Sampler(make_generator(21)).forward(logits.expand(n, 8).contiguous(), info).next_token_ids
    freq = torch.bincount(ids, minlength=8).float() / n
    assert set(ids.tolist()) == set(allowed)
    assert torch.allclose(freq, expected, atol=0.025), (freq, expected)


def test_wide_nucleus_falls_back_to_a_wider_prefix():
    # 3000 equally likely tokens then a tail: top_p=0.5 keeps ~1500 of them (> 256).
    vocab = 6000
    logits = torch.zeros(vocab)
    logits[:3000] = 8.0
    n = 400
    info = SamplingBatchInfo.from_reqs([SamplingParams(top_p=0.5)] * n, vocab_size=vocab)
    ids = Sampler(make_generator(5)).forward(logits.expand(n, vocab).contiguous(), info).next_token_ids
    assert int(ids.max()) < 3000
    assert len(set(ids.tolist())) > 300  # far more than a 256-wide prefix could give
    # top_k between the prefix widths and V.
    info = SamplingBatchInfo.from_reqs([SamplingParams(top_k=1000)] * n, vocab_size=vocab)
    ids = Sampler(make_generator(5)).forward(logits.expand(n, vocab).contiguous(), info).next_token_ids
    assert int(ids.max()) < 3000 and len(set(ids.tolist())) > 256


def _near_boundary(row_logits, p):
    probs = torch.softmax(row_logits.double() / p.temperature, -1).sort(descending=True).values
    if p.top_k > 0:
        probs = probs[: p.top_k]
    cum = torch.cumsum(probs / probs.sum(), 0)
    return bool(((cum - p.top_p).abs() < 1e-4).any()) or bool(((probs / probs[0] - p.min_p).abs() < 1e-4).any())


# ---------------------------------------------------------------- seeds


def _run_steps(sampler, logits_seq, params, gens):
    info = SamplingBatchInfo.from_reqs(params, vocab_size=logits_seq[0].shape[1], generators=gens)
    return [sampler.forward(l, info).next_token_ids for l in logits_seq]


def test_same_seed_same_tokens_regardless_of_companions_and_order():
    torch.manual_seed(5)
    steps = 6
    target = torch.randn(steps, 1, 500)  # the seeded row's logits over several steps
    others = torch.randn(steps, 3, 500)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    # Alone in a batch.
    g = make_generator(1234)
    alone = [ids[0].item() for ids in _run_steps(Sampler(), list(target), [seeded], [g])]

    # Last of four, companions unseeded and seeded, different shared-generator state.
    comps = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, seed=99), SamplingParams(temperature=0.0)]
    g = make_generator(1234)
    seq = [torch.cat([others[s], target[s]], 0) for s in range(steps)]
    mixed = _run_steps(Sampler(make_generator(7)), seq, comps + [seeded], [None, make_generator(99), None, g])
    assert [ids[3].item() for ids in mixed] == alone

    # First of two, reversed companions.
    g = make_generator(1234)
    seq = [torch.cat([target[s], others[s, :1]], 0) for s in range(steps)]
    first = _run_steps(Sampler(), seq, [seeded, comps[0]], [g, None])
    assert [ids[0].item() for ids in first] == alone

    # A different seed gives a different sequence (500-way choices over 6 steps).
    g = make_generator(4321)
    other_seed = [
        ids[0].item()
        for ids in _run_steps(Sampler(), list(target), [SamplingParams(temperature=1.0, top_p=0.95, seed=4321)], [g])
    ]
    assert other_seed != alone


@pytest.mark.parametrize("kw", [dict(top_p=0.7), dict(top_k=9, min_p=0.05), dict(min_p=0.02), dict()])
def test_seeded_draw_is_inverse_cdf_in_token_order(kw):
    # The token a seed picks is defined by the filtered distribution in vocab order and
    # the generator's next uniform, whichever internal path (dense or sorted prefix) runs.
    torch.manual_seed(8)
    logits = torch.randn(1, 40) * 1.5
    p = SamplingParams(temperature=0.9, seed=77, **kw)
    u = torch.rand(1, generator=make_generator(77)).item()
    probs = torch.softmax(logits[0] / 0.9, -1)
    allowed = sorted(_allowed(logits[0], p))
    w = torch.zeros(40)
    w[allowed] = probs[allowed]
    expected = int(torch.searchsorted(torch.cumsum(w, 0), torch.tensor([u * w.sum().item()]), right=True))
    for widths in [(256, 4096), (2, 4)]:
        with mock.patch.object(sampler_mod, "_PREFIX_WIDTHS", widths):
            info = SamplingBatchInfo.from_reqs([p], vocab_size=40)
            assert Sampler().forward(logits, info).next_token_ids.item() == expected


def test_inverse_cdf_never_picks_zero_weight():
    w = torch.tensor([[0.0, 0.0, 1.0, 0.0, 2.0, 0.0]] * 3)
    u = torch.tensor([0.0, 1 / 3, 1.0 - 1e-9])
    assert sampler_mod._inverse_cdf(w, u).tolist() == [2, 4, 4]


def test_from_reqs_makes_generators_from_seeds():
    logits = torch.randn(1, 300)
    p = [SamplingParams(seed=42)]
    a = Sampler().forward(logits, SamplingBatchInfo.from_reqs(p, vocab_size=300)).next_token_ids
    b = Sampler().forward(logits, SamplingBatchInfo.from_reqs(p, vocab_size=300)).next_token_ids
    assert torch.equal(a, b)


# ---------------------------------------------------------------- penalties


def test_penalties_change_logits_exactly_as_defined():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0], [2.0, -1.0, 0.5, -3.0, 1.0, 0.0]])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25), SamplingParams()]
    info = SamplingBatchInfo.from_reqs(params, output_ids=[[1, 1, 4], [0, 0]], prompt_ids=[[0, 3], [1]], vocab_size=6)
    out = info.apply_penalties(logits.clone())
    # Row 0: seen = {0, 3} (prompt) + {1, 4} (output); output counts: 1 -> 2, 4 -> 1.
    expected0 = torch.tensor(
        [
            2.0 / 2,  # seen, positive: divided
            -1.0 * 2 - 0.5 * 2 - 0.25,  # seen, negative: multiplied; freq 2x; present
            0.5,  # never seen
            -3.0 * 2,  # seen in prompt only: no frequency/presence
            1.0 / 2 - 0.5 * 1 - 0.25,
            0.0,
        ]
    )
    assert torch.allclose(out[0], expected0, atol=0, rtol=0)
    assert torch.equal(out[1], logits[1])  # neutral row untouched, bit for bit


def test_greedy_takes_argmax_of_penalized_logits():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    info = SamplingBatchInfo.from_reqs(
        [SamplingParams(temperature=0, presence_penalty=0.5)], output_ids=[[0]], vocab_size=4
    )
    assert Sampler().forward(logits, info).next_token_ids.item() == 1
    info = SamplingBatchInfo.from_reqs(
        [SamplingParams(temperature=0, repetition_penalty=1.2)], prompt_ids=[[0]], vocab_size=4
    )
    assert Sampler().forward(logits, info).next_token_ids.item() == 1


def test_cumulate_output_tokens_updates_counts():
    info = SamplingBatchInfo.from_reqs(
        [SamplingParams(frequency_penalty=1.0, repetition_penalty=1.5), SamplingParams()],
        output_ids=[[2], []],
        vocab_size=5,
    )
    info.cumulate_output_tokens(torch.tensor([2, 3]))
    assert info.output_counts[0].tolist() == [0, 0, 2, 0, 0]
    assert info.seen_tokens[0].tolist() == [False, False, True, False, False]
    assert info.output_lens.tolist() == [2, 1]


# ---------------------------------------------------------------- min_new_tokens


def test_min_new_tokens_suppresses_eos_until_reached():
    eos = 7
    logits = torch.zeros(1, 10)
    logits[0, eos] = 10.0
    logits[0, 3] = 5.0
    p = SamplingParams(temperature=0, min_new_tokens=2)
    ids = p.finish_token_ids([eos])
    info = SamplingBatchInfo.from_reqs([p], output_ids=[[1]], vocab_size=10, eos_ids=[ids])
    sampler = Sampler()
    assert sampler.forward(logits, info).next_token_ids.item() == 3
    info.cumulate_output_tokens(torch.tensor([3]))  # 2 tokens out: eos allowed again
    assert sampler.forward(logits, info).next_token_ids.item() == eos

    # Sampled rows never draw a suppressed id either, and stop_token_ids count too.
    p = SamplingParams(temperature=1.0, min_new_tokens=5, stop_token_ids=[3])
    n = 300
    info = SamplingBatchInfo.from_reqs([p] * n, vocab_size=10, eos_ids=[p.finish_token_ids([eos])] * n)
    drawn = Sampler(make_generator(0)).forward(logits.expand(n, 10).contiguous(), info).next_token_ids
    assert not ({eos, 3} & set(drawn.tolist()))

    # ignore_eos: eos does not end the request, so it is not held back.
    assert SamplingParams(ignore_eos=True, stop_token_ids=[3]).finish_token_ids([eos]) == [3]


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_and_top_logprobs_match_topk():
    torch.manual_seed(2)
    logits = torch.randn(5, V) * 2
    params = [
        SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4, seed=i) for i in range(4)
    ] + [SamplingParams(temperature=0)]
    info = _info(params, output_ids=[[1, 2]] * 5, prompt_ids=[[3]] * 5)
    out = Sampler().forward(logits, info, return_logprob=True, top_logprobs_num=5)
    raw = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, raw.gather(1, out.next_token_ids[:, None]).squeeze(1))
    vals, ids = out.top_logprobs
    ref_vals, ref_ids = torch.topk(raw, 5, -1)
    assert torch.equal(ids, ref_ids) and torch.allclose(vals, ref_vals)
    assert bool((vals[:, :-1] >= vals[:, 1:]).all())

    plain = Sampler().forward(logits, info)
    assert plain.logprobs is None and plain.top_logprobs is None


# ---------------------------------------------------------------- filter / merge


def test_filter_and_merge_keep_rows_consistent():
    a = SamplingBatchInfo.from_reqs(
        [SamplingParams(temperature=0), SamplingParams(top_p=0.5, presence_penalty=1.0)],
        output_ids=[[], [4]],
        vocab_size=8,
    )
    b = SamplingBatchInfo.from_reqs([SamplingParams(min_new_tokens=3, seed=1)], vocab_size=8, eos_ids=[[0]])
    a.merge_batch(b)
    assert len(a) == 3 and a.need_top_p and a.need_min_new_tokens and a.has_seeded
    assert a.output_counts.shape == (3, 8) and a.min_new_tokens.tolist() == [0, 0, 3]
    assert a.presence_penalties[:, 0].tolist() == [0.0, 1.0, 0.0]
    a.filter_batch([2, 0])
    assert a.top_ps.tolist() == [1.0, 1.0] and not a.need_top_p
    assert a.is_greedy.tolist() == [False, True] and a.generators[1] is None
    assert a.stop_token_mask[0, 0] and a.min_new_tokens.tolist() == [3, 0]


# ---------------------------------------------------------------- verify


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", float("nan")),
        ("top_k", 0),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("frequency_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("presence_penalty", 3.0),
        ("presence_penalty", float("-inf")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 2.5),
        ("repetition_penalty", float("nan")),
        ("temperature", 1e39),
        ("repetition_penalty", 1e-45),
        ("top_p", 1e-40),  # beyond float32
        ("max_new_tokens", -1),
        ("max_new_tokens", 10_000),
        ("n", 0),
        ("stop_token_ids", [5, 1000]),
        ("stop_token_ids", [-1]),
        ("seed", 1 << 70),
    ],
)
def test_verify_rejects_invalid_values(field, value):
    p = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        p.verify(vocab_size=V, max_context=2048)


def test_verify_rejects_min_above_max_and_accepts_valid():
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams(min_new_tokens=10, max_new_tokens=5).verify(V, 2048)
    SamplingParams().verify(V, 2048)
    SamplingParams(
        temperature=0,
        top_p=1.0,
        top_k=-1,
        min_p=1.0,
        frequency_penalty=-2,
        presence_penalty=2,
        repetition_penalty=2.0,
        max_new_tokens=0,
        stop_token_ids=[V - 1],
        seed=-5,
    ).verify(V, 2048)


def test_normalize():
    p = SamplingParams(stop="###", stop_token_ids=[3, 3, 2]).normalize()
    assert p.stop == ["###"] and p.stop_token_ids == [3, 2]
    assert SamplingParams(stop=[""], stop_token_ids=[]).normalize().stop is None


# ---------------------------------------------------------------- logits processor


def test_logits_processor_last_positions_and_padded_vocab():
    torch.manual_seed(4)
    hidden = torch.randn(10, 16)
    weight = torch.randn(40, 16)  # padded head: only 32 real tokens
    last = torch.tensor([3, 9])
    proc = LogitsProcessor(vocab_size=32)
    out = proc(hidden, weight, last)
    full = hidden @ weight[:32].t()
    assert out.all_logits is None and out.next_token_logits.dtype == torch.float32
    assert torch.allclose(out.next_token_logits, full[last], atol=1e-5)
    out_all = proc(hidden, weight, last, return_all_positions=True)
    assert out_all.all_logits.shape == (10, 32)
    assert torch.allclose(out_all.all_logits, full, atol=1e-5)
    assert torch.equal(out_all.next_token_logits, out_all.all_logits[last])

    bf16 = proc(hidden, weight.bfloat16(), last)
    assert bf16.next_token_logits.dtype == torch.float32


def test_prompt_logprobs():
    torch.manual_seed(6)
    all_logits = torch.randn(7, 20)
    input_ids = torch.randint(0, 20, (7,))
    res = compute_prompt_logprobs(all_logits, input_ids, [4, 1, 2], top_logprobs_num=3)
    lp = torch.log_softmax(all_logits, -1)
    assert [r.token_logprobs.numel() for r in res] == [3, 0, 1]
    for t in range(3):
        assert math.isclose(res[0].token_logprobs[t].item(), lp[t, input_ids[t + 1]].item(), rel_tol=1e-6)
    assert math.isclose(res[2].token_logprobs[0].item(), lp[5, input_ids[6]].item(), rel_tol=1e-6)
    assert torch.equal(res[0].top_logprobs[1], torch.topk(lp[:3], 3).indices)
    assert torch.allclose(token_logprobs(all_logits[:2], input_ids[1:3]), lp[[0, 1], input_ids[1:3]])
    with pytest.raises(ValueError):
        compute_prompt_logprobs(all_logits, input_ids, [3, 3])
