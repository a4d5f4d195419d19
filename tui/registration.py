"""Registers the built-in panels with the plugin registry (called by workbench.builtin_plugins).

Factories import Textual lazily so that loading the registry stays cheap for
processes that never show a TUI.
"""

from __future__ import annotations

#: (name, module, class) in the default order (tabs, `--panels`).
BUILTIN_PANELS = (
    ("queues", "workbench.tui.panels.queues", "QueuesPanel"),
    ("batch", "workbench.tui.panels.batch", "BatchPanel"),
    ("tree", "workbench.tui.panels.tree", "TreePanel"),
    ("kv", "workbench.tui.panels.kv", "KVPanel"),
    ("latency", "workbench.tui.panels.latency", "LatencyPanel"),
    ("events", "workbench.tui.panels.events", "EventsPanel"),
    ("detail", "workbench.tui.panels.detail", "DetailPanel"),
    ("experts", "workbench.tui.panels.experts", "ExpertsPanel"),
    ("pd", "workbench.tui.panels.pd", "PDPanel"),
)

_TITLES = {
    "queues": "Queues",
    "batch": "Batch composition",
    "tree": "Radix tree",
    "kv": "KV pool",
    "latency": "Latency",
    "events": "Events",
    "detail": "Request detail",
    "experts": "Experts",
    "pd": "Prefill | Decode",
}
_SHORT_HELP = {
    "queues": "waiting / running / chunked requests with token counts, age and TTFT so far",
    "batch": "one row per scheduler step: cached / computed / decode tokens per request, mode, sizes, ms",
    "tree": "the radix (prefix) KV-cache tree: text, tokens, locks, hits, age; cold subtrees folded",
    "kv": "KV pool used / evictable / free gauge and its history",
    "latency": "TTFT / TPOT / E2E p50/p90/p99 over 5/15/60 s, TTFT sparkline, throughput",
    "events": "filterable log of arrivals, finishes, retractions, evictions, aborts, errors",
    "detail": "the selected request's timeline, shared steps and streaming text",
    "experts": "mixture-of-experts models: tokens per layer and expert as a heatmap, overall, last step, selected request",
    "pd": "disaggregated serving: the prefill and the decode server side by side, the selected request's journey",
}
# Panels that join the layout only once the trace shows what they draw.
_WHEN = {"experts": lambda state: state.experts.present, "pd": lambda state: bool(state.pd)}


def _factory(module: str, cls: str):
    def make(**kw):
        import importlib

        return getattr(importlib.import_module(module), cls)(**kw)

    make.__qualname__ = f"make_{cls}"
    return make


def panel_help(name: str) -> str:
    """The panel's help text (imports the panel module, hence Textual)."""
    for n, module, cls in BUILTIN_PANELS:
        if n == name:
            import importlib

            return getattr(importlib.import_module(module), cls).HELP
    return ""


def register_builtin(registry) -> None:
    for name, module, cls in BUILTIN_PANELS:
        registry.add_panel(name, _TITLES[name], _factory(module, cls), help=_SHORT_HELP[name], when=_WHEN.get(name))
