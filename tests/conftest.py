"""Shared fixtures: the real default model, loaded once per test session."""

from __future__ import annotations

import inspect
import os
import re
import time

import pytest
import torch

# Tests run on 2 cores; keep torch from oversubscribing when several processes run.
torch.set_num_threads(min(2, os.cpu_count() or 1))
# Every scheduler the tests start checks its KV bookkeeping whenever it goes idle
# (core/managers/scheduler_kv_check.py); assert_no_kv_leak reads the outcome.
os.environ.setdefault("WORKBENCH_KV_INVARIANT_CHECK", "1")


@pytest.fixture(scope="session")
def default_prepared():
    from workbench.core.model_loader import prepare_model

    return prepare_model(None, progress=False)


@pytest.fixture(scope="session")
def tokenizer(default_prepared):
    from workbench.core.model_loader import load_tokenizer

    return load_tokenizer(default_prepared.model_dir)


@pytest.fixture(scope="session")
def runner_fp32(default_prepared):
    from workbench.core.args import ServerArgs
    from workbench.core.model_executor.model_runner import ModelRunner

    return ModelRunner(
        ServerArgs(dtype="float32", max_total_tokens=16384, show_progress=False), prepared=default_prepared
    )


@pytest.fixture(scope="session")
def hf_model(default_prepared):
    """transformers' own Llama on the same (converted) weights: the reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_prepared.model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    return model.eval()


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if not isinstance(ids, list) else ids)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A private converted-model cache for the module, so nothing lands in the user's home."""
    path = tmp_path_factory.mktemp("workbench-cache")
    patcher = pytest.MonkeyPatch()
    patcher.setenv("WORKBENCH_CACHE_DIR", str(path))
    yield path
    patcher.undo()


def hf_greedy_from_dir(model_dir, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy `generate` of `n` tokens for each prompt, the model loaded from `model_dir`
    with its plain ("eager") attention, which applies Gemma 2's soft cap (SDPA cannot)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p) :].tolist() for p in prompts
        ]


_HF_MEMO: dict = {}


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation (memoized per session: several modules ask for the same)."""
    key = (id(model), tuple(prompt), max_new_tokens)
    if key not in _HF_MEMO:
        # A longer memoized continuation of the same prompt already contains this one.
        for (mid, p, n), toks in _HF_MEMO.items():
            if mid == id(model) and p == key[1] and n >= max_new_tokens:
                return toks[:max_new_tokens]
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
        _HF_MEMO[key] = out[0, len(prompt) :].tolist()
    return _HF_MEMO[key]


# ==== two tiers: `make test` (fast) and `make test-full` (everything CI runs) ======================
# A test is end-to-end (marker `e2e`, left out of `make test`) when it is in one of these files or
# listed below, uses the reference-model fixtures, or when it or any fixture it uses starts an
# Engine, a server or another process (`pytest_collection_modifyitems` reads their source).
# `@pytest.mark.e2e` marks one by hand; `@pytest.mark.fast` keeps a quick subprocess test (ruff) in the
# fast tier. The rest (unit tests, the in-process scheduler tests, kernels, tiny models) is the fast tier.
E2E_FILES = {
    "test_browser_dashboard.py",
    "test_notebooks.py",
    "test_tui_tmux.py",  # browser, kernels, tmux
    "test_reliability_load.py",
    "test_reliability_faults.py",
    "test_fuzz_http.py",  # load, faults, fuzz
    "test_tensor_parallel.py",
    "test_served_peer.py",
    "test_llamacpp_peer.py",  # TP, peers
}
# Fixtures that load the real model beside transformers' reference (minutes on a busy 2-core machine).
E2E_FIXTURES = {"hf_model", "runner_fp32"}
# Single tests that measured over 10 s in the fast tier (tests --durations, load ~6 on 2 cores).
E2E_TESTS = {
    "test_cpu_ops.py::test_bfloat16_greedy_tokens_are_unchanged_by_the_compiled_rope",
    "test_gpu_only.py::test_selftest_cpu_dry_run",
    "test_cuda_graph.py::test_greedy_tokens_with_graphs_equal_eager",
    "test_cuda_graph.py::test_bench_compare_compile_runs_end_to_end",
    "test_detokenizer.py::test_bad_model_dir_reports_error_and_exits",
    "test_model_loader.py::test_converted_weights_equal_transformers_gguf_loader",
    "test_http_server.py::test_shutdown_stops_unfinished_requests_with_an_error_event_and_says_so",
    "test_http_server.py::test_startup_answers_503_until_ready",
    "test_trace_mode.py::test_bench_trace_quick_prints_every_mode_and_its_accounted_cost",
    "test_triton_backend.py::test_triton_backend_runs_a_model_like_torch_native",
    "test_engine_script.py::test_the_same_script_with_the_guard_runs",
    "test_engine_script.py::test_a_script_without_the_main_guard_fails_with_one_line",
}
_E2E_SOURCE = re.compile(r"(?<![A-Za-z])[Ee]ngine\(|start_server\(|subprocess|Popen\(|sys\.executable")
_T0 = time.time()
_LOAD0 = os.getloadavg() if hasattr(os, "getloadavg") else None


def _process_start() -> float:
    """Wall-clock start of this process (Linux), else when this file was imported."""
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _T0


def _starts_processes(obj, cache: dict) -> bool:
    if obj not in cache:
        try:
            # The body only: a fixture called `engine` is not a reason, what it does is.
            src = re.split(r"^\s*(?:async\s+)?def [^\n]*\n", inspect.getsource(obj), maxsplit=1, flags=re.M)[-1]
        except (OSError, TypeError):
            src = ""
        cache[obj] = bool(_E2E_SOURCE.search(src))
    return cache[obj]


def pytest_configure(config):
    # Registered here rather than in pyproject.toml: editing that file makes `make` reinstall the venv.
    config.addinivalue_line(
        "markers",
        "e2e: end to end (engines, servers, processes, notebooks, browser, "
        "tmux): only in the full tier (make test-full); tests/conftest.py marks them",
    )
    config.addinivalue_line("markers", "fast: in the fast tier although it runs a subprocess (a quick tool, e.g. ruff)")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    cache: dict = {}
    for item in items:
        if item.get_closest_marker("e2e") is not None or item.get_closest_marker("fast") is not None:
            continue
        e2e = (
            item.path.name in E2E_FILES
            or f"{item.path.name}::{getattr(item, 'originalname', item.name)}" in E2E_TESTS
            or bool(E2E_FIXTURES & set(getattr(item, "fixturenames", ())))
        )
        if not e2e and getattr(item, "function", None) is not None:
            e2e = _starts_processes(item.function, cache)
            infos = getattr(item, "_fixtureinfo", None)
            for defs in infos.name2fixturedefs.values() if infos else ():
                if e2e:
                    break
                e2e = any(_starts_processes(d.func, cache) for d in defs if d.baseid)
        if e2e:
            item.add_marker(pytest.mark.e2e)


def _tier(config) -> str:
    expr = (config.getoption("markexpr", "") or "").replace('"', "").replace("'", "").strip()
    whole = all(os.path.basename(str(a).rstrip("/")) == "tests" for a in config.args)
    if whole and expr == "not e2e and not soak":
        return "fast tier (make test)"
    if whole and expr in ("", "not soak"):
        return "full tier (make test-full)"
    return "this selection"


def pytest_terminal_summary(terminalreporter):
    """The run's wall time and tier (and the load beside it), then the reliability figures."""
    import sys

    wall = time.time() - _process_start()
    n = sum(len(terminalreporter.stats.get(k, [])) for k in ("passed", "failed", "error", "skipped"))
    load = "?" if _LOAD0 is None else f"{_LOAD0[0]:.1f} at start, {os.getloadavg()[0]:.1f} at the end"
    terminalreporter.write_sep(
        "=",
        f"{_tier(terminalreporter.config)}: {n} tests in {wall / 60:.1f} min "
        f"({wall:.0f} s wall); load average {load}; {os.cpu_count()} cores",
    )
    rel = sys.modules.get("reliability_helpers")
    if rel is None or not any(rel.STATS.values()):
        return
    failed = [
        r
        for key in ("failed", "error")
        for r in terminalreporter.stats.get(key, [])
        if any(f in r.nodeid for f in rel.RELIABILITY_FILES)
    ]
    s = rel.STATS
    terminalreporter.write_sep("=", "Reliability")
    terminalreporter.write_line(
        f"requests {s['requests']} | faults injected {s['faults']} | fuzz cases {s['fuzz_cases']} | "
        f"unexpected outcomes {s['unexpected']} | failures {len(failed)}"
    )
