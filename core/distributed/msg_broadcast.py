"""Rank 0's received messages, on every TP rank.

Only TP rank 0 reads the tokenizer's socket; each scheduler iteration it broadcasts the
list it read so that every rank processes the same messages in the same order and so
runs the same schedule. The list travels as msgpack (the io_struct message types, tagged),
never pickle.
"""

from __future__ import annotations

import msgspec
from workbench.core.distributed.parallel_state import broadcast_bytes, get_tp_size
from workbench.core.io_struct import AnyMsg, Msg

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[AnyMsg])


def broadcast_msgs(msgs: list[Msg] | None) -> list[Msg]:
    """TP rank 0 passes what it received (possibly []), the other ranks None; all get rank 0's list."""
    if get_tp_size() == 1:
        return list(msgs or [])
    data = broadcast_bytes(_encoder.encode(msgs) if msgs else None)
    if msgs is not None:
        return msgs
    return _decoder.decode(data) if data else []
