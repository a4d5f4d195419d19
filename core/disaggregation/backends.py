"""Which KV transport a PD server uses (--disaggregation-transfer-backend): the sender and receiver to build.

tcp is transfer.py's (built in); mooncake is mooncake.py's, imported only when chosen, since it needs Mooncake's
transfer engine and its system libraries (a RuntimeError at start-up says what to install).
"""

from __future__ import annotations

from workbench.core.disaggregation.transfer import KVReceiver, KVSender


def make_sender(server_args) -> KVSender:
    """The prefill side's sender on the bootstrap port, for server_args' transfer backend."""
    host, port = server_args.host, server_args.disaggregation_bootstrap_port
    hold = server_args.disaggregation_transfer_timeout
    if server_args.disaggregation_transfer_backend == "mooncake":
        from workbench.core.disaggregation.mooncake import MooncakeKVSender

        return MooncakeKVSender(host, port, hold_timeout_s=hold)
    return KVSender(host, port, hold_timeout_s=hold)


def make_receiver(server_args) -> KVReceiver:
    """The decode side's receiver, for server_args' transfer backend."""
    timeout = server_args.disaggregation_transfer_timeout
    if server_args.disaggregation_transfer_backend == "mooncake":
        from workbench.core.disaggregation.mooncake import MooncakeKVReceiver, local_hostname

        return MooncakeKVReceiver(timeout_s=timeout, hostname=local_hostname(server_args.host))
    return KVReceiver(timeout_s=timeout)
