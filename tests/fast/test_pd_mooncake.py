"""The Mooncake KV transport (core/disaggregation/mooncake.py) over Mooncake's real transfer engine (TCP, loopback):
round trips, the per-layer protocol and the faults the TCP backend has (the PD scheduler pair over it is
test_pd_scheduler.py's first test, parametrized by backend).

Needs `pip install mooncake-transfer-engine-non-cuda` and its system libraries (libibverbs1, libnl-3-200,
libnl-route-3-200: installed, or unpacked and on LD_LIBRARY_PATH); skipped otherwise. The first test checks the
start-up error that says so, and runs everywhere.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from workbench.core.args import ServerArgs
from workbench.core.disaggregation import mooncake as mc
from workbench.core.disaggregation.backends import make_receiver, make_sender
from workbench.core.disaggregation.transfer import (
    KVLayout,
    KVReceiver,
    KVSender,
    RoomInUseError,
    TransferMeta,
    _read_frame,
    _Reply,
)
from workbench.core.entrypoints.server_process import free_port

HOST = "127.0.0.1"

try:
    from mooncake.engine import TransferEngine  # noqa: F401

    MOONCAKE_ERROR = None
except (ImportError, OSError) as exc:
    MOONCAKE_ERROR = f"mooncake.engine does not import ({exc}): {mc.INSTALL_HINT}"

needs_mooncake = pytest.mark.skipif(MOONCAKE_ERROR is not None, reason=MOONCAKE_ERROR or "")
pytestmark = pytest.mark.timeout(60)


def make_kv(layers=2, tokens=5, heads=2, dim=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(tokens, heads, dim, generator=g).to(dtype) for _ in range(layers)]
    v = [torch.randn(tokens, heads, dim, generator=g).to(dtype) for _ in range(layers)]
    return k, v


def wait_statuses(side, n, timeout=10.0):
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
    s = mc.MooncakeKVSender(HOST, 0, hold_timeout_s=5.0)
    yield s
    s.close()


@pytest.fixture
def receiver():
    r = mc.MooncakeKVReceiver(timeout_s=5.0, connect_timeout_s=1.0)
    yield r
    r.close()


def test_a_missing_engine_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # as when the wheel is not installed
    with pytest.raises(RuntimeError) as info:
        mc.load_transfer_engine()
    msg = str(info.value)
    assert "pip install mooncake-transfer-engine-non-cuda" in msg
    assert "apt install libibverbs1 libnl-3-200 libnl-route-3-200" in msg and "tcp (built in)" in msg
    args = ServerArgs(disaggregation_transfer_backend="mooncake", disaggregation_mode="decode")
    with pytest.raises(RuntimeError, match="pip install mooncake-transfer-engine-non-cuda"):
        make_receiver(args)  # what a decode server's scheduler builds at start-up


@needs_mooncake
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


@needs_mooncake
def test_wire_writes_each_layer_into_the_registered_buffer_then_reports_it(sender):
    """The protocol as the module docstring tells it, spoken by hand with an engine of our own."""
    k, v = make_kv(layers=3, tokens=4, dtype=torch.bfloat16)
    layout = KVLayout.of(k, v)
    engine = mc._new_engine(HOST, "tcp")
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
    assert engine.register_memory(buf.data_ptr(), layout.nbytes) == 0
    sender.put(12, TransferMeta("wire", 5), k, v)
    size = layout.tensor_nbytes
    with socket.create_connection((HOST, sender.port)) as raw:
        ask = mc._Ask(mc.MAGIC, 12, layout, f"{HOST}:{engine.get_rpc_port()}", buf.data_ptr())
        mc._write_frame(raw, ask)
        start = _read_frame(raw, _Reply)
        assert start.ok and start.meta == TransferMeta("wire", 5) and start.nbytes == 0
        for i in range(layout.layer_num):
            step = _read_frame(raw, _Reply)
            assert step.ok and step.nbytes == 2 * size * (i + 1)
            # layer i is in place when its frame comes: k[i] then v[i]
            assert bytes(buf[2 * i * size : (2 * i + 2) * size].numpy()) == (
                k[i].view(torch.uint8).numpy().tobytes() + v[i].view(torch.uint8).numpy().tobytes()
            )
        time.sleep(0.2)
        assert sender.poll() == [] and sender.pending() == 1  # not sent until the decode side acks
        mc._write_frame(raw, _Reply(ok=True))
        (st,) = wait_statuses(sender, 1)
    assert st.ok and st.nbytes == layout.nbytes and sender.pending() == 0
    engine.unregister_memory(buf.data_ptr())


@needs_mooncake
def test_room_put_after_the_receiver_asked_is_waited_for(sender, receiver):
    k, v = make_kv()
    receiver.submit(7, HOST, sender.port, KVLayout.of(k, v))
    time.sleep(0.3)
    assert receiver.poll() == [] and receiver.in_flight() == 1
    sender.put(7, TransferMeta("late", 3), k, v)
    (st,) = wait_statuses(receiver, 1)
    assert st.ok and st.meta.first_token == 3 and st.wait_ms >= 250
    assert bits_equal(st.k[1], k[1])


@needs_mooncake
def test_fail_reaches_the_receiver(sender, receiver):
    k, v = make_kv()
    sender.fail(9, "prompt too long for this prefill server")
    receiver.submit(9, HOST, sender.port, KVLayout.of(k, v))
    (st,) = wait_statuses(receiver, 1)
    assert not st.ok and st.error == "prompt too long for this prefill server" and st.k is None
    (sent,) = wait_statuses(sender, 1)
    assert not sent.ok and sender.pending() == 0


@needs_mooncake
def test_layout_mismatch_names_both_layouts(sender, receiver):
    k, v = make_kv(tokens=5)
    sender.put(3, TransferMeta("r", 1), k, v)
    receiver.submit(3, HOST, sender.port, KVLayout.of(*make_kv(tokens=6)))
    (st,) = wait_statuses(receiver, 1)
    assert not st.ok and "KV layout mismatch for bootstrap room 3" in st.error
    assert "num_tokens=6" in st.error and "num_tokens=5" in st.error and "same model and --dtype" in st.error


@needs_mooncake
def test_reused_room_is_refused_on_both_sides(sender, receiver):
    k, v = make_kv()
    sender.put(5, TransferMeta("a", 1), k, v)
    with pytest.raises(RoomInUseError, match="own bootstrap_room"):
        sender.put(5, TransferMeta("b", 1), k, v)
    layout = KVLayout.of(*make_kv(tokens=9))  # never matches: the first pull stays waiting for room 6
    receiver.submit(6, HOST, sender.port, layout)
    with pytest.raises(RoomInUseError, match="already being received"):
        receiver.submit(6, HOST, sender.port, layout)
    other = mc.MooncakeKVReceiver(timeout_s=5.0)
    try:
        time.sleep(0.2)
        other.submit(6, HOST, sender.port, layout)  # another decode server asking for the same room
        (st,) = wait_statuses(other, 1)
        assert not st.ok and "already being pulled by another decode connection" in st.error
    finally:
        other.close()


@needs_mooncake
def test_unreachable_port_says_what_to_run(receiver):
    port = free_port()
    receiver.submit(1, HOST, port, KVLayout.of(*make_kv()))
    (st,) = wait_statuses(receiver, 1)
    assert not st.ok and f"could not reach the prefill server's bootstrap port at {HOST}:{port}" in st.error
    assert f"--disaggregation-bootstrap-port {port}" in st.error


@needs_mooncake
def test_receiver_times_out_when_nothing_is_put(sender):
    r = mc.MooncakeKVReceiver(timeout_s=0.5)
    try:
        r.submit(8, HOST, sender.port, KVLayout.of(*make_kv()))
        (st,) = wait_statuses(r, 1)
        assert not st.ok and "no KV for bootstrap room 8" in st.error and "within 0.5 s" in st.error
        assert "has not produced it" in st.error
        assert r._parked == []  # the prefill side closed on our leaving, so the buffer was freed
    finally:
        r.close()
    time.sleep(0.3)
    assert sender.pending() == 0  # nothing was put, nothing leaks


@needs_mooncake
def test_cancel_reports_nothing_and_frees_the_sender(sender, receiver):
    k, v = make_kv()
    receiver.submit(4, HOST, sender.port, KVLayout.of(k, v))
    time.sleep(0.2)
    receiver.cancel(4)
    assert receiver.in_flight() == 0
    sender.put(4, TransferMeta("gone", 1), k, v)  # put after the decode side gave up: it expires, unclaimed
    time.sleep(0.3)
    assert receiver.poll() == []
    assert receiver._parked == []  # the prefill side closed, so the buffer was freed, not parked


@needs_mooncake
def test_the_backend_is_chosen_by_server_args():
    args = ServerArgs(disaggregation_transfer_backend="mooncake", disaggregation_bootstrap_port=free_port(), host=HOST)
    s, r = make_sender(args), make_receiver(args)
    try:
        assert isinstance(s, mc.MooncakeKVSender) and isinstance(r, mc.MooncakeKVReceiver)
        assert r.session.startswith(f"{HOST}:")
    finally:
        s.close()
        r.close()


@needs_mooncake
def test_mixed_backends_fail_the_request_with_unknown_protocol(sender, receiver):
    k, v = make_kv()
    tcp_sender, tcp_receiver = KVSender(HOST, 0, hold_timeout_s=5.0), KVReceiver(timeout_s=5.0)
    try:
        sender.put(1, TransferMeta("a", 1), k, v)
        tcp_receiver.submit(1, HOST, sender.port, KVLayout.of(k, v))  # tcp decode -> mooncake prefill
        (st,) = wait_statuses(tcp_receiver, 1)
        assert not st.ok and "unknown protocol 'workbench-kv/1'" in st.error
        assert "the same --disaggregation-transfer-backend" in st.error
        tcp_sender.put(2, TransferMeta("b", 1), k, v)
        receiver.submit(2, HOST, tcp_sender.port, KVLayout.of(k, v))  # mooncake decode -> tcp prefill
        (st,) = wait_statuses(receiver, 1)
        assert not st.ok and f"unknown protocol {mc.MAGIC!r}" in st.error
    finally:
        tcp_sender.close()
        tcp_receiver.close()


@needs_mooncake
def test_receiver_cancelling_mid_transfer_stops_the_writes_and_frees_both_sides(sender, receiver):
    k, v = make_kv(layers=64, tokens=1024, heads=4, dim=64)  # 128 MiB: hundreds of ms even on loopback
    sender.put(11, TransferMeta("big", 1), k, v)
    receiver.submit(11, HOST, sender.port, KVLayout.of(k, v))
    deadline = time.monotonic() + 10
    while (pull := receiver._pulls.get(11)) is None or pull.got[0] == 0:
        assert time.monotonic() < deadline, "no layer arrived"
        time.sleep(0.001)
    receiver.cancel(11)
    (st,) = wait_statuses(sender, 1)
    assert not st.ok and "went away after" in st.error and 0 < st.nbytes < KVLayout.of(k, v).nbytes
    assert sender.pending() == 0
    time.sleep(0.3)
    assert receiver.poll() == [] and receiver.in_flight() == 0 and receiver._parked == []


SENDER_THAT_DIES = textwrap.dedent(
    """
    import os, signal, sys, torch
    from workbench.core.disaggregation import mooncake
    from workbench.core.disaggregation.transfer import TransferMeta
    # the process SIGKILLs itself instead of reporting its second layer written: a prefill server dying
    # mid-transfer, at a moment the test can count on
    real_write_frame = mooncake._write_frame
    def write_frame(sock, msg):
        if getattr(msg, "nbytes", 0) >= 2 * 2 * 1024 * 4 * 64 * 4:
            os.kill(os.getpid(), signal.SIGKILL)
        real_write_frame(sock, msg)
    mooncake._write_frame = write_frame
    s = mooncake.MooncakeKVSender("127.0.0.1", 0)
    k = [torch.ones(1024, 4, 64) for _ in range(4)]
    s.put(31, TransferMeta("doomed", 0), k, [t.clone() for t in k])
    print(s.port, flush=True)
    sys.stdin.read()
    """
)


@needs_mooncake
def test_sender_killed_mid_transfer_names_bytes_received(receiver):
    proc = subprocess.Popen([sys.executable, "-c", SENDER_THAT_DIES], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        port = int(proc.stdout.readline())
        layout = KVLayout(1024, 4, 4, 64, "torch.float32")
        receiver.submit(31, HOST, port, layout)
        (st,) = wait_statuses(receiver, 1)
        assert proc.wait(timeout=10) == -9
        assert not st.ok
        m = re.search(r"closed the connection after (\d+) of (\d+) KV bytes of bootstrap room 31", st.error)
        assert m, st.error
        assert int(m[1]) == 2 * layout.tensor_nbytes and int(m[2]) == layout.nbytes and st.nbytes == int(m[1])
        assert receiver._parked == []  # the writer is dead: the buffer was freed
    finally:
        proc.kill()
        proc.wait()
