"""Which deployment an engine serves, picked from ServerArgs once, where the engine is built.

A real model (the default `Deployment`), or, with `--simulate HARDWARE`, a deployment that is not
there: simulated workers on a shared clock (core/simulation/live.py). Everything past this point
(the Engine, the scheduler processes, the views) reads the `Deployment`, never `--simulate`.
"""

from __future__ import annotations

from workbench.core.args import ServerArgs
from workbench.core.managers.scheduler_contract import Deployment


def resolve_deployment(server_args: ServerArgs) -> tuple[ServerArgs, Deployment]:
    """The deployment `server_args` asks for, and the arguments it runs with (a simulated one sizes
    its pool and batch limits as the real runner would on that hardware)."""
    if server_args.simulate:
        from workbench.core.simulation.live import simulated_deployment

        return simulated_deployment(server_args)
    return server_args, Deployment()
