"""Serving Workbench: an LLM serving core in the shape of SGLang's runtime that narrates itself."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Engine", "ServerArgs", "__version__"]


def __getattr__(name):
    # Lazy, so `import workbench` (the CLI, plugins) stays cheap.
    if name == "Engine":
        from workbench.core.engine import Engine

        return Engine
    if name == "ServerArgs":
        from workbench.core.args import ServerArgs

        return ServerArgs
    raise AttributeError(name)
