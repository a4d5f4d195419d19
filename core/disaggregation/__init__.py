"""Disaggregated prefill/decode (PD): a prefill server hands each prompt's KV to a decode server.

transfer.py is the KV transport between the two (see its module docstring for the wire).
"""

from __future__ import annotations

from workbench.core.trace import events as ev


def transfer_event(status, *, rid: str, role: str, tokens: int) -> ev.PDTransfer:
    """The `pd.transfer` event of one side's finished transfer (`status`: a transport's TransferStatus)."""
    return ev.PDTransfer(
        rid=rid,
        room=status.room,
        role=role,
        tokens=tokens,
        nbytes=status.nbytes,
        ms=status.ms,
        wait_ms=status.wait_ms,
        ok=status.ok,
        error=status.error or "",
    )
