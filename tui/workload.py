"""The workload driver lives in the core (`workbench.core.trace.workloads`); re-exported for the TUI."""
from workbench.core.trace.workloads import *  # noqa: F401,F403
from workbench.core.trace.workloads import KINDS, SHARED_SYSTEM, WorkloadRunner, chat_text, make_prompts  # noqa: F401
