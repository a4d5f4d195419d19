"""A production trace as a live workload (issue #37, workbench/trace_runner.py): `workbench tui
--workload FILE`'s flags parsed and checked, the time scale chosen from --rate or given, a trace file
as a WorkloadRunner's kind making a TraceRunner, its requests' prompts (Mooncake's shared hash ids
as shared prefixes, cut to the context) and output lengths, and + / - rescaling from where the trace
is. The runner sending to a real engine is tests/e2e/test_tui_trace_workload_e2e.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from workbench.trace_runner import TraceRunner, TraceSpec, WorkloadError, speed_words, trace_spec_from_args
from workbench.workloads import WorkloadRunner

ROWS = [  # 4 requests over 3 s of trace: a mean 1 req/s
    {"timestamp": 10_000, "input_length": 700, "output_length": 4, "hash_ids": [0, 1]},
    {"timestamp": 11_000, "input_length": 650, "output_length": 3, "hash_ids": [0, 2]},
    {"timestamp": 12_000, "input_length": 300, "output_length": 2, "hash_ids": [5]},
    {"timestamp": 13_000, "input_length": 9000, "output_length": 5, "hash_ids": [0, 1, 7]},
]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "mooncake_trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _tui_args(*argv: str) -> argparse.Namespace:
    from workbench.cli import build_parser

    return build_parser().parse_args(["tui", *argv])


def test_tui_flags_read_the_trace_and_choose_a_time_scale(trace):
    spec = trace_spec_from_args(_tui_args("--workload", str(trace), "--max-requests", "3"))
    assert isinstance(spec, TraceSpec) and spec.name == "mooncake mooncake_trace.jsonl"
    assert [r.arrival for r in spec.load().requests] == [0.0, 1.0, 2.0]
    assert spec.mean_rate() == pytest.approx(1.0)
    assert spec.scale_for(None) == pytest.approx(1.0) and spec.scale_for(0.25) == pytest.approx(4.0)
    line = spec.describe(0.25)
    assert "3 requests" in line and "1/4 speed" in line and "--time-scale 1 plays it as recorded" in line
    assert "prompts 550 and outputs 3 tokens on average" in line
    given = trace_spec_from_args(_tui_args("--workload", str(trace), "--time-scale", "0.5", "--start", "1"))
    assert given.scale_for(0.25) == 0.5 and len(given.load().requests) == 3
    assert "2x speed" in given.describe()
    # a kind stays a kind
    assert trace_spec_from_args(_tui_args("--workload", "chat")) is None


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--workload", "no-such-trace.jsonl"], "no such file, and not a workload kind"),
        (["--workload", "chat", "--time-scale", "2"], "--time-scale: for a --workload FILE"),
        (["--sample", "0.5"], "--sample: for a --workload FILE"),
        (["--workload", "{trace}", "--time-scale", "0"], "--time-scale: a factor above 0"),
        (["--workload", "{trace}", "--start", "60"], "no requests left after --start 60"),
    ],
)
def test_tui_trace_flags_that_cannot_work_say_what_to_do(trace, argv, says):
    with pytest.raises(WorkloadError, match=says.replace("(", r"\(")):
        trace_spec_from_args(_tui_args(*[a.format(trace=trace) for a in argv]))


def test_make_controller_turns_a_bad_trace_into_a_plain_message(tmp_path):
    from workbench.tui.cli import make_controller

    bad = tmp_path / "t.csv"
    bad.write_text("when,what\n1,2\n")
    with pytest.raises(ValueError, match="no known workload") as err:
        make_controller(_tui_args("--workload", str(bad)))
    assert type(err.value) is ValueError  # friendly() prints a ValueError's message as it is


def test_a_trace_as_the_kind_makes_a_trace_runner_with_the_traces_lengths_and_shared_prefixes(trace):
    # (the vocabulary and context an engine would give)
    runner = WorkloadRunner(None, TraceSpec(str(trace)), 2.0, max_new_tokens=32, vocab=1000, context_len=2048)
    assert isinstance(runner, TraceRunner) and runner.time_scale == pytest.approx(0.5)
    assert runner.rate == pytest.approx(2.0) and "2x speed" in runner.label and "0/4 sent" in runner.label
    sent = [runner._request_kwargs(i) for i in range(4)]
    ids = [s["input_ids"] for s in sent]
    assert [s["sampling_params"]["max_new_tokens"] for s in sent] == [4, 3, 2, 5]  # the trace's, not 32
    assert all(s["sampling_params"]["ignore_eos"] for s in sent)
    assert [len(x) for x in ids[:3]] == [700, 650, 300]
    assert len(ids[3]) == 2048 - 5 - 1 and runner.clipped == 1  # cut to the context, its prefix kept
    assert all(3 <= t < 1000 for x in ids for t in x)  # the engine's vocabulary
    assert ids[1][:512] == ids[0][:512] and ids[1][512] != ids[0][512]  # block 0 shared, then 2 != 1
    assert ids[3][:700] == ids[0]  # blocks 0 and 1, as far as row 1 had them
    assert ids[2][0] != ids[0][0]
    # recorded ids past this model's vocabulary (a recording of another model): drawn again, as long
    runner.requests[2].prompt_ids = [5000] * 300
    assert len(again := runner._request_kwargs(2)["input_ids"]) == 300 and max(again) < 1000

    runner.set_rate(0.5)  # `-` twice: the rest of the trace at a quarter of the speed
    assert runner.time_scale == pytest.approx(2.0) and "1/2 speed" in runner.label
    # the kinds are untouched
    assert type(WorkloadRunner(None, "chat", 1.0)) is WorkloadRunner


def test_speed_words():
    assert [speed_words(x) for x in (1.0, 20.0, 0.25)] == ["real time", "1/20 speed", "4x speed"]


def test_long_prompts_slow_the_default_scale_to_what_a_cpu_prefills(tmp_path):
    rows = [{"timestamp": 1000 * i, "input_length": 8000, "output_length": 50, "hash_ids": [i]} for i in range(11)]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = trace_spec_from_args(_tui_args("--workload", str(path)))
    assert spec.mean_rate() == pytest.approx(1.0) and spec.prompt_tokens_per_s() == pytest.approx(8000)
    assert spec.scale_for(None) == pytest.approx(8.0)  # 1 req/s of 8000-token prompts: 8x slower
    assert spec.scale_for(1.0) == pytest.approx(1.0)  # --rate says what the user wants
    assert "at most 1000 prompt tokens/s" in spec.describe() and "1/8 speed" in spec.describe()


def test_a_simulated_deployment_takes_the_traces_own_rate_unless_told(trace):
    spec = trace_spec_from_args(_tui_args("--workload", str(trace)))
    assert spec.scale_for(None, simulated=True) == 1.0 and spec.scale_for(0.5, simulated=True) == 2.0
    assert "real time" in spec.describe(simulated=True) and "simulated deployment" in spec.describe(simulated=True)


def test_record_refuses_a_trace_it_cannot_read_before_any_engine_starts(tmp_path):
    from workbench.cli import main

    out = tmp_path / "run.jsonl"
    with pytest.raises(SystemExit, match="workbench record: --workload nope.jsonl: no such file"):
        main(["record", "--workload", "nope.jsonl", "-o", str(out)])
    with pytest.raises(SystemExit, match="--sample: for a --workload FILE"):
        main(["record", "--sample", "0.5", "-o", str(out)])
    assert not out.exists()


def test_the_tuis_controller_starts_from_the_rate_the_trace_is_played_at(trace):
    """+ and - multiply the controller's rate: it must be the played one, or a key press jumps."""
    from workbench.tui.cli import make_controller

    cases = [
        ((), 1.0),  # the default: the trace's mean 1 req/s
        (("--time-scale", "4"), 0.25),
        (("--rate", "3"), 3.0),
        (("--simulate", "h100", "--model", "llama-3.1-8b"), 1.0),  # its own rate
    ]
    for argv, rate in cases:
        c = make_controller(_tui_args("--workload", str(trace), "--max-requests", "3", *argv))
        assert c.rate == pytest.approx(rate), argv
        runner = WorkloadRunner(None, c.workload, c.rate, vocab=1000, context_len=2048)
        assert runner.rate == pytest.approx(rate) and runner.time_scale == pytest.approx(1.0 / rate), argv


def test_replay_of_a_workload_says_how_to_play_it(trace):
    from workbench.tui.cli import make_controller

    with pytest.raises(ValueError, match=r"is a mooncake workload, not a recording.*tui --workload"):
        make_controller(argparse.Namespace(replay=str(trace)))
    recording = Path(__file__).parents[1] / "data" / "serve_record.jsonl"
    assert make_controller(argparse.Namespace(replay=str(recording), speed=1.0)).mode == "replay"
