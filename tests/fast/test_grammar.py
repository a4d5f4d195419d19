"""Structured outputs without an engine (issue #17 item 2): the bitmask unpacking, the sampler's
mask, xgrammar matchers on the default model's tokenizer, the OpenAI mapping of response_format,
and what the trace reducer and the Queues panel make of a constrained request."""

from __future__ import annotations

import pytest
import torch
from workbench.core.constrained.grammar import ANY_JSON, constraint_kind, unpack_bitmask
from workbench.core.layers.sampler import Sampler
from workbench.core.sampling.sampling_batch_info import SamplingBatchInfo, make_generator
from workbench.core.sampling.sampling_params import SamplingParams, sampling_params_from_dict
from workbench.core.trace import events as ev
from workbench.core.trace.state import TraceState


def test_unpack_bitmask_reads_bit_j_of_word_w_as_token_32w_plus_j():
    allowed = {0, 5, 31, 32, 63, 64, 69}
    words = torch.zeros(2, 3, dtype=torch.int32)
    for t in allowed:
        words[0, t // 32] |= 1 << (t % 32)  # bit 31 makes the word negative: still token 31
    words[1] = -1  # all allowed
    mask = unpack_bitmask(words, vocab_size=70)
    assert mask.shape == (2, 70)
    assert set(mask[0].nonzero().flatten().tolist()) == allowed
    assert mask[1].all()


def test_sampler_applies_the_mask_to_constrained_rows_only():
    V = 16
    logits = torch.arange(V, dtype=torch.float32).repeat(3, 1)  # greedy would pick 15
    info = SamplingBatchInfo.from_reqs(
        [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.0)],
        vocab_size=V,
        generators=[None, make_generator(3), None],
    )
    bits = torch.zeros(3, 1, dtype=torch.int32)
    bits[0, 0] = (1 << 2) | (1 << 7)  # row 0: only 2 or 7; greedy takes 7
    bits[1, 0] = (1 << 1) | (1 << 4)  # row 1 samples among 1 and 4 only
    bits[2, 0] = -1  # row 2 all allowed: untouched
    info.vocab_mask = bits
    for _ in range(20):
        ids = Sampler(make_generator(0)).forward(logits.clone(), info).next_token_ids.tolist()
        assert ids[0] == 7 and ids[1] in (1, 4) and ids[2] == 15


def test_sampling_params_take_one_grammar_and_a_schema_object():
    sp = sampling_params_from_dict({"json_schema": {"type": "object"}, "max_new_tokens": 4})
    assert sp.json_schema == '{"type": "object"}' and constraint_kind(sp) == "json_schema"
    assert constraint_kind(SamplingParams(json_schema=ANY_JSON)) == "json_object"
    assert constraint_kind(SamplingParams(regex="a+")) == "regex"
    assert constraint_kind(SamplingParams()) == ""
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(regex="a", ebnf='root ::= "a"').verify(vocab_size=100)
    with pytest.raises(ValueError, match="non-empty string"):
        SamplingParams(regex="").verify(vocab_size=100)


@pytest.fixture(scope="module")
def backend(tokenizer):
    pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (the test tier installs it)")
    from workbench.core.constrained.grammar import GrammarBackend

    return GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def test_matcher_allows_only_what_keeps_the_output_in_the_regex(backend, tokenizer):
    m = backend.matcher("regex", "(yes|no)")
    allowed = unpack_bitmask(backend.fill_bitmask([m, None]), backend.vocab_size)
    assert allowed[1].all()  # the free row
    texts = {tokenizer.decode([t]) for t in allowed[0].nonzero().flatten().tolist()}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), sorted(texts)[:20]
    assert not allowed[0, tokenizer.eos_token_id]  # not complete yet
    for t in tokenizer.encode("yes", add_special_tokens=False):
        assert m.accept_token(t)
    allowed = unpack_bitmask(backend.fill_bitmask([m]), backend.vocab_size)
    assert allowed[0].nonzero().flatten().tolist() == [tokenizer.eos_token_id]  # only the end remains


def test_compiles_are_cached_and_bad_grammars_say_what_is_wrong(backend):
    before = backend.compiles
    backend.compile("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
    backend.compile("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
    assert backend.compiles == before + 1
    with pytest.raises(ValueError) as e:
        backend.compile("regex", "([a-")
    msg = str(e.value)
    assert msg.startswith("invalid regex: ") and ".cc:" not in msg and "\n" not in msg, msg
    with pytest.raises(ValueError, match="invalid ebnf"):
        backend.compile("ebnf", "root ::= ")
    with pytest.raises(ValueError, match="invalid json_schema"):
        backend.compile("json_schema", "{not json")


def test_response_format_maps_to_one_grammar():
    from workbench.core.entrypoints.errors import APIError
    from workbench.core.entrypoints.openai.protocol import ChatCompletionRequest
    from workbench.core.entrypoints.openai.serving_common import structured_output

    def grammar(**kw):
        return structured_output(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **kw))

    assert grammar() == {} and grammar(response_format={"type": "text"}) == {}
    assert grammar(response_format={"type": "json_object"}) == {"json_schema": ANY_JSON}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    assert grammar(response_format=rf) == {
        "json_schema": '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    }
    assert grammar(regex="[0-9]+") == {"regex": "[0-9]+"}
    assert grammar(json_schema=schema) == grammar(response_format=rf)
    for bad, words in (
        ({"response_format": {"type": "yaml"}}, "one of text, json_object, json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "json_schema.schema"),
        ({"response_format": rf, "regex": "a"}, "constrains the output already"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "at most one"),
    ):
        with pytest.raises(APIError, match=words):
            grammar(**bad)


def test_reducer_narration_and_queues_show_a_constrained_request():
    from workbench.tui.model import TuiModel
    from workbench.tui.panels.queues import queue_rows

    events = [
        ev.ReqArrived(ts=1, proc="tokenizer", rid="c"),
        ev.ReqQueued(ts=2, proc="scheduler", rid="c", prompt_tokens=4, queue_len=1, constraint="regex"),
        ev.ReqArrived(ts=3, proc="tokenizer", rid="f"),
        ev.ReqQueued(ts=4, proc="scheduler", rid="f", prompt_tokens=4, queue_len=2),
        ev.QueueState(ts=5, proc="scheduler", waiting=["c", "f"], running=[], chunked=[]),
        ev.BatchStep(
            ts=7, proc="scheduler", step=1, mode="extend", batch_size=2, padded_size=2,
            reqs=[ev.StepReq("c", computed=4), ev.StepReq("f", computed=4)],
        ),
        ev.StepDecision(ts=7, proc="scheduler", step=1, mode="extend", admitted=["c", "f"], constrained=1, mask_ms=0.42),
    ]  # fmt: skip
    m = TuiModel()
    m.apply(events[:5])
    rows = dict(queue_rows(m))
    assert str(rows["c"][1]) == "c /re/" and str(rows["f"][1]) == "f"
    m.apply(events[5:])
    st = m.state
    assert st.requests["c"].constraint == "regex" and st.requests["f"].constraint == ""
    assert "grammar for 1 row 0.4 ms" in st.last_step_line
    assert any("constrained by regex" in t.detail for t in st.requests["c"].timeline)
    # a late subscriber's snapshot keeps it
    late = TraceState()
    late.apply_many(st.snapshot_events())
    assert late.requests["c"].constraint == "regex"


def test_the_mask_without_xgrammar_is_the_same_mask(monkeypatch):
    """apply_token_bitmask uses xgrammar's kernel when it is there, plain torch when not: same result."""
    import sys

    from workbench.core.constrained.grammar import apply_token_bitmask

    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (4, 3), dtype=torch.int32, generator=gen)
    logits = torch.randn(4, 70, generator=gen)
    want = logits.clone().masked_fill_(~unpack_bitmask(bits, 70), float("-inf"))
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        pass
    else:
        assert torch.equal(apply_token_bitmask(logits.clone(), bits), want)
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import fails: the torch path
    assert torch.equal(apply_token_bitmask(logits.clone(), bits), want)


# Issue #43 item 8: schemas no finite value satisfies (xgrammar compiles them to `root ::= root`).
IMPOSSIBLE = [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["self"]},
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
]
RECURSIVE_BUT_FINE = [
    {"type": "object", "properties": {"self": {"$ref": "#"}}},  # optional: {} ends it
    {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
                "required": ["next"],
            }
        },
        "$ref": "#/$defs/node",
    },
    {"type": "array", "items": {"$ref": "#"}},  # [] ends it
]


def test_impossible_schemas_are_refused_at_compile_and_recursive_ones_are_not(backend):
    import json

    for schema in IMPOSSIBLE:
        with pytest.raises(ValueError, match="admits no finite value") as e:
            backend.compile("json_schema", json.dumps(schema))
        assert str(e.value).startswith("invalid json_schema: "), e.value
    with pytest.raises(ValueError, match="invalid ebnf: no output can ever complete"):
        backend.compile("ebnf", 'root ::= "a" root')
    for schema in RECURSIVE_BUT_FINE:
        backend.matcher("json_schema", json.dumps(schema))
    backend.compile("ebnf", 'root ::= "a" root | "b"')


def test_an_impossible_response_format_is_a_400_in_the_http_layer():
    import json

    from workbench.core.entrypoints.errors import APIError
    from workbench.core.entrypoints.openai.protocol import ChatCompletionRequest
    from workbench.core.entrypoints.openai.serving_common import structured_output

    pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (the test tier installs it)")

    def grammar(**kw):
        return structured_output(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **kw))

    for schema in IMPOSSIBLE:
        rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
        with pytest.raises(APIError, match="admits no finite value") as e:
            grammar(response_format=rf)
        assert (e.value.status, e.value.param) == (400, "response_format")
        with pytest.raises(APIError, match="admits no finite value") as e:
            grammar(json_schema=schema)  # SGLang's extra
        assert e.value.param == "json_schema"
    for schema in RECURSIVE_BUT_FINE:
        assert grammar(json_schema=schema) == {"json_schema": json.dumps(schema)}
