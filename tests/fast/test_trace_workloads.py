"""Workloads from production traces (issue #37, workbench/traces.py): Mooncake's JSONL, Azure's LLM
inference CSV and BurstGPT's CSV read, detected and overridden; cut by time, sampled, counted and
paced; Mooncake's shared hash_ids as real shared prompt prefixes that the simulated radix cache hits;
and `workbench sim run --workload` on a Mooncake file through the CLI's entry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from workbench.core.simulation.simulator import SimRequest, Simulator, request_prompt

from workbench.traces import (
    MOONCAKE_BLOCK,
    BlockPrompt,
    TraceCut,
    WorkloadError,
    detect_format,
    fit_vocab,
    read_workload,
)

RECORDING = Path(__file__).parents[1] / "data" / "tui_trace.jsonl"


def _mooncake(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _azure(path: Path) -> Path:
    # 100 ns ticks, as the 2023 and 2024 traces write them
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.1805900,396,109\n"
        "2023-11-16 18:16:46.6805900,879,20\n"
    )
    return path


def _burstgpt(path: Path) -> Path:
    path.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "45,ChatGPT,1087,230,1317,Conversation log\n"
        "118,GPT-4,417,276,693,Conversation log\n"
        "1106,ChatGPT,0,0,0,Conversation log\n"
        "1129,ChatGPT,1305,477,1782,API log\n"
        "4525,GPT-4,612,0,612,Conversation log\n"
    )
    return path


MOONCAKE_ROWS = [
    {"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
    {"timestamp": 3000, "input_length": 1300, "output_length": 7, "hash_ids": [0, 1, 3]},
    {"timestamp": 3000, "input_length": 700, "output_length": 4, "hash_ids": [4, 5]},
    {"timestamp": 9500, "input_length": 2000, "output_length": 9, "hash_ids": [0, 6]},  # prompt past its blocks
]


def test_each_format_is_detected_from_its_first_line(tmp_path):
    wb = tmp_path / "w.jsonl"
    wb.write_text(json.dumps({"arrival": 0.0, "prompt_tokens": 10, "output_tokens": 2}) + "\n")
    assert detect_format(wb) == "workbench"
    assert detect_format(RECORDING) == "recording"
    assert detect_format(_mooncake(tmp_path / "m.jsonl", MOONCAKE_ROWS)) == "mooncake"
    assert detect_format(_azure(tmp_path / "a.csv")) == "azure"
    assert detect_format(_burstgpt(tmp_path / "b.csv")) == "burstgpt"
    v2 = tmp_path / "b2.csv"  # BurstGPT v2's columns: Session ID and Elapsed time added
    v2.write_text(
        "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "3.5,17,2.1,GPT-4,100,20,120,Conversation log\n"
        "4.0,,1.0,ChatGPT,50,10,60,API log\n"
    )
    assert detect_format(v2) == "burstgpt"
    got = read_workload(v2)
    assert [(r.arrival, r.prompt_len, r.output_len) for r in got.requests] == [(0.0, 100, 20), (0.5, 50, 10)]
    unknown = tmp_path / "u.csv"
    unknown.write_text("time,in,out\n1,2,3\n")
    with pytest.raises(WorkloadError, match="no known workload.*--workload-format"):
        detect_format(unknown)
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(WorkloadError, match="empty"):
        read_workload(tmp_path / "e.jsonl")


def test_mooncake_arrivals_lengths_and_shared_blocks(tmp_path):
    got = read_workload(_mooncake(tmp_path / "m.jsonl", MOONCAKE_ROWS))
    reqs = got.requests
    assert got.format == "mooncake" and got.rows == 4 and got.failed == 0
    # ms since the trace began, counted from the first request
    assert [r.arrival for r in reqs] == [0.0, 2.0, 2.0, 8.5]
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(1100, 5), (1300, 7), (700, 4), (2000, 9)]
    prompts = [request_prompt(i, r, 0, 128256) for i, r in enumerate(reqs)]
    assert [len(p) for p in prompts] == [1100, 1300, 700, 2000]
    a, b, c, d = prompts
    k2 = 2 * MOONCAKE_BLOCK
    assert a[:k2] == b[:k2] and a[k2] != b[k2]  # hash ids 0, 1 shared: 1024 identical tokens, then apart
    assert a[:MOONCAKE_BLOCK] == d[:MOONCAKE_BLOCK] and a[MOONCAKE_BLOCK] != d[MOONCAKE_BLOCK]  # id 0 only
    assert a[:8] != c[:8]  # nothing shared
    assert len(set(d[k2:])) > 100  # the tokens past its two blocks are the request's own
    # the same file read again gives the same ids (deterministic), another --seed other ids
    again = read_workload(tmp_path / "m.jsonl").requests
    assert list(again[1].prompt_ids) == b
    other = read_workload(tmp_path / "m.jsonl", seed=1).requests
    assert list(other[0].prompt_ids)[:k2] == list(other[1].prompt_ids)[:k2] != a[:k2]


def test_mooncake_ids_fit_a_small_vocabulary_and_keep_their_sharing(tmp_path):
    reqs = read_workload(_mooncake(tmp_path / "m.jsonl", MOONCAKE_ROWS)).requests
    fit_vocab(reqs, 1000)
    a, b = list(reqs[0].prompt_ids), list(reqs[1].prompt_ids)
    assert max(a + b) < 1000 and min(a + b) >= 3
    assert a[: 2 * MOONCAKE_BLOCK] == b[: 2 * MOONCAKE_BLOCK]


def test_shared_hash_ids_are_cache_hits_in_the_simulator(tmp_path):
    """Two requests sharing blocks 0 and 1: the second finds 1024 tokens in the radix cache; with
    their blocks renamed apart, nothing."""
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 4, "hash_ids": [10, 11, 12]},
        {"timestamp": 1000, "input_length": 1300, "output_length": 4, "hash_ids": [10, 11, 13]},
    ]
    shared = read_workload(_mooncake(tmp_path / "shared.jsonl", rows)).requests
    result = Simulator("llama-3.1-8b", "h100").run(shared)
    assert len(result.latency) == 2
    assert result.cached_tokens == 2 * MOONCAKE_BLOCK
    apart = [dict(r, hash_ids=[h + 100 * i for h in r["hash_ids"]]) for i, r in enumerate(rows)]
    alone = read_workload(_mooncake(tmp_path / "apart.jsonl", apart)).requests
    assert Simulator("llama-3.1-8b", "h100").run(alone).cached_tokens == 0


def test_azure_datetimes_become_arrivals_from_the_first_request(tmp_path):
    got = read_workload(_azure(tmp_path / "a.csv"))
    assert got.format == "azure" and got.rows == 3
    assert [r.arrival for r in got.requests] == pytest.approx([0.0, 3.5, 60.0])
    assert [(r.prompt_len, r.output_len) for r in got.requests] == [(374, 44), (396, 109), (879, 20)]
    assert all(r.prompt_ids is None for r in got.requests)  # Azure says nothing of shared prefixes
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n")
    with pytest.raises(WorkloadError, match=r"bad.csv:2: .*date and time"):
        read_workload(bad)


def test_burstgpt_failures_are_skipped_and_counted(tmp_path):
    got = read_workload(_burstgpt(tmp_path / "b.csv"))
    assert got.format == "burstgpt" and got.rows == 6 and got.failed == 2
    assert [r.arrival for r in got.requests] == [0.0, 40.0, 113.0, 1124.0]
    assert [(r.prompt_len, r.output_len) for r in got.requests] == [(472, 18), (1087, 230), (417, 276), (1305, 477)]
    assert "4 requests" in got.summary("b.csv") and "2 failed" in got.summary("b.csv")


def test_an_override_reads_as_told_and_a_missing_column_says_so(tmp_path):
    az, mc = _azure(tmp_path / "a.csv"), _mooncake(tmp_path / "m.jsonl", MOONCAKE_ROWS)
    assert read_workload(az, "azure").format == "azure"
    with pytest.raises(WorkloadError, match=r"missing column 'Timestamp'.*another --workload-format"):
        read_workload(az, "burstgpt")
    with pytest.raises(WorkloadError, match=r"m.jsonl:1: KeyError\('arrival'\)"):
        read_workload(mc, "workbench")
    with pytest.raises(WorkloadError, match="one of auto, workbench"):
        read_workload(mc, "sharegpt")
    broken = _mooncake(tmp_path / "broken.jsonl", [MOONCAKE_ROWS[0], {"timestamp": 5, "hash_ids": [1]}])
    with pytest.raises(WorkloadError, match=r"broken.jsonl:2: KeyError\('input_length'\)"):
        read_workload(broken)
    # the project's own formats read as before: arrivals as written, a recording's finished requests
    wb = tmp_path / "w.jsonl"
    wb.write_text(
        "".join(json.dumps({"arrival": 2.0 + i, "prompt_tokens": 10, "output_tokens": 3}) + "\n" for i in range(3))
    )
    assert [r.arrival for r in read_workload(wb).requests] == [2.0, 3.0, 4.0]
    assert len(read_workload(RECORDING).requests) == 7


def test_cut_by_time_count_and_sample_then_scale(tmp_path):
    rows = [{"timestamp": 500 * i, "input_length": 100, "output_length": 2, "hash_ids": [i]} for i in range(200)]
    path = _mooncake(tmp_path / "m.jsonl", rows)  # one request every 0.5 s for 100 s
    window = read_workload(path, cut=TraceCut(start=10.0, duration=5.0)).requests
    assert len(window) == 10 and window[0].arrival == 0.0 and window[-1].arrival == 4.5
    assert [r.prompt_ids.hash_ids for r in window] == [(i,) for i in range(20, 30)]
    first = read_workload(path, cut=TraceCut(max_requests=7)).requests
    assert [r.prompt_ids.hash_ids[0] for r in first] == list(range(7))
    fast = read_workload(path, cut=TraceCut(max_requests=5, time_scale=0.5)).requests
    assert [r.arrival for r in fast] == [0.0, 0.25, 0.5, 0.75, 1.0]
    tenth = read_workload(path, cut=TraceCut(sample=0.1, seed=3)).requests
    assert 8 <= len(tenth) <= 35 and len({r.prompt_ids.hash_ids for r in tenth}) == len(tenth)
    same = read_workload(path, cut=TraceCut(sample=0.1, seed=3)).requests
    assert [r.prompt_ids.hash_ids for r in same] == [r.prompt_ids.hash_ids for r in tenth]  # seeded
    other = read_workload(path, cut=TraceCut(sample=0.1, seed=4)).requests
    assert [r.prompt_ids.hash_ids for r in other] != [r.prompt_ids.hash_ids for r in tenth]
    # sampled, then the first N of what was kept, in the window
    both = read_workload(path, cut=TraceCut(start=20.0, sample=0.5, max_requests=4, seed=3)).requests
    assert len(both) == 4 and all(r.arrival >= 0 for r in both)
    with pytest.raises(WorkloadError, match=r"no requests left after --start 500.*span 99.5 s"):
        read_workload(path, cut=TraceCut(start=500.0))
    # failed rows inside the window are counted, those outside are not
    bg = _burstgpt(tmp_path / "b.csv")
    cut = read_workload(bg, cut=TraceCut(start=1000.0, duration=200.0))
    assert cut.failed == 1 and [(r.arrival, r.prompt_len) for r in cut.requests] == [(124.0, 1305)]


def test_a_file_out_of_order_keeps_the_earliest_n(tmp_path):
    rows = [{"timestamp": t, "input_length": 64, "output_length": 2, "hash_ids": [t]} for t in (0, 3000, 1000, 2000)]
    got = read_workload(_mooncake(tmp_path / "m.jsonl", rows), cut=TraceCut(max_requests=3)).requests
    assert sorted(r.arrival for r in got) == [0.0, 1.0, 2.0]


def test_sim_run_reads_a_mooncake_trace_through_the_cli(tmp_path, capsys):
    from workbench.cli import main

    rows = [
        {"timestamp": 250 * i, "input_length": 1200, "output_length": 8, "hash_ids": [0, 1, 100 + i]} for i in range(6)
    ]
    path = _mooncake(tmp_path / "mooncake_trace.jsonl", rows)
    rc = main(["sim", "run", "--workload", str(path), "--max-requests", "4", "--time-scale", "2"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "SIMULATED h100x1, llama-3.1-8b: 4 requests" in captured.out
    hit = float(captured.out.split("cache hit ")[1].split("%")[0])
    assert hit == pytest.approx(100 * 3 * 1024 / (4 * 1200), abs=1)  # three requests found blocks 0, 1
    assert "mooncake workload mooncake_trace.jsonl: 4 requests over 1.5 s" in captured.err
    with pytest.raises(SystemExit, match="missing column 'TIMESTAMP'"):
        main(["sim", "run", "--workload", str(_burstgpt(tmp_path / "b.csv")), "--workload-format", "azure"])
    with pytest.raises(SystemExit, match="--time-scale: for a --workload FILE"):
        main(["sim", "run", "--time-scale", "0.5"])
    with pytest.raises(SystemExit, match="--sample: a fraction"):
        main(["sim", "run", "--workload", str(path), "--sample", "2"])


def test_sim_request_keeps_a_lazy_prompt_until_it_runs():
    prompt = BlockPrompt([7, 8], 600, salt=1)
    r = SimRequest(0.0, 600, 3, prompt_ids=prompt)
    ids = request_prompt(0, r, 0, 128256)
    assert len(ids) == 600 and ids[:512] == list(BlockPrompt([7], 512, salt=2)) and prompt[513] == ids[513]


# A real `workbench serve --record` run of the default model, recorded without token ids
# (tests/data/record_serve_trace.py made it): 5 chats, 4 of them with one system prompt.
SERVE_RECORD = Path(__file__).parents[1] / "data" / "serve_record.jsonl"


def _recorded_finishes(path: Path) -> list[tuple[float, int, int, int]]:
    """(arrival s, prompt, output, cached tokens) of each finished request, as the engine recorded them."""
    from workbench.core.trace.events import ReqArrived, ReqFinished
    from workbench.core.trace.recorder import read_trace

    _, events = read_trace(path)
    arrived = {e.rid: e.ts for e in events if isinstance(e, ReqArrived)}
    done = sorted(
        (arrived[e.rid], e.prompt_tokens, e.completion_tokens, e.cached_tokens)
        for e in events
        if isinstance(e, ReqFinished)
    )
    return [((t - done[0][0]) / 1e9, p, o, c) for t, p, o, c in done]


def test_a_serve_recording_replays_with_its_arrivals_lengths_and_shared_prefixes():
    real = _recorded_finishes(SERVE_RECORD)
    assert len(real) == 5 and sum(c for *_, c in real) > 100  # the fixture is what this test is about
    got = read_workload(SERVE_RECORD)
    assert got.format == "recording"
    reqs = got.requests
    assert [(r.arrival, r.prompt_len, r.output_len) for r in reqs] == [(t, p, o) for t, p, o, _ in real]
    prompts = [request_prompt(i, r, 0, 128256) for i, r in enumerate(reqs)]
    assert [len(p) for p in prompts] == [p for _, p, _, _ in real]
    for i, (*_, cached) in enumerate(real):
        earlier = prompts[:i]
        # what the real radix cache held for request i is the head of an earlier prompt here, and no more
        assert cached == 0 or any(e[:cached] == prompts[i][:cached] for e in earlier), i
        assert not any(e[: cached + 1] == prompts[i][: cached + 1] for e in earlier), i
    fit_vocab(reqs, 1000)
    small = [list(r.prompt_ids) for r in reqs]
    assert max(map(max, small)) < 1000 and small[1][:50] == small[0][:50]


def test_sim_run_on_another_hardware_hits_the_cache_as_the_recorded_engine_did(capsys):
    from workbench.cli import main

    real = _recorded_finishes(SERVE_RECORD)
    rc = main(["sim", "run", "--workload", str(SERVE_RECORD), "--simulate", "h100", "--model", "llama-3.1-8b"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "SIMULATED h100x1, llama-3.1-8b: 5 requests" in out
    hit = float(out.split("cache hit ")[1].split("%")[0])
    assert hit == pytest.approx(100 * sum(c for *_, c in real) / sum(p for _, p, _, _ in real), abs=1.5)
