"""The built-in panels, views, workloads and policies, registered like any plugin.

The plugin host reaches this module only through its entry point (`workbench.plugins:
builtin` in pyproject.toml), never by name: it sits above the core. Each part's module is
imported here, in a function, so `workbench plugins` and the engine never import Textual or
ipywidgets unless a view is used (the registration modules import those lazily, too).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType


# One function per part: plain import statements, so the layering test sees every edge.
def _policies() -> ModuleType:
    import workbench.core.managers.schedule_policy as mod

    return mod


def _workloads() -> ModuleType:
    import workbench.workloads as mod

    return mod


def _panels() -> ModuleType:
    import workbench.tui.registration as mod

    return mod


def _views() -> ModuleType:
    import workbench.widgets.registration as mod

    return mod


#: (module, its importer), in registration order.
PARTS: tuple[tuple[str, Callable[[], ModuleType]], ...] = (
    ("workbench.core.managers.schedule_policy", _policies),
    ("workbench.workloads", _workloads),
    ("workbench.tui.registration", _panels),
    ("workbench.widgets.registration", _views),
)


def register(registry) -> None:
    # Sections are filled in by the modules that own them (policies, workloads, TUI panels,
    # widgets); see each module's `register_builtin(registry)`.
    for module, load in PARTS:
        try:
            mod = load()
        except ImportError as exc:
            # an optional part (e.g. the Jupyter extras) is not installed: `workbench plugins` says so
            registry.note_missing(module, f"{type(exc).__name__}: {exc}")
            continue
        hook = getattr(mod, "register_builtin", None)
        if hook is not None:
            hook(registry)
