"""End-to-end part of tests/fast/test_trace_otel.py (what starts processes, engines or servers, or loads the
reference model).

OpenTelemetry export: spans per request stage, from hand-written events and from the real pipeline."""

from __future__ import annotations

import http.server
import threading
import time

import pytest

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from workbench.core.trace.otel import OtelExporter  # noqa: E402


def test_the_real_pipeline_exports_one_trace_per_request_with_traced_ttft():
    from workbench.core.engine import Engine

    mem = InMemorySpanExporter()
    with Engine(show_progress=False, max_total_tokens=2048) as engine:
        exp = OtelExporter(mem, model=engine.served_model_name, batch=False)
        handle = engine.subscribe_callback(exp, name="otel")
        outs = engine.generate(["The radix tree", "Continuous batching"], {"max_new_tokens": 4, "temperature": 0.0})
        deadline = time.monotonic() + 30  # the last events are still on their way to the bus
        while exp.exported < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        handle.close()
        exp.close()
    roots = [s for s in mem.get_finished_spans() if s.name.startswith("request ")]
    assert {s.attributes["workbench.rid"] for s in roots} == {o["meta_info"]["id"] for o in outs}
    for root in roots:
        out = next(o for o in outs if o["meta_info"]["id"] == root.attributes["workbench.rid"])
        assert root.attributes["gen_ai.usage.output_tokens"] == out["meta_info"]["completion_tokens"] == 4
        # TTFT on the span comes from traced timestamps; the Engine measures it independently.
        assert root.attributes["workbench.ttft_s"] == pytest.approx(out["meta_info"]["ttft"], abs=0.005)
        stages = {s.name for s in mem.get_finished_spans() if s.parent and s.parent.span_id == root.context.span_id}
        assert stages == {"prefill_waiting", "prefill_forward", "decode_loop"}


class _Collector(http.server.BaseHTTPRequestHandler):
    posts: list[tuple[str, bytes]] = []

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        _Collector.posts.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_otlp_traces_endpoint_posts_protobuf_spans_to_a_collector():
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    from workbench.core.engine import Engine

    server = http.server.HTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Collector.posts.clear()
    try:
        endpoint = f"http://127.0.0.1:{server.server_port}/v1/traces"
        with Engine(show_progress=False, max_total_tokens=2048, otlp_traces_endpoint=endpoint) as engine:
            rid = engine.generate("The radix tree", {"max_new_tokens": 2})["meta_info"]["id"]
            deadline = time.monotonic() + 30  # the request's last events are still on their way
            while engine._otel.exported < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        # shutdown flushed the batch processor
        assert _Collector.posts and all(path == "/v1/traces" for path, _ in _Collector.posts)
        assert any(rid.encode() in body for _, body in _Collector.posts)
    finally:
        server.shutdown()
