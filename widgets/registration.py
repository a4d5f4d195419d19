"""Registers the built-in Jupyter views with the plugin host, like any plugin would.

Nothing heavy is imported here: each factory imports ipywidgets/plotly (via
`workbench.widgets.views`) only when a view is actually built.
"""

from __future__ import annotations

_BUILTIN = (
    (
        "gantt",
        "GanttView",
        "Requests (Gantt)",
        "One row per request: queued, each prefill chunk, decode runs; click for details.",
    ),
    (
        "batch",
        "BatchView",
        "Batch composition",
        "Per step: cached / computed-prefill / decode tokens, step time, CUDA-graph marker.",
    ),
    (
        "radix",
        "RadixTreeView",
        "Radix cache",
        "The prefix tree as an icicle; colour by lock/hit/insert/evict state; hover for text.",
    ),
    ("kv", "KVPoolView", "KV pool", "KV tokens used / evictable / free over time."),
    ("queues", "QueueView", "Queues", "Waiting and running queue lengths over time."),
    ("latency", "LatencyView", "Latency", "TTFT/TPOT/E2E ECDFs and arrival vs TTFT."),
    (
        "experts",
        "ExpertsView",
        "Experts",
        "Mixture-of-experts models: tokens per layer and expert (all steps, last step, one request).",
    ),
)


def _factory(class_name: str):
    def make(source=None, **kw):
        from workbench.widgets import views

        return getattr(views, class_name)(source, **kw)

    make.__name__ = f"make_{class_name}"
    make.__doc__ = f"Build a {class_name} over `source` (an Engine, a recording, a TraceFeed...)."
    return make


def _dashboard(source=None, **kw):
    from workbench.widgets.dashboard import Dashboard

    return Dashboard(source, **kw)


def register_builtin(registry) -> None:
    """Add every built-in view (and the Dashboard itself) to `registry`."""
    for name, cls, title, help_ in _BUILTIN:
        registry.add_view(name, title, _factory(cls), help_)
    registry.add_view("dashboard", "Dashboard", _dashboard, "All views over one live or replayed trace.")
