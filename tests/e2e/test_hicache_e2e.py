"""HiCache with a real Engine (default model, float32): a prompt pushed off a small device KV pool
comes back from the host tier. Its prompt tokens count as cached (meta_info.cached_tokens) and its
greedy output equals the first run's, which computed everything (so equals recomputing it); the KV
check, both tiers, finds nothing wrong."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("default_prepared")

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def test_prompt_evicted_from_device_comes_back_from_host():
    from workbench import Engine

    prompt_a = [1] + [300 + (i * 7) % 900 for i in range(120)]
    others = [[1] + [1500 + j * 200 + (i * 11) % 150 for i in range(120)] for j in range(3)]
    with Engine(
        dtype="float32",
        max_total_tokens=300,
        enable_hierarchical_cache=True,
        hicache_ratio=4.0,
        hicache_write_policy="write_back",
        enable_kv_invariant_check=True,
        show_progress=False,
    ) as engine:
        first = engine.generate(input_ids=prompt_a, sampling_params=GREEDY)
        for p in others:  # 3 x 128 tokens through a 300-token device pool: A is written back to host
            engine.generate(input_ids=p, sampling_params=GREEDY)
        again = engine.generate(input_ids=prompt_a, sampling_params=GREEDY)
        state = engine.get_internal_state()
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == len(prompt_a) - 1, again["meta_info"]
    assert again["output_ids"] == first["output_ids"]
    assert not state.get("kv_check_error"), state.get("kv_check_error")


def test_file_tier_serves_a_prompt_after_a_restart(tmp_path, monkeypatch):
    from workbench.core.mem_cache.hicache_storage import STORAGE_DIR_ENV, STORAGE_PAGE_SIZE

    from workbench import Engine

    monkeypatch.setenv(STORAGE_DIR_ENV, str(tmp_path))
    prompt = [1] + [300 + (i * 7) % 900 for i in range(120)]
    args = dict(
        dtype="float32",
        max_total_tokens=300,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_prefetch_policy="wait_complete",
        enable_kv_invariant_check=True,
        show_progress=False,
    )
    with Engine(**args) as engine:
        first = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert list(tmp_path.rglob("*.pt")), "no page was written"
    with Engine(**args) as engine:  # a new engine: empty device and host tiers, the same directory
        again = engine.generate(input_ids=prompt, sampling_params=GREEDY)
        state = engine.get_internal_state()
    assert first["meta_info"]["cached_tokens"] == 0
    # whole pages of the 120 tokens a match may use
    assert again["meta_info"]["cached_tokens"] == (len(prompt) - 1) // STORAGE_PAGE_SIZE * STORAGE_PAGE_SIZE
    assert again["output_ids"] == first["output_ids"]
    assert not state.get("kv_check_error"), state.get("kv_check_error")


def test_bench_hicache_quick_prints_the_table(capsys):
    from workbench.cli import build_parser

    args = build_parser().parse_args(["bench", "hicache", "--quick", "--dtype", "float32"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "| prompt tokens | recompute | device hit | host hit | load-back ms |" in out
    assert "not served from host" not in out  # every host-hit row reported its prompt as cached
