"""End-to-end part of tests/fast/test_speculative.py (what starts processes, engines or servers, or loads the
reference model).

Speculative decoding: NGRAM (drafts from the request's own text) and STANDALONE (drafts from a
second model), verified by the target.

The proposer against hand-made sequences; through real engines, output with speculation equal
to output without it token for token (greedy, float32, 16 prompts batched, with chunked prefill
and with a retraction forced), no KV leaked, drafts actually accepted; and sampled output with
the same distribution (a chi-square test on a tiny model)."""

from __future__ import annotations

import pytest
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


def test_standalone_refuses_a_draft_with_another_vocabulary(tiny_dir, tmp_path):
    other = make_tiny_llama(tmp_path / "other", vocab_size=300)
    with pytest.raises(Exception, match="tokenizer"):
        with Engine(
            model_path=str(tiny_dir),
            dtype="float32",
            show_progress=False,
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=str(other),
        ):
            pass


# ---- what the views show ---------------------------------------------------------------------------
async def test_the_views_show_drafts_kept_and_thrown(tiny_dir, tmp_path):
    """A Pilot run over a real NGRAM recording: the batch panel marks each verify step's drafts, the
    narration lists them per request, the latency panel and /metrics-style figures give the accept
    length, all equal to the spec.verify events."""
    from pipeline_helpers import drain_events
    from textual.widgets import DataTable
    from tui_helpers import replay_app, wait_for
    from workbench.core.entrypoints.metrics import ServerMetrics
    from workbench.core.trace import events as ev
    from workbench.core.trace.recorder import Recorder

    with Engine(model_path=str(tiny_dir), dtype="float32", show_progress=False, speculative_algorithm="NGRAM") as e:
        sub = e.subscribe(with_snapshot=False)
        try:
            outs = e.generate(input_ids=_prompts()[:4], sampling_params={"max_new_tokens": 24, "temperature": 0.0})
            events = drain_events(sub)
        finally:
            sub.close()
    verifies = [x for x in events if isinstance(x, ev.SpecVerify)]
    kept = sum(r.accepted for v in verifies for r in v.reqs)
    verified = sum(len(v.reqs) for v in verifies)
    assert verifies and kept > 0
    metrics = ServerMetrics("tiny")
    metrics.on_events(events)
    assert metrics.snapshot()["spec_accept_length"] == pytest.approx((kept + verified) / verified)
    assert metrics.snapshot()["spec_accepted_tokens_total"] == kept

    path = tmp_path / "spec.jsonl"
    with Recorder(path) as rec:
        rec.write_batch(events)
    app, replay = replay_app(str(path), panels=["batch", "latency"], layout="grid")
    async with app.run_test(size=(220, 50)) as pilot:
        await wait_for(app.ready.is_set)
        # events come from several processes: the last drained need not be the latest
        replay.advance_to(max(x.ts for x in events))
        app._tick()
        await pilot.pause()
        app.refresh_panels(force=True)
        await pilot.pause()
        state = app.model.state
        assert state.spec.accept_length == pytest.approx((kept + verified) / verified)
        spec_steps = [sv for sv in state.steps if sv.spec is not None]
        assert len(spec_steps) == len(verifies)
        table = app.query_one("#batch-table", DataTable)
        rows = [str(table.get_row_at(i)[-1]) for i in range(table.row_count)]
        marked = [r for r in rows if "drafts ✓" in r]
        assert len(marked) == len(verifies)
        sv = next(s for s in spec_steps if any(r.accepted for r in s.spec.reqs))
        k = sum(r.accepted for r in sv.spec.reqs)
        assert any(f"drafts ✓{k} ✗{sum(len(r.drafts) for r in sv.spec.reqs) - k}" in r for r in marked)
        line = state.narrate(sv)
        assert "verified" in line and f"kept {k}" in line
        first = next(r for r in sv.spec.reqs if r.drafts)
        assert f"{first.rid} {first.accepted}/{len(first.drafts)}" in line
        from workbench.tui.panels.latency import render_latency

        body = render_latency(app.model).renderables[1].plain  # what the panel shows under its table
        assert f"NGRAM accept length {state.spec.accept_length:.2f}" in body
    # the finished requests' token counts include the kept drafts
    for o in outs:
        assert o["meta_info"]["completion_tokens"] == 24
        assert state.requests[o["meta_info"]["id"]].output_tokens == 24
