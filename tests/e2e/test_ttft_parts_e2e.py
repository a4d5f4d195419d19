"""End-to-end part of tests/fast/test_ttft_parts.py (what starts processes, engines or servers, or loads the
reference model).

TTFT explained (#15 item 3): TraceState.ttft_parts splits a request's time to first token into
arrived → queued, queued, prefill chunks and first token, from traced timestamps; the parts sum
to the TTFT exactly.

- hand-made events for the two cases seen: a request that arrived while the scheduler was inside
  a long step, and one that waited behind a chunked prefill (token budget);
- the synthetic run and the recorded real-engine fixture (tests/data/tui_trace.jsonl, an older
  recording without batch.decision): every finished request's parts sum to its TTFT;
- the in-process scheduler stamps each batch.decision with when its step began;
- the request detail panel and the Gantt show the parts;
- (e2e) a real engine on the default model: every finished request's parts sum to its TTFT.
"""

from __future__ import annotations

import threading
import time

from synthetic import check_ttft_sums
from workbench.core.trace import events as ev
from workbench.core.trace.state import TraceState


def test_real_engine_every_ttft_sums_exactly():
    """A real engine on the default model: a long prompt cut into chunks while short ones arrive."""
    from workbench.core.engine import Engine

    long_text = " ".join(f"Step {i}: the scheduler admits, chunks and decodes requests." for i in range(30))
    events: list[ev.Event] = []
    lock = threading.Lock()

    def keep(batch):
        with lock:
            events.extend(batch)

    engine = Engine(show_progress=False, chunked_prefill_size=64, max_running_requests=8, random_seed=0)
    try:
        handle = engine.subscribe_callback(keep, name="ttft-test")
        time.sleep(0.5)  # tracing switches on in the engine's processes
        sp = {"max_new_tokens": 3, "temperature": 0.0}
        prompts = [("long-1", long_text)] + [(f"short-{i}", f"Question {i}: what is {i} + {i}?") for i in range(4)]
        threads = [
            threading.Thread(target=engine.generate, kwargs=dict(prompt=p, sampling_params=sp, rid=rid))
            for rid, p in prompts
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        deadline = time.monotonic() + 30
        while True:  # the last req.finished may still be on its way to the bus
            st = TraceState()
            with lock:
                st.apply_many(list(events))
            if all(rid in st.requests and st.requests[rid].state == "finished" for rid, _ in prompts):
                break
            assert time.monotonic() < deadline, "req.finished events did not all arrive"
            time.sleep(0.2)
        handle.close()
    finally:
        engine.shutdown()
    for rid, _ in prompts:
        b = check_ttft_sums(st, rid)
        chunks = [p for p in b.parts if p.kind == "prefill"]
        pre = [t for t in st.requests[rid].timeline if t.kind == "prefill"]
        assert len(chunks) == len(pre) >= 1
        sv = next(s for s in st.steps if s.step == pre[0].step)
        assert sv.decision is not None and sv.decision.start_ts == chunks[0].start_ts
    n = len([p for p in st.ttft_parts("long-1").parts if p.kind == "prefill"])
    assert n > 1
