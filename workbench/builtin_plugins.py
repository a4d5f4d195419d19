"""The built-in panels, views, workloads and policies, registered like any plugin.

Each entry imports its module lazily, inside the factory, so `workbench plugins`
and the engine never import Textual or ipywidgets unless a view is used.
"""

from __future__ import annotations


def register(registry) -> None:
    # Sections are filled in by the modules that own them (TUI panels, widgets,
    # workloads, policies); see each module's `register_builtin(registry)`.
    for module in (
        "workbench.core.managers.schedule_policy",
        "workbench.workloads",
        "workbench.tui.registration",
        "workbench.widgets.registration",
    ):
        try:
            mod = __import__(module, fromlist=["register_builtin"])
        except ImportError as exc:
            # an optional part (e.g. the Jupyter extras) is not installed: `workbench plugins` says so
            registry.note_missing(module, f"{type(exc).__name__}: {exc}")
            continue
        hook = getattr(mod, "register_builtin", None)
        if hook is not None:
            hook(registry)
