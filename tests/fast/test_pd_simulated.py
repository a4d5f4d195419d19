"""Live simulated PD (core/simulation/pd_live.py): the real TCP transport carrying a room's meta only
(a simulated runner has no KV tensors), timed by the link model on a clock the test controls, and the
arguments a simulated PD server takes or refuses."""

from __future__ import annotations

import time

import pytest
import torch
from workbench.core.args import ServerArgs
from workbench.core.disaggregation.transfer import KVLayout, KVReceiver, KVSender, TransferMeta
from workbench.core.simulation.hardware import get_hardware
from workbench.core.simulation.model_specs import model_spec
from workbench.core.simulation.pd import pd_link
from workbench.core.simulation.pd_live import LinkTimedReceiver, LinkTimedSender

HOST = "127.0.0.1"


def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.005)
    raise AssertionError("timed out")


@pytest.fixture
def pair():
    link = pd_link(model_spec("llama-3.1-70b"), get_hardware("h100"), 2, 8, 8)
    t = [100.0]  # the decode side's simulated clock (seconds), moved by the test
    sender = LinkTimedSender(KVSender(HOST, 0, hold_timeout_s=10), link)
    receiver = LinkTimedReceiver(KVReceiver(timeout_s=10), link, lambda: t[0])
    yield link, t, sender, receiver
    receiver.close()
    sender.close()


def test_a_kvless_room_is_held_until_the_clock_passes_the_link_models_time(pair):
    link, t, sender, receiver = pair
    n = 1000
    receiver.submit(7, HOST, sender.port, KVLayout.none(n))
    t[0] = 100.5  # the prefill takes half a second of the decode side's time
    sender.put(7, TransferMeta(rid="r7", first_token=42, num_tokens=n), [], [])
    got: list = []
    wait_until(lambda: got.extend(receiver.poll()) or receiver.next_due() is not None)  # the handover came in
    assert got == [] and receiver.in_flight() == 1  # ... and is held: the bytes are still on the (modelled) wire
    due = receiver.next_due()
    assert due == pytest.approx(100.5 + link.transfer_s(n))
    t[0] = due - 1e-6
    assert receiver.poll() == []
    t[0] = due
    (st,) = receiver.poll()
    assert st.ok and st.room == 7 and st.meta.first_token == 42
    # 70B: 80 layers x 8 KV heads x 128 x 2 (k, v) x 2 bytes = 320 KiB a token, over 8 lanes of H100's link
    assert link.bytes_per_token == 80 * 8 * 128 * 2 * 2
    assert st.nbytes == n * link.bytes_per_token
    assert st.ms == pytest.approx(link.transfer_s(n) * 1e3)
    assert st.ms == pytest.approx((n * link.bytes_per_token / (8 * get_hardware("h100").pd_link_bw) + 10e-6) * 1e3)
    assert st.wait_ms == pytest.approx(500.0)  # asked at 100.0, the bytes began at 100.5
    assert st.k == [] and st.v == []  # no tensors travelled
    assert receiver.in_flight() == 0
    # the prefill side's end of the room carries the same modelled bytes and ms
    sent: list = []
    wait_until(lambda: sent.extend(sender.poll()) or bool(sent))
    assert sent[0].ok and sent[0].nbytes == st.nbytes and sent[0].ms == pytest.approx(st.ms)
    assert sender.pending() == 0


def test_rooms_from_one_prefill_share_its_links_and_a_failure_is_not_held(pair):
    link, t, sender, receiver = pair
    for room, n in ((1, 4000), (2, 2000), (3, 100)):
        receiver.submit(room, HOST, sender.port, KVLayout.none(n))
    failed: list = []
    sender.put(1, TransferMeta(rid="a", first_token=1, num_tokens=4000), [], [])
    wait_until(lambda: failed.extend(receiver.poll()) or receiver.next_due() is not None)
    sender.put(2, TransferMeta(rid="b", first_token=2, num_tokens=2000), [], [])
    sender.fail(3, "the prefill server could not compute this prompt: too long")
    wait_until(lambda: failed.extend(receiver.poll()) or (receiver.in_flight() == 2 and bool(failed)))
    (f,) = failed  # the failure passes at once, with the prefill's reason
    assert f.room == 3 and not f.ok and "too long" in f.error
    # both rooms came in at 100.0; the second one's bytes follow the first's on the same links
    first = 100.0 + link.transfer_s(4000)
    second = first - link.latency_s + link.transfer_s(2000)
    assert receiver.next_due() == pytest.approx(first)
    t[0] = first
    assert [s.room for s in receiver.poll()] == [1]
    t[0] = second
    (st,) = receiver.poll()
    assert st.room == 2 and st.wait_ms == pytest.approx((first - link.latency_s - 100.0) * 1e3)


def test_a_cancelled_room_is_not_reported(pair):
    link, t, sender, receiver = pair
    receiver.submit(5, HOST, sender.port, KVLayout.none(10))
    sender.put(5, TransferMeta(rid="c", first_token=3, num_tokens=10), [], [])
    wait_until(lambda: receiver.poll() or receiver.next_due() is not None)
    receiver.cancel(5)
    t[0] += 10
    assert receiver.poll() == [] and receiver.in_flight() == 0


def test_a_kvless_decode_side_and_a_real_prefill_do_not_mix():
    """A simulated decode server behind a real prefill (or the reverse) fails the room with what to change."""
    sender, receiver = KVSender(HOST, 0), KVReceiver(timeout_s=10)
    try:
        receiver.submit(9, HOST, sender.port, KVLayout.none(5))
        k = [torch.zeros(5, 2, 4) for _ in range(2)]
        sender.put(9, TransferMeta(rid="d", first_token=1), k, [x.clone() for x in k])
        got: list = []
        wait_until(lambda: got.extend(receiver.poll()) or bool(got))
        assert not got[0].ok and "layout mismatch" in got[0].error and "same model" in got[0].error
    finally:
        receiver.close()
        sender.close()


def test_simulated_pd_arguments():
    for mode in ("prefill", "decode"):  # tp 8: one process stands for the devices
        ServerArgs(simulate="h100", model_path="llama-3.1-70b", tp_size=8, disaggregation_mode=mode)
        ServerArgs(simulate="h100", disaggregation_mode=mode, sim_speed=10)
        with pytest.raises(ValueError, match=r"positive --sim-speed.*workbench sim run --pd"):
            ServerArgs(simulate="h100", disaggregation_mode=mode, sim_speed=0)
        with pytest.raises(ValueError, match="transfer-backend tcp"):
            ServerArgs(simulate="h100", disaggregation_mode=mode, disaggregation_transfer_backend="mooncake")
        with pytest.raises(ValueError, match="tp-size > 1"):  # a real PD server still hands over one rank's KV
            ServerArgs(tp_size=2, disaggregation_mode=mode)
    ServerArgs(simulate="h100", sim_speed=0)  # without PD, speed 0 is as before


def _tui_args(argv):
    import argparse

    from workbench.tui.cli import add_tui_args

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    add_tui_args(parser)
    return parser.parse_args(argv)


def test_tui_disaggregation_takes_a_shape_for_simulated_engines():
    from workbench.tui.cli import make_controller
    from workbench.tui.pd import PDController

    sim = ["--simulate", "h100", "--model", "llama-3.1-70b", "--tp-size", "8"]
    c = make_controller(_tui_args(["--disaggregation", *sim]))
    assert isinstance(c, PDController) and c.shape == (1, 1) and c._server_args.simulate == "h100"
    c = make_controller(_tui_args(["--disaggregation", "2P4D", *sim]))
    assert isinstance(c, PDController) and c.shape == (2, 4)
    assert make_controller(_tui_args(["--disaggregation"])).shape == (1, 1)  # real engines: a 1P1D pair
    with pytest.raises(ValueError, match="simulated ones only"):
        make_controller(_tui_args(["--disaggregation", "2P4D"]))
    with pytest.raises(ValueError, match="write xPyD"):
        make_controller(_tui_args(["--disaggregation", "2X4", *sim]))
