"""The weight-update group's limits without an engine (tests/e2e/test_weight_sync_serving.py has the server).

- the group's host (rank 0) listens on the address it is given, not on every interface, and a plain
  torch TCPStore client still meets it;
- an address that is not this machine's is refused with a message saying so;
- `timeout_s` is bounded (0 < timeout_s <= 300).
"""

from __future__ import annotations

import datetime
import threading

import pytest
from workbench.core.distributed.custom_group import _host_store
from workbench.core.entrypoints.server_process import free_port
from workbench.core.managers.weight_updater import MAX_GROUP_TIMEOUT_S, WeightUpdateError, check_group_timeout


def listeners(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* write them) listening on `port`."""
    out = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            for line in f.read().splitlines()[1:]:
                addr, state = line.split()[1], line.split()[3]
                if state == "0A" and int(addr.rsplit(":", 1)[1], 16) == port:
                    out.append(addr.rsplit(":", 1)[0])
    return out


def test_the_host_store_listens_on_the_given_address_and_a_torch_client_meets_it():
    import torch.distributed as dist

    port = free_port()
    timeout = datetime.timedelta(seconds=30)
    box: dict = {}
    host = threading.Thread(target=lambda: box.update(store=_host_store(f"tcp://127.0.0.1:{port}", 2, timeout)))
    host.start()
    try:
        deadline = datetime.datetime.now() + timeout
        while not listeners(port) and datetime.datetime.now() < deadline:
            threading.Event().wait(0.05)
        assert listeners(port) == ["0100007F"]  # 127.0.0.1; torch's own server listens on "::" (every interface)
        client = dist.TCPStore("127.0.0.1", port, 2, False, timeout)
        host.join(30)
        box["store"].set("k", "v")
        assert client.get("k") == b"v"
    finally:
        host.join(30)


def test_an_address_of_another_machine_is_refused():
    with pytest.raises(ValueError, match=r"cannot listen on 192\.0\.2\.1:\d+.*address must be one of this machine's"):
        _host_store(f"tcp://192.0.2.1:{free_port()}", 2, datetime.timedelta(seconds=5))


@pytest.mark.parametrize("bad", [0, -1, MAX_GROUP_TIMEOUT_S + 0.5, 600, float("nan"), "soon", None])
def test_timeout_s_is_bounded(bad):
    with pytest.raises(WeightUpdateError, match="timeout_s must be more than 0 and at most 300 s"):
        check_group_timeout(bad)


def test_timeouts_within_the_bound_pass():
    assert check_group_timeout(MAX_GROUP_TIMEOUT_S) == MAX_GROUP_TIMEOUT_S
    assert check_group_timeout("12") == 12.0
