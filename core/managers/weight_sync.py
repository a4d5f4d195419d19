"""Joining a trainer's weight-update group beside the scheduler's loop, so serving goes on meanwhile.

`init_weights_update_group` waits for the trainer: torch's rendezvous and the group's own handshake
block until every rank has come, up to `timeout_s`. Run on the scheduler's loop, that wait stopped
every request (a trainer that never came held a 2-token completion for the whole timeout). Here the
scheduler only checks the request and starts the join on a thread; its loop keeps stepping and polls
the join once per iteration (`poll_join`), and the answer (an `InitWeightsUpdateGroupReqOutput`, its
own type because it comes after answers to messages sent later) goes out when the group has formed
or failed. The weights themselves are not touched by a join; `update_weights_from_distributed`, which
writes them, still runs between two steps with new requests held (weight_updater.py).

One join at a time: an init that arrives while one runs waits in a queue and starts when it ends, so
init answers leave in the order the requests came. Under tensor parallelism every rank starts its own
join for the same message at the same iteration; the ranks then agree each iteration (a one-byte
all-gather, only while a join runs) on whether all have finished, and answer together, a failure on
any rank failing the call on all (a rank that did join leaves the half-formed group again).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field

import torch
from workbench.core.distributed.parallel_state import all_gather_bytes
from workbench.core.io_struct import InitWeightsUpdateGroupReq, InitWeightsUpdateGroupReqOutput
from workbench.core.managers import weight_updater as wu

logger = logging.getLogger(__name__)

__all__ = ["Join", "start_join", "poll_join", "joining"]


@dataclass
class Join:
    """One running join: its thread fills `group` (joined) or `error` (why not) and ends."""

    msg: InitWeightsUpdateGroupReq
    rank: int
    thread: threading.Thread | None = None
    group: wu.WeightsUpdateGroup | None = None
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)


_current: Join | None = None
_queued: deque[InitWeightsUpdateGroupReq] = deque()


def joining() -> bool:
    """A join is running (the scheduler then calls `poll_join` every iteration)."""
    return _current is not None


def start_join(runner, msg: InitWeightsUpdateGroupReq) -> list[InitWeightsUpdateGroupReqOutput]:
    """Check `msg` and start joining on a thread; returns the answers to send now (a refusal), else [].

    Returns at once whatever the trainer does. While another join runs, `msg` waits its turn.
    """
    global _current
    if _current is not None:
        _queued.append(msg)
        return []
    try:
        rank, timeout_s, device = wu.check_join(
            runner, msg.rank_offset, msg.world_size, msg.group_name, msg.backend, msg.timeout_s
        )
        refusal = None
    except Exception as exc:  # noqa: BLE001 - answered to the caller
        refusal = InitWeightsUpdateGroupReqOutput(success=False, message=wu._describe(exc))
    if getattr(runner, "tp_size", 1) > 1:
        # The checks are the same on every rank; agreeing anyway means no rank joins while another refused.
        reply = _agree(refusal or InitWeightsUpdateGroupReqOutput(success=True))
        refusal = reply if not reply.success else None
    if refusal is not None:
        return [refusal]
    join = Join(msg=msg, rank=rank)
    join.thread = threading.Thread(
        target=_run, args=(join, timeout_s, device), name=f"weight-sync-join:{msg.group_name}", daemon=True
    )
    wu._JOINING.add(msg.group_name)
    _current = join
    join.thread.start()
    logger.info(
        "weight sync: joining group %r at %s:%d as rank %d of %d (up to %g s); serving goes on",
        msg.group_name,
        msg.master_address,
        msg.master_port,
        rank,
        msg.world_size,
        timeout_s,
    )
    return []


def _run(join: Join, timeout_s: float, device: torch.device) -> None:
    m = join.msg
    try:
        join.group = wu.make_group(
            m.master_address, m.master_port, join.rank, m.world_size, m.group_name, m.backend, timeout_s, device
        )
    except Exception as exc:  # noqa: BLE001 - answered to the caller by poll_join
        if not isinstance(exc, ValueError):
            logger.exception("weight sync: joining group %r failed", m.group_name)
        join.error = wu._describe(exc)
    finally:
        join.done.set()


def poll_join(runner) -> list[InitWeightsUpdateGroupReqOutput]:
    """Called by the scheduler every iteration while `joining()`: the answers to send now.

    [] while the join runs (on any TP rank); its answer when it has ended, followed by the answers
    of queued inits refused at once.
    """
    global _current
    join = _current
    if join is None:
        return []
    finished = join.done.is_set()
    tp = getattr(runner, "tp_size", 1) > 1
    if tp:
        finished = all(flag == b"1" for flag in all_gather_bytes(b"1" if finished else b"0"))
    if not finished:
        return []
    _current = None
    m = join.msg
    wu._JOINING.discard(m.group_name)
    if join.group is not None:
        reply = InitWeightsUpdateGroupReqOutput(
            success=True, message=wu.joined_message(m.group_name, join.rank, m.world_size, m.backend)
        )
    else:
        reply = InitWeightsUpdateGroupReqOutput(success=False, message=join.error or "the join ended without a group")
    if tp:
        reply = _agree(reply)
    if reply.success and join.group is not None:
        wu._GROUPS[m.group_name] = join.group
    elif join.group is not None:  # joined here, failed on another rank: the group cannot work
        wu._shutdown(join.group)
    logger.info("weight sync: %s", reply.message)
    replies = [reply]
    while _queued and _current is None:
        replies += start_join(runner, _queued.popleft())
    return replies


def _agree(reply: InitWeightsUpdateGroupReqOutput) -> InitWeightsUpdateGroupReqOutput:
    """One outcome for all TP ranks (a failure anywhere fails it everywhere); a collective."""
    agreed, _ = wu._agree_across_ranks(reply, None)
    assert isinstance(agreed, InitWeightsUpdateGroupReqOutput)  # it keeps the reply's type
    return agreed
