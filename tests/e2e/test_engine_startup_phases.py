"""An Engine's start-up reports its phases, in order, from the processes doing them (issue #37 item 6)."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.timeout(300)


def test_engine_start_emits_its_phases_in_order(tmp_path):
    from workbench.core.engine import Engine
    from workbench.core.trace import events as ev

    seen: list[ev.EnginePhase] = []
    log = tmp_path / "engine.log"
    eng = Engine(show_progress=False, max_running_requests=4, on_phase=seen.append, log_path=str(log))
    try:
        names = [e.phase for e in seen]
        # kernels come only where this machine has not built them yet (inside the warm-up, which
        # then resumes: ... warmup, kernels, warmup, ready)
        core = [n for n in names if n != "kernels"]
        assert core[:3] == ["model", "processes", "weights"], names
        assert core[-2:] == ["warmup", "ready"], names
        assert all(isinstance(e, ev.EnginePhase) for e in seen)
        # each from where it happens: weights and warm-up in the scheduler process, the rest here
        procs = {e.phase: e.proc for e in seen}
        assert procs["weights"] == procs["warmup"] == "scheduler" and procs["model"] == procs["ready"] == "engine"
        assert seen[-1].log_path == str(log) == eng.log_path
        # the folded picture: nothing running, every phase timed, their sum about the start's time
        st = eng.startup
        assert st.current is None and st.done and st.log_path == str(log)
        total = sum(p.seconds for p in st.phases)
        assert 0 < total <= eng.ready_time_s + 1.0
        assert {p.name for p in st.phases if p.seconds > 0} >= {"weights"}
        # the log names the phases (and the scheduler's records go there too)
        text = log.read_text()
        assert "phase weights (scheduler)" in text and "phase ready (engine)" in text
        out = eng.generate("Hi", {"max_new_tokens": 2, "temperature": 0})
        assert out["meta_info"]["completion_tokens"] == 2
    finally:
        eng.shutdown()
    assert os.path.exists(log)


def test_without_on_phase_the_phases_and_the_log_are_printed(tmp_path, monkeypatch):
    """What `workbench serve` shows on the console: the log's path first, then each phase as it begins;
    without log_path the log is a new file in $WORKBENCH_LOG_DIR (default ~/.cache/workbench/logs)."""
    from workbench.core.engine import Engine

    monkeypatch.setenv("WORKBENCH_LOG_DIR", str(tmp_path / "logs"))
    lines: list[str] = []
    eng = Engine(show_progress=False, max_running_requests=4, on_progress=lines.append)
    try:
        assert eng.log_path.startswith(str(tmp_path / "logs")) and os.path.exists(eng.log_path)
        assert lines[0] == f"engine log: {eng.log_path}"
        begun = [line.removesuffix(" …").split(":")[0] for line in lines[1:] if line.endswith(" …")]
        assert [b for b in begun if not b.startswith("building kernels")] == [
            "preparing the model (finding, downloading or converting it)",
            "starting the scheduler and detokenizer processes",
            "loading weights",
            "warming up (KV cache, attention backend, captured graphs)",
        ], lines
        assert lines[-1].startswith("ready in ")
    finally:
        eng.shutdown()


def test_a_failed_start_says_so_and_logs_the_childs_traceback(tmp_path):
    """The scheduler fails while it starts (it may not pin cores it does not have): the last phase is
    `failed` with the reason, and the log holds the child's traceback, which the exception does not."""
    from workbench.core.engine import Engine

    seen = []
    log = tmp_path / "engine.log"
    with pytest.raises(RuntimeError, match="scheduler process failed to start"):
        Engine(show_progress=False, cpu_omp_threads_bind="4094-4095", on_phase=seen.append, log_path=str(log))
    assert [e.phase for e in seen][:2] == ["model", "processes"] and seen[-1].phase == "failed"
    assert "4094" in seen[-1].detail
    text = log.read_text()
    assert "phase failed (engine)" in text and "Traceback (most recent call last)" in text
    assert "cores_for_rank" in text  # where in the child it failed
