"""The CPU weights and KV pool in one mapping advised for transparent huge pages
(core/mem_cache/huge_pages.py): the values, shapes and Parameter objects stay, only the storage moves;
the switch turns it off; the model's greedy tokens are those of ordinary pages."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_llama
from workbench.core.mem_cache import huge_pages
from workbench.core.mem_cache.memory_pool import MHATokenToKVPool

needs_thp = pytest.mark.skipif(
    bool(huge_pages.unavailable_reason()), reason=f"huge pages unavailable here: {huge_pages.unavailable_reason()}"
)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(300, 700), torch.nn.LayerNorm(700), torch.nn.Linear(700, 5, bias=False))
    m[0].weight.data = m[0].weight.data.to(torch.bfloat16)  # mixed dtypes share the mapping
    for p in m.parameters():
        p.requires_grad_(False)
    return m


@needs_thp
def test_parameters_move_into_one_huge_page_mapping_with_their_values():
    model = _model()
    params = list(model.parameters())
    before = [(p.detach().clone(), p.data_ptr()) for p in params]
    done = huge_pages.rehome_parameters(model)
    assert not done.skipped
    assert list(model.parameters()) == params  # the same Parameter objects
    assert done.bytes == sum(p.numel() * p.element_size() for p in params)
    ptrs = sorted(p.data_ptr() for p in params)
    assert ptrs[0] % huge_pages.HUGE == 0  # the mapping's first tensor starts a 2 MiB page
    assert all(ptr % huge_pages.ALIGN == 0 for ptr in ptrs)
    assert ptrs[-1] - ptrs[0] < done.bytes  # one mapping, packed
    for p, (value, ptr) in zip(params, before):
        assert p.data_ptr() != ptr
        assert p.dtype == value.dtype and torch.equal(p, value)
    # the kernel backs it with huge pages as far as it could get them (the machine may be fragmented)
    assert done.huge_bytes is None or 0 <= done.huge_bytes <= done.bytes
    assert "huge pages" in done.describe()
    with torch.no_grad():
        params[0].add_(1)  # writable, like any parameter (weight updates copy into it)
    assert torch.equal(params[0], before[0][0] + 1)


def test_the_switch_and_an_unadvisable_machine_leave_the_weights_where_they_are(monkeypatch, tmp_path):
    model = _model()
    ptrs = [p.data_ptr() for p in model.parameters()]
    monkeypatch.setenv(huge_pages.ENV, "0")
    done = huge_pages.rehome_parameters(model)
    assert done.skipped == f"{huge_pages.ENV}=0" and done.bytes == 0
    assert "ordinary pages" in done.describe()
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    monkeypatch.delenv(huge_pages.ENV)
    never = tmp_path / "enabled"
    never.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_SETTING", never)
    assert "[never]" in huge_pages.unavailable_reason()
    pool = MHATokenToKVPool(64, torch.bfloat16, 2, 16, 3)
    assert all(torch.count_nonzero(b) == 0 for b in pool.k_buffer + pool.v_buffer)  # torch.zeros fallback


@needs_thp
def test_the_kv_pool_lies_in_one_mapping_zeroed_and_disjoint():
    pool = MHATokenToKVPool(1000, torch.bfloat16, 3, 64, 4)
    bufs = pool.k_buffer + pool.v_buffer
    assert all(b.shape == (1001, 3, 64) and b.dtype == torch.bfloat16 for b in bufs)
    assert all(torch.count_nonzero(b) == 0 for b in bufs)
    assert bufs[0].data_ptr() % huge_pages.HUGE == 0
    for i, b in enumerate(bufs):
        b.fill_(i + 1)
    assert [int(b[0, 0, 0]) for b in bufs] == list(range(1, len(bufs) + 1))  # no two overlap
    assert [int(b[-1, -1, -1]) for b in bufs] == list(range(1, len(bufs) + 1))


@needs_thp
def test_greedy_tokens_on_huge_pages_equal_those_on_ordinary_pages(tmp_path, monkeypatch):
    from workbench.core.args import ServerArgs
    from workbench.core.model_executor.model_runner import ModelRunner
    from workbench.core.model_executor.offline_harness import OfflineHarness
    from workbench.core.sampling.sampling_params import SamplingParams

    model_dir = make_tiny_llama(tmp_path / "m", seed=3)
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]

    def run():
        runner = ModelRunner(ServerArgs(model_path=str(model_dir), dtype="float32", max_total_tokens=512))
        out = OfflineHarness(runner).generate(prompts, sp, return_logprob=True)
        return runner, [(r.output_ids, r.logprobs) for r in out]

    runner, huge = run()
    assert not runner.huge_pages.skipped
    home = runner.huge_pages
    ptr = runner.model.model.layers[0].self_attn.qkv_proj.weight.data_ptr()
    assert home.address <= ptr < home.address + home.bytes
    monkeypatch.setenv(huge_pages.ENV, "0")
    plain_runner, plain = run()
    assert plain_runner.huge_pages.skipped
    assert huge == plain
