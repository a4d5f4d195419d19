"""The plugin host: entry-point group `workbench.plugins`.

A plugin is a callable `register(registry: PluginRegistry) -> None` published
under the entry-point group `workbench.plugins`. It may add TUI panels, Jupyter
views, workloads and scheduling policies (a registered policy is chosen with
`--schedule-policy NAME` and run by the scheduler). The built-in
ones register through the very same mechanism (`workbench.builtin_plugins`),
so a third party's panel is a peer of ours. A plugin that raises while loading
is reported (`PluginInfo.error`) and skipped; it never takes the host down.

Factories are plain callables; a plugin should import heavy modules (textual,
ipywidgets) inside its factories so that loading the registry stays cheap.

The host lives in the core (the scheduler looks policies up here) and imports
nothing above it: the built-ins, which sit above the core (they name TUI panels and
Jupyter views), reach it only through their entry point, which the package's
metadata (`pip install -e .`) declares. Plugin authors import it as
`workbench.plugins`, which re-exports this module.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

logger = logging.getLogger(__name__)

GROUP = "workbench.plugins"
#: The built-ins' entry point, as pyproject.toml declares it.
BUILTIN_ENTRY_POINT = "workbench.builtin_plugins:register"


@dataclass
class PanelSpec:
    """A TUI panel: `factory()` returns a Textual widget that renders a TraceState."""

    name: str
    title: str
    factory: Callable[[], Any]
    help: str = ""
    plugin: str = ""
    # When set, the panel is left out of the default layout until when(trace_state) is true (the
    # experts heatmap appears with the first moe.routing event); naming it in --panels shows it at once.
    when: Callable[[Any], bool] | None = None


@dataclass
class ViewSpec:
    """A Jupyter view: `factory(source)` returns an ipywidget bound to a TraceState source."""

    name: str
    title: str
    factory: Callable[..., Any]
    help: str = ""
    plugin: str = ""


@dataclass
class WorkloadSpec:
    """A workload generator: `factory(**options)` returns an object with `requests()`."""

    name: str
    factory: Callable[..., Any]
    help: str = ""
    plugin: str = ""


@dataclass
class PolicySpec:
    """A scheduling policy: `factory(tree_cache)` returns an object with `calc_priority(waiting_queue)`."""

    name: str
    factory: Callable[..., Any]
    help: str = ""
    plugin: str = ""


@dataclass
class PluginInfo:
    name: str
    module: str
    distribution: str = ""
    error: str | None = None
    contributed: list[str] = field(default_factory=list)


class PluginRegistry:
    def __init__(self):
        self.panels: dict[str, PanelSpec] = {}
        self.views: dict[str, ViewSpec] = {}
        self.workloads: dict[str, WorkloadSpec] = {}
        self.policies: dict[str, PolicySpec] = {}
        self.missing: list[tuple[str, str]] = []  # (module, why) of built-in parts not loaded
        self.plugins: list[PluginInfo] = []
        self._current: PluginInfo | None = None

    def _add(self, table: dict, spec, kind: str):
        if self._current is not None:
            spec.plugin = self._current.name
            self._current.contributed.append(f"{kind}:{spec.name}")
        table[spec.name] = spec
        return spec

    def add_panel(
        self, name: str, title: str, factory: Callable, help: str = "", when: Callable[[Any], bool] | None = None
    ) -> PanelSpec:
        return self._add(self.panels, PanelSpec(name, title, factory, help, when=when), "panel")

    def add_view(self, name: str, title: str, factory: Callable, help: str = "") -> ViewSpec:
        return self._add(self.views, ViewSpec(name, title, factory, help), "view")

    def add_workload(self, name: str, factory: Callable, help: str = "") -> WorkloadSpec:
        return self._add(self.workloads, WorkloadSpec(name, factory, help), "workload")

    def add_policy(self, name: str, factory: Callable, help: str = "") -> PolicySpec:
        return self._add(self.policies, PolicySpec(name, factory, help), "policy")

    def note_missing(self, module: str, why: str) -> None:
        """A built-in part that could not be imported (an optional extra not installed)."""
        self.missing.append((module, why))

    def load(
        self, register: Callable[[PluginRegistry], None], name: str, module: str, distribution: str = ""
    ) -> PluginInfo:
        """Run one plugin's register function, recording (not raising) its failure."""
        info = PluginInfo(name=name, module=module, distribution=distribution)
        self._current = info
        try:
            register(self)
        except Exception as exc:  # a broken plugin is reported and skipped
            info.error = f"{type(exc).__name__}: {exc}"
            logger.warning("plugin %s failed to load: %s\n%s", name, info.error, traceback.format_exc())
        finally:
            self._current = None
        self.plugins.append(info)
        return info


_REGISTRY: PluginRegistry | None = None


def load_plugins(reload: bool = False) -> PluginRegistry:
    """Load every plugin from the `workbench.plugins` entry points (once per process)."""
    global _REGISTRY
    if _REGISTRY is not None and not reload:
        return _REGISTRY
    reg = PluginRegistry()
    eps = sorted(entry_points(group=GROUP), key=lambda ep: (ep.name != "builtin", ep.name))
    if not any(ep.name == "builtin" for ep in eps):
        # The core never imports the built-ins by name (they sit above it, beside the CLI): without
        # the package's metadata there is no entry point to find them by, and `workbench plugins` says so.
        why = f"no entry point 'builtin' in group {GROUP}: the package's metadata is missing (pip install -e .)"
        reg.plugins.append(PluginInfo("builtin", BUILTIN_ENTRY_POINT, error=why))
        logger.warning("built-in plugins not loaded: %s", why)
    for ep in eps:
        dist = getattr(getattr(ep, "dist", None), "name", "") or ""
        try:
            register = ep.load()
        except Exception as exc:
            reg.plugins.append(PluginInfo(ep.name, ep.value, dist, error=f"{type(exc).__name__}: {exc}"))
            logger.warning("plugin %s could not be imported: %s", ep.name, exc)
            continue
        reg.load(register, ep.name, ep.value, dist)
    _REGISTRY = reg
    return reg


def policy_factory(name: str) -> Callable[..., Any] | None:
    """The factory of the scheduling policy a plugin registered as `name` (None if none did)."""
    spec = load_plugins().policies.get(name)
    return spec.factory if spec is not None else None
