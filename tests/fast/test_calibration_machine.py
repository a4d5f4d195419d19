"""`--simulate cpu-here` checks that its calibration describes this machine (issue #37 item 4).

A calibration records the machine it was measured on; `for_this_machine` prefers this machine's own
(the per-machine cache `bench calibrate` writes), and warns, saying how to calibrate here, when the
shipped one came from another CPU model or this machine's GEMM probe is far from the recorded one.
"""

from __future__ import annotations

import logging

import pytest
from workbench.core.simulation import calibration as calib
from workbench.core.simulation.calibration import Calibration, for_this_machine, shipped_path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CALIBRATION_DIR", str(tmp_path))
    return tmp_path


def _shipped_copy(**meta) -> Calibration:
    cal = Calibration.load(shipped_path("cpu-here", "smollm2-135m"))
    cal.meta.update(meta)
    return cal


def test_the_machine_is_recorded_and_keyed_by_its_cpu():
    m = calib.machine(4)
    assert m["cpu_model"] == calib.cpu_model() and m["cores"] >= 1 and m["cpu_class"] == calib.cpu_class()
    assert m["gemm_gflops"] > 0.1  # a real measurement: a GEMM of 113 MFLOP on one core
    key = calib.machine_key()
    assert calib.cpu_class() in key and "/" not in key and " " not in key


def test_a_calibration_from_another_cpu_model_warns_and_says_how_to_calibrate_here(cache, monkeypatch):
    cal = _shipped_copy(cpu_model="Intel(R) Xeon(R) Platinum 8488C", gemm_gflops=None)
    monkeypatch.setattr(calib, "shipped_path", lambda hw, model: cache / "shipped.json")
    cal.save(cache / "shipped.json")
    choice = for_this_machine("cpu-here", "smollm2-135m")
    assert choice.source == "shipped" and choice.calibration is not None
    assert "Intel(R) Xeon(R) Platinum 8488C" in choice.warning and calib.cpu_model() in choice.warning
    assert "workbench bench calibrate" in choice.warning and str(cache) in choice.warning


def test_the_same_cpu_model_with_a_far_probe_warns_and_a_near_one_does_not(cache, monkeypatch):
    monkeypatch.setattr(calib, "shipped_path", lambda hw, model: cache / "shipped.json")
    here = calib.gemm_probe_gflops(4)
    _shipped_copy(cpu_model=calib.cpu_model(), gemm_gflops=here * 3, dtype_bytes=4).save(cache / "shipped.json")
    far = for_this_machine("cpu-here", "smollm2-135m")
    assert far.warning and "GEMM probe" in far.warning
    _shipped_copy(cpu_model=calib.cpu_model(), gemm_gflops=here * 1.05, dtype_bytes=4).save(cache / "shipped.json")
    assert for_this_machine("cpu-here", "smollm2-135m").warning is None


def test_this_machines_own_calibration_comes_first_and_the_simulator_uses_it(cache):
    from workbench.core.simulation.simulator import Simulator, poisson_workload

    shipped_choice = for_this_machine("cpu-here", "smollm2-135m")
    assert shipped_choice.source == "shipped"
    mine = _shipped_copy(**calib.machine(4))
    for p in mine.points:  # this machine is twice as slow as the shipped table says
        p["measured_s"] *= 2
    mine.save(calib.local_path("cpu-here", "smollm2-135m"))
    choice = for_this_machine("cpu-here", "smollm2-135m")
    assert choice.source == "this machine" and choice.warning is None
    assert choice.path == calib.local_path("cpu-here", "smollm2-135m")
    work = poisson_workload(0, 8, (64, 256), (8, 16), seed=1)  # a burst: the makespan is the passes
    sim = Simulator("smollm2-135m", "cpu-here")
    assert sim.calibration_source == "this machine"
    slow = sim.run(work)
    fast = Simulator("smollm2-135m", "cpu-here", calibration=shipped_choice.calibration).run(work)
    assert slow.sim_s > 1.5 * fast.sim_s


def test_a_named_gpu_is_never_checked_against_this_host(cache):
    choice = for_this_machine("h200", "smollm2-135m")
    assert choice.source == "shipped" and choice.warning is None
    assert for_this_machine("h100", "llama-3.1-70b").source == "none"


def test_the_warning_is_logged_once_per_process(cache, monkeypatch, caplog):
    monkeypatch.setattr(calib, "shipped_path", lambda hw, model: cache / "shipped.json")
    _shipped_copy(cpu_model="Some Other CPU").save(cache / "shipped.json")
    monkeypatch.setattr(calib, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=calib.__name__):
        calib.auto("cpu-here", "smollm2-135m")
        calib.auto("cpu-here", "smollm2-135m")
    assert sum("Some Other CPU" in r.getMessage() for r in caplog.records) == 1
