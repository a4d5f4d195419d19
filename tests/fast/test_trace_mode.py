"""`--trace-mode`: auto (emit while something listens), on (always), off (never).

The bus folds everything it receives into its own TraceState (what late subscribers get as a
snapshot), so whether the pipeline emitted while nobody listened is visible afterwards.

The end-to-end tests of this module are in tests/e2e/test_trace_mode_e2e.py.
"""

from __future__ import annotations

import pytest
from workbench.core.args import ServerArgs


def test_trace_mode_is_validated():
    with pytest.raises(ValueError, match="--trace-mode must be"):
        ServerArgs(trace_mode="sometimes")
    with pytest.raises(ValueError, match="emits nothing"):
        ServerArgs(trace_mode="off", record="run.jsonl")
