"""Starting the scheduler ranks of a tensor-parallel group, on one node or several.

Ranks are numbered across nodes: node `k` of `nnodes` runs TP ranks
`k * tp_size / nnodes ...` (SGLang's layout). Node 0 also runs the front end
(Engine: tokenizer, detokenizer, HTTP); a node with `node_rank > 0` runs only its
scheduler ranks (`run_worker_node`, which `workbench serve --node-rank N` calls).
All ranks meet at `--dist-init-addr` (rank 0 hosts the torch.distributed store there);
on one node without that flag a free loopback port is used.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import sys
import time
from multiprocessing.connection import wait as mp_wait

from workbench.core.distributed.topology import split_addr, tp_ranks_on_node, validate_tp_for_model  # noqa: F401
from workbench.core.model_executor.cpu_threads import omp_wait_env
from workbench.core.trace.events import decode_batch

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600


def free_loopback_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def with_dist_init_addr(server_args):
    """`server_args` with a concrete --dist-init-addr (a free loopback port on a single node)."""
    if server_args.tp_size == 1 or server_args.dist_init_addr:
        return server_args
    return dataclasses.replace(server_args, dist_init_addr=free_loopback_addr())


def scheduler_role(tp_rank: int) -> str:
    """The process role name: rank 0 is "scheduler" (the one that talks to the front end)."""
    return "scheduler" if tp_rank == 0 else f"scheduler-tp{tp_rank}"


def spawn_scheduler_ranks(
    ctx, server_args, port_args, tp_ranks, procs: dict, readers: dict, scheduler_factory=None
) -> None:
    """Start one `run_scheduler_process` per rank in `tp_ranks`; fills `procs` and `readers` by role.

    `server_args` must carry the model directory and (for tp_size > 1) the dist init address.
    `scheduler_factory` (scheduler_contract.SchedulerFactory) makes each one's parts; None: the real ones.
    """
    from workbench.core.managers.scheduler import run_scheduler_process

    for tp_rank in tp_ranks:
        role = scheduler_role(tp_rank)
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=run_scheduler_process,
            name=f"workbench-{role}",
            daemon=True,
            args=(server_args, port_args, writer),
            kwargs=dict(
                tp_rank=tp_rank, tp_size=server_args.tp_size, proc_name=role, scheduler_factory=scheduler_factory
            ),
        )
        proc.start()
        writer.close()
        procs[role] = proc
        readers[role] = reader


# A child exits with this code when it finds itself re-running the user's script while it starts
# (an Engine created at a script's top level, without the `if __name__ == "__main__":` guard).
MAIN_GUARD_EXIT = 86
MAIN_GUARD_HINT = (
    "Engine() ran again inside one of its own child processes: multiprocessing starts each child by "
    're-running your script, so create the Engine under `if __name__ == "__main__":` '
    "(see docs/engine_api.md)"
)


class MainGuardError(RuntimeError):
    """The script that created the Engine lacks the `if __name__ == "__main__":` guard."""


def _exited(role: str, proc) -> RuntimeError:
    if proc.exitcode == MAIN_GUARD_EXIT:
        return MainGuardError(MAIN_GUARD_HINT)
    return RuntimeError(f"the {role} process exited during start-up (exit code {proc.exitcode})")


def wait_ranks_ready(
    procs: dict, readers: dict, timeout_s: float = START_TIMEOUT_S, timeout_hint: str = "", on_phase=None
) -> dict:
    """Wait for every child's ready message (`readers`: role -> pipe); returns role -> message and
    raises RuntimeError naming the child that failed, exited or timed out. A child's start-up
    phase reports on the way ({"status": "phase", "event": msgpack batch}) go to `on_phase`."""
    infos = {}
    deadline = time.monotonic() + timeout_s
    pending = dict(readers)
    while pending:
        ready = mp_wait(
            list(pending.values()) + [procs[r].sentinel for r in pending], timeout=max(0.0, deadline - time.monotonic())
        )
        if not ready:
            raise RuntimeError(f"start timed out waiting for {', '.join(pending)}{timeout_hint}")
        for role, reader in list(pending.items()):
            if reader in ready:
                try:
                    msg = reader.recv()
                except EOFError:
                    procs[role].join(5)  # its exit code says why
                    raise _exited(role, procs[role]) from None
                if msg.get("status") == "phase":
                    if on_phase is not None:
                        for event in decode_batch(msg["event"]):
                            on_phase(event)
                    continue
                if msg.get("status") != "ready":
                    err = RuntimeError(f"the {role} process failed to start: {msg.get('error')}")
                    err.child_traceback = msg.get("traceback", "")  # type: ignore[attr-defined]  # for the log
                    raise err
                infos[role] = msg
                del pending[role]
            elif procs[role].sentinel in ready and not procs[role].is_alive():
                raise _exited(role, procs[role])
    return infos


def stop_processes(procs: dict) -> None:
    for proc in procs.values():
        if proc.is_alive():
            proc.terminate()
    for proc in procs.values():
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2)


def run_worker_node(server_args, on_ready=None) -> int:
    """Run this node's scheduler ranks (node_rank > 0) until one exits or SIGTERM/SIGINT arrives.

    Nothing here serves HTTP or tokenizes: node 0's rank 0 receives the requests and
    broadcasts them to every rank. Returns the exit code (0 after a signal).
    """
    import multiprocessing as mp

    from workbench.core.ipc import PortArgs
    from workbench.core.model_loader import prepare_model

    sa = server_args
    if sa.node_rank == 0:
        raise ValueError("node 0 runs the front end: start it with `workbench serve` (or Engine) instead")
    if not sa.dist_init_addr:
        raise ValueError("--dist-init-addr HOST:PORT (node 0's address) is required with --nnodes > 1")
    prepared = prepare_model(  # a Hub id is downloaded on each node, once; its ranks get the directory
        sa.model_path,
        progress=sa.show_progress,
        revision=sa.revision,
        download_dir=sa.download_dir,
        gguf_file=sa.gguf_file,
    )
    child_args = dataclasses.replace(sa, model_path=str(prepared.model_dir))
    port_args = PortArgs.create()  # only for the process plumbing; ranks > 0 open no sockets
    ranks = tp_ranks_on_node(sa.tp_size, sa.nnodes, sa.node_rank)
    procs: dict = {}
    readers: dict = {}
    stop = {"signal": 0}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with omp_wait_env(sa.device):  # the ranks' OpenMP threads sleep soon when idle
            spawn_scheduler_ranks(mp.get_context("spawn"), child_args, port_args, ranks, procs, readers)
        wait_ranks_ready(
            procs, readers, timeout_hint=" (are all nodes started with the same --dist-init-addr and --nnodes?)"
        )
        print(
            f"node {sa.node_rank}/{sa.nnodes}: TP ranks {list(ranks)} of {sa.tp_size} ready "
            f"(front end on node 0, {sa.dist_init_addr})",
            flush=True,
        )
        if on_ready is not None:
            on_ready()
        sentinels = {p.sentinel: role for role, p in procs.items()}
        while not stop["signal"]:
            done = mp_wait(list(sentinels), timeout=0.5)
            if done:
                role = sentinels[done[0]]
                code = procs[role].exitcode
                print(
                    f"node {sa.node_rank}: {role} exited (code {code}); stopping this node", file=sys.stderr, flush=True
                )
                return 1
        return 0
    except RuntimeError as exc:
        print(f"node {sa.node_rank}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        stop_processes(procs)
        port_args.cleanup()
        for s, h in old.items():
            signal.signal(s, h)


def worker_node_main(argv: list[str] | None = None) -> int:
    """`python -m workbench.core.distributed.launch --nnodes 2 --node-rank 1 ...`."""
    import argparse

    from workbench.core.args import ServerArgs

    parser = argparse.ArgumentParser(description="run the scheduler ranks of a node > 0")
    ServerArgs.add_cli_args(parser)
    sa = ServerArgs.from_cli_args(parser.parse_args(argv))
    logging.basicConfig(level=getattr(logging, sa.log_level.upper(), logging.WARNING))
    return run_worker_node(sa)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(worker_node_main())
