"""The plugin host, as plugin authors import it: `from workbench.plugins import PluginRegistry`.

It lives in the core (`workbench.core.plugins`) because the scheduler looks registered policies up
there; this module re-exports it.
"""

from workbench.core.plugins import (
    GROUP,
    PanelSpec,
    PluginInfo,
    PluginRegistry,
    PolicySpec,
    ViewSpec,
    WorkloadSpec,
    load_plugins,
    policy_factory,
)

__all__ = [
    "GROUP",
    "PanelSpec",
    "PluginInfo",
    "PluginRegistry",
    "PolicySpec",
    "ViewSpec",
    "WorkloadSpec",
    "load_plugins",
    "policy_factory",
]
