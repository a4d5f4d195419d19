"""A process group outside torch.distributed's default one, built the standard way.

Trainers that drive inference engines (OpenRLHF, SGLang's own tests, veRL) create the
weight-sync group with one recipe, and an engine only meets them if it follows the same
recipe byte for byte, because every step names keys in a shared TCPStore:

1. `torch.distributed.rendezvous("tcp://host:port", rank, world_size)`: rank 0 hosts the
   TCPStore and *waits until all `world_size` ranks have connected* (the other ranks
   register as workers; a client that does not register leaves the master waiting);
2. `PrefixStore(group_name, store)`: the group name, with no separator, prefixes every key;
3. torch's `_new_process_group_helper(world_size, rank, [], backend, store, group_name=...)`,
   which adds its own `"{group_name}/"` and `"{device}/"` prefixes and registers the group
   with torch, so `dist.broadcast(t, src=0, group=pg)` works on it;
4. an identity rank map in `_world.pg_group_ranks`, since the group is nobody's subgroup.

`init_custom_process_group` does exactly that, with two differences in where sockets listen (the keys,
and so the other ranks, are the same either way):

- on the host (rank 0), torch's TCPStore server listens on every interface (`*:port`) whatever host it is
  given, so rank 0 binds the listening socket to the given host itself and hands it over (`master_listen_fd`);
- a gloo group's own sockets (one per peer) listen on the address the machine's host name resolves to, which
  may be a network interface although the trainer is on loopback; here they listen on the local address
  that reaches the master (127.0.0.1 for a master on loopback). torch offers no option for that, so the
  gloo backend is registered once more under `BOUND_GLOO` with that device (same store keys, same
  protocol). `GLOO_SOCKET_IFNAME`, when set, is obeyed instead. nccl picks its own interface
  (`NCCL_SOCKET_IFNAME`).

It is the engine's side (every TP rank joins with `rank_offset + tp_rank`) and, through
`TrainerWeightSync`, the project's trainer side.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
from typing import Any
from urllib.parse import urlparse

__all__ = ["init_custom_process_group", "destroy_custom_process_group", "BOUND_GLOO"]

BOUND_GLOO = "workbench_gloo"  # gloo with its device bound to one address (the module docstring)
_bind = threading.local()  # the address BOUND_GLOO's creator binds to, set by the joining thread
_register_lock = threading.Lock()


def init_custom_process_group(
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: datetime.timedelta | None = None,
) -> Any:
    """Join (rank > 0) or host (rank 0) the group `group_name`; returns the ProcessGroup.

    Blocks until all `world_size` ranks have joined; raises torch's error (DistStoreError,
    DistNetworkError, RuntimeError) after `timeout` otherwise. Callers turn that into a
    message saying what to check.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

    timeout = timeout or datetime.timedelta(minutes=10)
    if rank == 0:
        store = _host_store(init_method, world_size, timeout)
    else:
        store, rank, world_size = next(dist.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    if backend == "gloo" and not os.environ.get("GLOO_SOCKET_IFNAME"):
        backend = _bound_gloo()
        _bind.address = _local_address_towards(init_method)
    try:
        pg, _ = _new_process_group_helper(
            world_size, rank, [], dist.Backend(backend), store, group_name=group_name, timeout=timeout
        )
    finally:
        _bind.address = None
    # The new group's ranks are its own (0..world_size-1), not a slice of the default group's.
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _host_store(init_method: str, world_size: int, timeout: datetime.timedelta) -> Any:
    """Rank 0's TCPStore as `dist.rendezvous` makes it, listening on the URL's host only.

    Waits for all `world_size` ranks to connect (as the rendezvous does); raises ValueError when
    the host is not an address of this machine or the port is taken.
    """
    import torch.distributed as dist

    url = urlparse(init_method)
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        raise ValueError(f"init_method must be tcp://HOST:PORT, not {init_method!r}")
    host, port = url.hostname, url.port
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ValueError(f"cannot resolve {host!r} to listen on: {exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own server does
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise ValueError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}): rank 0 hosts the group's store, so the "
            "address must be one of this machine's and the port free"
        ) from exc
    fd = sock.detach()  # the store owns it from here and closes it, whether it starts or times out
    return dist.TCPStore(
        host, port, world_size, True, timeout, wait_for_workers=True, multi_tenant=False, master_listen_fd=fd
    )


def _local_address_towards(init_method: str) -> str:
    """This machine's address on the route to the master (127.0.0.1 for a master on loopback)."""
    url = urlparse(init_method)
    family, _, _, _, addr = socket.getaddrinfo(url.hostname, url.port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(addr)  # UDP: picks the route, sends nothing
        return probe.getsockname()[0]


def _bound_gloo() -> str:
    """Register BOUND_GLOO with torch (once per process); returns its name."""
    import torch.distributed as dist

    with _register_lock:
        if BOUND_GLOO not in dist.Backend.backend_list:
            dist.Backend.register_backend(BOUND_GLOO, _create_bound_gloo, devices=["cpu"])
    return BOUND_GLOO


def _create_bound_gloo(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    """torch's gloo backend with one device listening on the joining thread's `_bind.address`."""
    from torch.distributed import ProcessGroupGloo

    address = getattr(_bind, "address", None)
    if not address:
        raise RuntimeError(f"{BOUND_GLOO} is created by init_custom_process_group only")
    options = ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_device(hostname=address)]
    backend = ProcessGroupGloo(store, rank, size, options)
    backend._set_sequence_number_for_group()  # as torch does for its own gloo (a key in the store)
    return backend


def destroy_custom_process_group(pg: Any) -> None:
    """Leave a group made by `init_custom_process_group`; its name can then be used again."""
    import torch.distributed as dist

    dist.destroy_process_group(pg)
