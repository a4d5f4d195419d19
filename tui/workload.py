"""The workload driver lives beside the CLI (`workbench.workloads`: it drives an Engine); re-exported for the TUI."""

from workbench.workloads import *  # noqa: F401,F403
from workbench.workloads import KINDS, SHARED_SYSTEM, WorkloadRunner, chat_text, make_prompts  # noqa: F401
