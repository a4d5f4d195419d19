"""Jupyter views of the serving trace: ipywidgets + plotly FigureWidgets over TraceState.

    from workbench.widgets import Dashboard
    Dashboard(engine)                     # live
    Dashboard.from_trace("run.jsonl")     # replay with Play/slider
    GanttView(engine)                     # any single view, alone
    dash.snapshot(("gantt", "radix"))     # a static picture of this moment (stays in the outputs)

Names are imported lazily, so `import workbench.widgets.registration` (done by
the plugin host on every start) never pulls in ipywidgets or plotly.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Dashboard": "workbench.widgets.dashboard",
    "DEFAULT_VIEWS": "workbench.widgets.dashboard",
    "TraceFeed": "workbench.widgets.feed",
    "TraceView": "workbench.widgets.views",
    "GanttView": "workbench.widgets.views",
    "BatchView": "workbench.widgets.views",
    "RadixTreeView": "workbench.widgets.views",
    "KVPoolView": "workbench.widgets.views",
    "QueueView": "workbench.widgets.views",
    "LatencyView": "workbench.widgets.views",
    "ExpertsView": "workbench.widgets.views",
    "VIEWS": "workbench.widgets.views",
    "sequence_figure": "workbench.widgets.sequence",
    "Snapshot": "workbench.widgets.static",
    "snapshot": "workbench.widgets.static",
    "STATIC_VIEWS": "workbench.widgets.static",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'workbench.widgets' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))
