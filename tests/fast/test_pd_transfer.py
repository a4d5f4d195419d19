"""The PD KV transport (core/disaggregation/transfer.py) over real sockets: round trips, and every fault.

Where a process dying is the point, the sender runs in a subprocess of its own.
"""

from __future__ import annotations

import random
import re
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from workbench.core.disaggregation.transfer import (
    MAGIC,
    KVLayout,
    KVReceiver,
    KVSender,
    RoomInUseError,
    TransferMeta,
    _read_frame,
    _Reply,
    _Request,
    _write_frame,
)

HOST = "127.0.0.1"


def make_kv(layers=2, tokens=5, heads=2, dim=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(tokens, heads, dim, generator=g).to(dtype) for _ in range(layers)]
    v = [torch.randn(tokens, heads, dim, generator=g).to(dtype) for _ in range(layers)]
    return k, v


def wait_statuses(side, n, timeout=10.0):
    """Poll until n statuses came (a transfer finishes on its own threads)."""
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += side.poll()
        time.sleep(0.01)
    assert len(got) == n, f"expected {n} statuses within {timeout} s, got {got}"
    return got


def bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture
def sender():
    s = KVSender(HOST, 0, hold_timeout_s=5.0)
    yield s
    s.close()


@pytest.fixture
def receiver():
    r = KVReceiver(timeout_s=5.0, connect_timeout_s=1.0)
    yield r
    r.close()


def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact(sender, receiver, dtype):
    k, v = make_kv(layers=3, tokens=7, dtype=dtype)
    layout = KVLayout.of(k, v)
    sender.put(42, TransferMeta("rid-1", first_token=17, first_logprob=-0.25), k, v)
    receiver.submit(42, HOST, sender.port, layout)
    (st,) = wait_statuses(receiver, 1)
    assert st.ok, st.error
    assert st.meta == TransferMeta("rid-1", 17, -0.25)
    assert st.nbytes == layout.nbytes == 2 * 3 * 7 * 2 * 4 * dtype.itemsize
    assert all(bits_equal(a, b) for a, b in zip(st.k + st.v, k + v))
    (sent,) = wait_statuses(sender, 1)
    assert sent.ok and sent.room == 42 and sent.nbytes == layout.nbytes
    assert sender.pending() == 0 and receiver.in_flight() == 0


def test_wire_is_a_header_then_k_v_per_layer_then_an_ack(sender):
    """The protocol as the module docstring tells it, spoken by hand."""
    k, v = make_kv(layers=2, tokens=3, dtype=torch.bfloat16)
    layout = KVLayout.of(k, v)
    sender.put(12, TransferMeta("wire", 5, -1.5), k, v)
    with socket.create_connection((HOST, sender.port)) as raw:
        _write_frame(raw, _Request(MAGIC, 12, layout))
        reply = _read_frame(raw, _Reply)
        assert reply.ok and reply.nbytes == layout.nbytes and reply.meta == TransferMeta("wire", 5, -1.5)
        body = bytearray()
        while len(body) < layout.nbytes:
            body += raw.recv(layout.nbytes - len(body))
        expected = b"".join(t.view(torch.uint8).numpy().tobytes() for t in (k[0], v[0], k[1], v[1]))
        assert bytes(body) == expected
        time.sleep(0.2)
        assert sender.poll() == [] and sender.pending() == 1  # not sent until the decode side acks
        _write_frame(raw, _Reply(ok=True))
        (st,) = wait_statuses(sender, 1)
    assert st.ok and st.nbytes == layout.nbytes and sender.pending() == 0


def test_room_put_after_the_receiver_asked_is_waited_for(sender, receiver):
    k, v = make_kv()
    receiver.submit(7, HOST, sender.port, KVLayout.of(k, v))
    time.sleep(0.3)
    assert receiver.poll() == [] and receiver.in_flight() == 1
    sender.put(7, TransferMeta("late", 3), k, v)
    (st,) = wait_statuses(receiver, 1)
    assert st.ok and st.meta.first_token == 3 and st.wait_ms >= 250
    assert bits_equal(st.k[1], k[1])


def test_fail_reaches_the_receiver(sender, receiver):
    k, v = make_kv()
    sender.fail(9, "request rid-9 was aborted by the client")
    receiver.submit(9, HOST, sender.port, KVLayout.of(k, v))
    (st,) = wait_statuses(receiver, 1)
    assert not st.ok and st.error == "request rid-9 was aborted by the client" and st.k is None
    (sent,) = wait_statuses(sender, 1)
    assert not sent.ok and sender.pending() == 0


def test_layout_mismatch_names_both_layouts(sender, receiver):
    k, v = make_kv(tokens=5)
    sender.put(1, TransferMeta("r", 0), k, v)
    receiver.submit(1, HOST, sender.port, KVLayout(6, 2, 2, 4, "torch.float32"))
    (st,) = wait_statuses(receiver, 1)
    assert not st.ok and "layout mismatch" in st.error
    assert "num_tokens=6" in st.error and "num_tokens=5" in st.error
    (sent,) = wait_statuses(sender, 1)
    assert not sent.ok and sender.pending() == 0


def test_unreachable_port_says_what_to_run(receiver):
    port = free_port()
    receiver.submit(1, HOST, port, KVLayout(1, 1, 1, 1, "torch.float32"))
    (st,) = wait_statuses(receiver, 1)
    assert not st.ok
    assert f"could not reach the prefill server's bootstrap port at {HOST}:{port} (connection refused)" in st.error
    assert f"--disaggregation-bootstrap-port {port}" in st.error


def test_reused_room_is_refused_on_both_sides(sender, receiver):
    k, v = make_kv()
    layout = KVLayout.of(k, v)
    sender.put(5, TransferMeta("a", 1), k, v)
    with pytest.raises(RoomInUseError, match="bootstrap room 5 is already held"):
        sender.put(5, TransferMeta("b", 1), k, v)
    receiver.submit(6, HOST, sender.port, layout)  # nothing put yet: stays in flight
    with pytest.raises(RoomInUseError, match="bootstrap room 6 is already being received"):
        receiver.submit(6, HOST, sender.port, layout)
    # a second decode server asking for a room another connection is waiting on is refused by the sender
    other = KVReceiver(timeout_s=5.0)
    time.sleep(0.2)
    other.submit(6, HOST, sender.port, layout)
    (st,) = wait_statuses(other, 1)
    assert not st.ok and "already being pulled by another decode connection" in st.error
    sender.put(6, TransferMeta("c", 2), k, v)
    assert {s.room for s in wait_statuses(receiver, 1)} == {6}
    receiver.submit(5, HOST, sender.port, layout)
    assert wait_statuses(receiver, 1)[0].ok
    sender.put(5, TransferMeta("reused after it was sent", 1), k, v)  # a finished room may be used again
    assert sender.pending() == 1


def test_receiver_times_out_when_nothing_is_put(sender):
    receiver = KVReceiver(timeout_s=0.4)
    receiver.submit(11, HOST, sender.port, KVLayout(1, 1, 1, 1, "torch.float32"))
    (st,) = wait_statuses(receiver, 1)
    assert not st.ok and st.error.startswith(f"no KV for bootstrap room 11 from {HOST}:{sender.port} within 0.4 s")
    assert receiver.in_flight() == 0
    time.sleep(0.3)  # the sender notices the receiver left and stops waiting for the room
    k, v = make_kv()
    sender.put(11, TransferMeta("after", 0), k, v)  # later, another decode server can still pull it
    receiver.submit(11, HOST, sender.port, KVLayout.of(k, v))
    assert wait_statuses(receiver, 1)[0].ok


def test_cancel_reports_nothing_and_frees_the_sender(sender, receiver):
    k, v = make_kv()
    receiver.submit(3, HOST, sender.port, KVLayout.of(k, v))
    time.sleep(0.1)
    receiver.cancel(3)
    assert receiver.in_flight() == 0
    time.sleep(0.3)
    assert receiver.poll() == []
    receiver.submit(3, HOST, sender.port, KVLayout.of(k, v))  # the sender no longer thinks room 3 is asked for
    sender.put(3, TransferMeta("r", 0), k, v)
    assert wait_statuses(receiver, 1)[0].ok


def test_unclaimed_room_expires_on_the_sender():
    sender = KVSender(HOST, 0, hold_timeout_s=0.3)
    try:
        k, v = make_kv()
        sender.put(8, TransferMeta("orphan", 0), k, v)
        assert sender.pending() == 1
        (st,) = wait_statuses(sender, 1, timeout=3)
        assert not st.ok and st.room == 8 and "not claimed by any decode server within 0.3 s" in st.error
        assert sender.pending() == 0
    finally:
        sender.close()


def test_receiver_disconnecting_mid_transfer(sender, receiver):
    """A decode side that reads part of the KV and hangs up: the sender drops the room and keeps serving."""
    k, v = make_kv(layers=4, tokens=4096, heads=4, dim=64)  # 16 MB: more than the socket buffers hold
    layout = KVLayout.of(k, v)
    sender.put(21, TransferMeta("big", 0), k, v)
    with socket.create_connection((HOST, sender.port)) as raw:
        _write_frame(raw, _Request(MAGIC, 21, layout))
        assert _read_frame(raw, _Reply).ok
        raw.recv(65536)
    (st,) = wait_statuses(sender, 1)
    assert not st.ok and re.search(r"went away after \d+ of \d+ KV bytes of bootstrap room 21", st.error)
    assert st.nbytes < layout.nbytes and sender.pending() == 0
    small_k, small_v = make_kv(seed=1)
    sender.put(22, TransferMeta("next", 0), small_k, small_v)
    receiver.submit(22, HOST, sender.port, KVLayout.of(small_k, small_v))
    assert wait_statuses(receiver, 1)[0].ok


SENDER_THAT_DIES = textwrap.dedent(
    """
    import os, signal, socket, sys, torch
    from workbench.core.disaggregation.transfer import KVSender, TransferMeta
    # the process SIGKILLs itself once 3 MB of KV are on the wire: a prefill server dying mid-transfer, at a
    # moment the test can count on
    real_sendall, sent = socket.socket.sendall, [0]
    def sendall(self, data):
        data = memoryview(data).cast("B")
        if sent[0] + len(data) > 3_000_000:
            real_sendall(self, data[: 3_000_000 - sent[0]])
            os.kill(os.getpid(), signal.SIGKILL)
        sent[0] += len(data)
        return real_sendall(self, data)
    socket.socket.sendall = sendall
    s = KVSender("127.0.0.1", 0)
    k = [torch.ones(1024, 4, 64) for _ in range(4)]
    s.put(31, TransferMeta("doomed", 0), k, [t.clone() for t in k])
    print(s.port, flush=True)
    sys.stdin.read()
    """
)


def test_sender_killed_mid_transfer_names_bytes_received():
    proc = subprocess.Popen([sys.executable, "-c", SENDER_THAT_DIES], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        port = int(proc.stdout.readline())
        receiver = KVReceiver(timeout_s=10.0)
        layout = KVLayout(1024, 4, 4, 64, "torch.float32")
        receiver.submit(31, HOST, port, layout)
        (st,) = wait_statuses(receiver, 1)
        assert proc.wait(timeout=10) == -9
        assert not st.ok
        m = re.search(r"closed the connection after (\d+) of (\d+) KV bytes of bootstrap room 31", st.error)
        assert m, st.error
        assert 0 < int(m[1]) < int(m[2]) == layout.nbytes and st.nbytes == int(m[1])
    finally:
        proc.kill()
        proc.wait()


def test_many_rooms_concurrently(sender):
    """50 rooms, two decode servers, puts before and after the asks, in shuffled order: every byte lands."""
    rng = random.Random(0)
    rooms = [rng.getrandbits(64) for _ in range(50)]
    kvs = {room: make_kv(layers=2, tokens=3 + i % 5, seed=i) for i, room in enumerate(rooms)}
    receivers = [KVReceiver(timeout_s=10.0), KVReceiver(timeout_s=10.0)]
    early = rooms[:25]
    for room in early:
        sender.put(room, TransferMeta(f"r{room}", room % 1000), *kvs[room])
    for i, room in enumerate(rng.sample(rooms, len(rooms))):
        receivers[i % 2].submit(room, HOST, sender.port, KVLayout.of(*kvs[room]))
    for room in rng.sample(rooms[25:], 25):
        sender.put(room, TransferMeta(f"r{room}", room % 1000), *kvs[room])
    got = wait_statuses(receivers[0], 25) + wait_statuses(receivers[1], 25)
    assert sorted(st.room for st in got) == sorted(rooms)
    for st in got:
        assert st.ok, st.error
        assert st.meta.first_token == st.room % 1000
        k, v = kvs[st.room]
        assert all(bits_equal(a, b) for a, b in zip(st.k + st.v, k + v))
    assert len(wait_statuses(sender, 50)) == 50 and sender.pending() == 0
    assert all(r.in_flight() == 0 for r in receivers)


def test_large_transfer_reports_bytes_and_ms(sender, receiver):
    k, v = make_kv(layers=4, tokens=1600, heads=8, dim=128)  # 52 MB of fp32 KV
    layout = KVLayout.of(k, v)
    sender.put(99, TransferMeta("large", 1), k, v)
    receiver.submit(99, HOST, sender.port, layout)
    (st,) = wait_statuses(receiver, 1, timeout=20)
    assert st.ok and st.nbytes == 2 * 4 * 1600 * 8 * 128 * 4 and st.ms > 0
    assert torch.equal(st.k[3], k[3]) and torch.equal(st.v[0], v[0])
    (sent,) = wait_statuses(sender, 1)
    assert sent.ok and sent.nbytes == st.nbytes and sent.ms > 0
