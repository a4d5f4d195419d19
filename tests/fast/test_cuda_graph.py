"""The CUDA-graph runner's whole flow on CPU, through the stand-in graph mechanism.

The stand-in records the decode step's callable at capture and re-runs it at
replay into the same output tensor, so everything around the graph is real:
bucket choice, static input buffers, padding rows that touch only the scratch
KV slot, the attention backend's capture/replay hooks, output slicing, and the
eager fallback. Greedy tokens on the default model must equal eager decoding.

The end-to-end tests of this module are in tests/e2e/test_cuda_graph_e2e.py.
"""

from __future__ import annotations

import pytest
import torch
from workbench.core.model_executor.cuda_graph_runner import (
    CudaGraphRunner,
    StandInGraphMechanism,
    StaticDecodeBuffers,
    get_cuda_graph_batch_sizes,
    maybe_create_cuda_graph_runner,
)
from workbench.core.model_executor.forward_batch_info import ForwardBatch, ForwardMode


# ---- buckets and buffers --------------------------------------------------------------------
def test_default_cuda_graph_batch_sizes():
    assert get_cuda_graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert get_cuda_graph_batch_sizes(50) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 50]
    assert get_cuda_graph_batch_sizes(3) == [1, 2, 3]
    assert get_cuda_graph_batch_sizes(1) == [1]
    assert get_cuda_graph_batch_sizes(16, [12, 3, 3, 40]) == [3, 12]  # --cuda-graph-bs, capped
    with pytest.raises(ValueError, match="cuda-graph-max-bs"):
        get_cuda_graph_batch_sizes(0)
    with pytest.raises(ValueError, match="exceeds"):
        get_cuda_graph_batch_sizes(4, [8, 16])
    with pytest.raises(ValueError, match="at least 1"):
        get_cuda_graph_batch_sizes(4, [0, 2])


def test_server_args_validate_graph_flags():
    from workbench.core.args import ServerArgs

    with pytest.raises(ValueError, match="cuda-graph-max-bs"):
        ServerArgs(cuda_graph_max_bs=0)
    with pytest.raises(ValueError, match="cuda-graph-bs"):
        ServerArgs(cuda_graph_bs=[1, -2])


def _decode_fb(ids, pos, rows, lens, locs):
    bs = len(ids)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=bs,
        input_ids=torch.tensor(ids),
        positions=torch.tensor(pos),
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(lens),
        out_cache_loc=torch.tensor(locs),
        seq_lens_cpu=list(lens),
        extend_seq_lens_cpu=[1] * bs,
        extend_prefix_lens_cpu=[ln - 1 for ln in lens],
    )


def test_static_buffers_load_and_pad():
    buf = StaticDecodeBuffers.allocate(8, "cpu", pad_row=9)
    assert buf.req_pool_indices.tolist() == [9] * 8 and buf.seq_lens.tolist() == [1] * 8
    lens = buf.load(_decode_fb([11, 12, 13], [4, 7, 2], [0, 3, 5], [5, 8, 3], [21, 22, 23]), bucket=4)
    assert lens == [5, 8, 3, 1]
    assert buf.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buf.positions[:4].tolist() == [4, 7, 2, 0]
    assert buf.req_pool_indices[:4].tolist() == [0, 3, 5, 9]  # the padding row
    assert buf.out_cache_loc[:4].tolist() == [21, 22, 23, 0]  # padding writes the scratch slot
    # a smaller batch next: stale rows from the previous one become padding again
    buf.load(_decode_fb([30], [1], [2], [2], [40]), bucket=2)
    assert buf.input_ids[:2].tolist() == [30, 0] and buf.out_cache_loc[:2].tolist() == [40, 0]
    assert buf.req_pool_indices[:2].tolist() == [2, 9] and buf.seq_lens[:2].tolist() == [2, 1]


# ---- the runner on the default model -------------------------------------------------------------
@pytest.fixture(scope="module")
def runner(default_prepared):
    from workbench.core.args import ServerArgs
    from workbench.core.model_executor.model_runner import ModelRunner

    r = ModelRunner(
        ServerArgs(dtype="float32", max_total_tokens=2048, max_running_requests=8, show_progress=False),
        prepared=default_prepared,
    )
    assert r.graph_runner is None  # CPU: no CUDA graphs unless a test attaches one
    return r


@pytest.fixture(scope="module")
def graph_runner(runner):
    return CudaGraphRunner(runner, [1, 2, 4], StandInGraphMechanism())


def test_capture_shows_progress_and_times(graph_runner, capsys):
    graph_runner.capture(progress=True)
    err = capsys.readouterr().err
    assert "capture stand-in graph bs=4" in err and "captured 3 decode graphs" in err
    assert sorted(graph_runner.capture_time_s) == [1, 2, 4]
    assert all(t > 0 for t in graph_runner.capture_time_s.values())


def test_eager_or_graph_decision(graph_runner, runner):
    assert [graph_runner.bucket_for(b) for b in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]
    dec = _decode_fb([1, 2, 3], [1, 1, 1], [0, 1, 2], [2, 2, 2], [5, 6, 7])
    assert graph_runner.can_run(dec)
    dec.return_all_logits = True
    assert not graph_runner.can_run(dec)  # all-position logits: eager
    big = _decode_fb([1] * 5, [1] * 5, [0] * 5, [2] * 5, [5] * 5)
    assert not graph_runner.can_run(big)  # above the largest bucket: eager
    ext = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=1,
        input_ids=torch.tensor([1, 2]),
        positions=torch.tensor([0, 1]),
        req_pool_indices=torch.tensor([0]),
        seq_lens=torch.tensor([2]),
        out_cache_loc=torch.tensor([5, 6]),
        seq_lens_cpu=[2],
        extend_seq_lens_cpu=[2],
        extend_prefix_lens_cpu=[0],
    )
    assert not graph_runner.can_run(ext)  # extend: eager
    with pytest.raises(ValueError, match="eagerly"):
        graph_runner.replay(big)
    # what the trace reports (batch.step's cuda_graph / padded_size)
    runner.graph_runner = graph_runner
    try:
        assert runner.graph_plan(ForwardMode.DECODE, 3) == (True, 4)
        assert runner.graph_plan(ForwardMode.DECODE, 5) == (False, 5)
        assert runner.graph_plan(ForwardMode.EXTEND, 2) == (False, 2)
    finally:
        runner.graph_runner = None


def test_padding_rows_write_only_the_scratch_slot(graph_runner, runner):
    """A 3-row batch replays bucket 4: the dummy row may write slot 0 and nothing else."""
    pool, table = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
    rows = runner.req_to_token_pool.alloc(3)
    try:
        g = torch.Generator().manual_seed(0)
        for layer in (0, pool.layer_num - 1):
            pool.k_buffer[layer][1:60].copy_(torch.randn(pool.k_buffer[layer][1:60].shape, generator=g))
        lens = [4, 9, 6]
        slot, locs = 1, []
        for row, n in zip(rows, lens):
            table[row, :n] = torch.arange(slot, slot + n)
            locs.append(slot + n - 1)
            slot += n
        before = [b.clone() for b in pool.k_buffer]
        fb = _decode_fb([100, 200, 300], [n - 1 for n in lens], rows, lens, locs)
        fb.req_to_token_pool, fb.token_to_kv_pool = runner.req_to_token_pool, pool
        fb.attn_backend = runner.attn_backend
        n_before = graph_runner.replay_count[4]
        with torch.inference_mode():
            logits = graph_runner.replay(fb)
        assert graph_runner.replay_count[4] == n_before + 1
        assert logits.shape == (3, runner.model_config.vocab_size)
        for layer, old in enumerate(before):
            changed = (pool.k_buffer[layer] != old).flatten(1).any(1).nonzero().flatten().tolist()
            assert set(changed) <= {0, *locs}, (layer, changed)
            assert set(locs) <= set(changed)
        assert table[graph_runner.buffers.pad_row].abs().sum() == 0  # the padding row is all slot 0
    finally:
        runner.req_to_token_pool.free(rows)


def test_no_graphs_on_cpu_and_real_graphs_refuse_torch_native(runner):
    assert maybe_create_cuda_graph_runner(runner) is None  # CPU never captures real graphs

    class _RealGraphsName:  # only the name matters: the check happens before any capture
        name = "cuda"

    with pytest.raises(ValueError, match="cannot be captured"):
        CudaGraphRunner(runner, [1], _RealGraphsName())


# ---- what the views show --------------------------------------------------------------------------
def test_dashboard_hover_names_graph_or_eager_and_the_backend():
    pytest.importorskip("plotly")
    pytest.importorskip("ipywidgets")
    from workbench.core.trace import events as ev
    from workbench.core.trace.state import TraceState
    from workbench.widgets import BatchView

    evs = [
        ev.BatchStep(
            ts=10**9 + i * 10**7,
            proc="scheduler",
            step=i,
            mode="decode",
            reqs=[ev.StepReq("a", 0, 0, 1), ev.StepReq("b", 0, 0, 1), ev.StepReq("c", 0, 0, 1)],
            batch_size=3,
            padded_size=4 if i else 3,
            cuda_graph=bool(i),
            backend="triton",
            forward_ms=2.0,
        )
        for i in range(2)
    ]
    st = TraceState()
    st.apply_many(evs)
    hover = BatchView(st).figure.data[0].customdata
    assert hover[0] == "decode, batch 3 (padded 3), eager, triton"
    assert hover[1] == "decode, batch 3 (padded 4), CUDA graph, triton"


async def test_tui_batch_panel_shows_graph_badge_and_backend(tmp_path):
    """The recorded TUI fixture replayed as if from a GPU run: decode steps replayed graphs on flashinfer."""
    import json

    pytest.importorskip("textual")
    from tui_helpers import FIXTURE, replay_app, show_at

    lines = []
    for line in open(FIXTURE):
        e = json.loads(line)
        if e.get("kind") == "batch.step":
            e["backend"] = "flashinfer"
            e["cuda_graph"] = e["mode"] == "decode"
        lines.append(json.dumps(e))
    path = tmp_path / "gpu_trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    app, replay = replay_app(str(path), panels=["batch"])
    last = max(e.ts for e in replay.events)
    async with app.run_test(size=(110, 30)) as pilot:
        await show_at(app, pilot, replay, last)
        from textual.widgets import DataTable
        from workbench.tui.panels.batch import BatchPanel

        panel = app.query_one(BatchPanel)
        assert panel.border_title.endswith("· flashinfer")
        table = panel.query_one(DataTable)
        badges = [str(table.get_row_at(i)[3]) for i in range(table.row_count)]
        assert "CG" in badges and "–" in badges  # decode replayed a graph; extend ran eagerly


# ---- speculative verify passes: a fixed number of rows per request -------------------------------
def test_verify_layout_pads_each_request_to_the_graphs_rows():
    from workbench.core.model_executor.cuda_graph_verify import verify_layout

    lay = verify_layout([3, 1, 5], tokens_per_req=5, bucket=4)
    assert lay.dest == [0, 1, 2, 5, 10, 11, 12, 13, 14] and lay.last == [2, 5, 14] and lay.num_tokens == 20
    with pytest.raises(ValueError, match="1..5"):
        verify_layout([6], tokens_per_req=5, bucket=1)
    with pytest.raises(ValueError, match="do not fit"):
        verify_layout([1, 1, 1], tokens_per_req=2, bucket=2)


def test_static_verify_buffers_load_and_pad():
    """Real rows land at request * k + j; the rest read token 0 and write the scratch slot 0; padding
    requests have no prefix and the reserved row; the kernel metadata is each request's prefix."""
    from workbench.core.model_executor.cuda_graph_verify import StaticVerifyBuffers, verify_layout
    from workbench.core.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    buf = StaticVerifyBuffers.allocate(max_bs=4, tokens_per_req=3, device="cpu", pad_row=9)
    buf.input_ids.fill_(77)  # stale values from an earlier replay must not survive
    fb = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY,
        batch_size=2,
        input_ids=torch.tensor([11, 12, 21, 22, 23]),
        positions=torch.tensor([4, 5, 7, 8, 9]),
        req_pool_indices=torch.tensor([3, 1]),
        seq_lens=torch.tensor([6, 10]),
        out_cache_loc=torch.tensor([50, 51, 60, 61, 62]),
        seq_lens_cpu=[6, 10],
        extend_seq_lens_cpu=[2, 3],
        extend_prefix_lens_cpu=[4, 7],
        return_all_logits=True,
    )
    lay = verify_layout([2, 3], 3, bucket=4)
    seq_lens_cpu, prefix_cpu = buf.load(fb, lay, torch.tensor(lay.dest))
    assert buf.input_ids[:12].tolist() == [11, 12, 0, 21, 22, 23, 0, 0, 0, 0, 0, 0]
    assert buf.out_cache_loc[:12].tolist() == [50, 51, 0, 60, 61, 62, 0, 0, 0, 0, 0, 0]
    assert buf.positions[:12].tolist()[:2] + buf.positions[3:12].tolist() == [4, 5, 7, 8, 9, 0, 1, 2, 0, 1, 2]
    assert buf.req_pool_indices.tolist() == [3, 1, 9, 9] and buf.prefix_lens.tolist() == [4, 7, 0, 0]
    assert buf.seq_lens.tolist() == [7, 10, 3, 3] and seq_lens_cpu == [7, 10, 3, 3] and prefix_cpu == [4, 7, 0, 0]
    assert buf.extend_lens.tolist() == [3] * 4 and buf.extend_start_loc.tolist() == [0, 3, 6, 9]


def test_verify_graphs_equal_the_eager_verify_pass(runner):
    """A verify batch through the stand-in verify graph: the real rows' logits equal the eager
    pass's, and a batch above the largest bucket is left to the eager path."""
    import dataclasses

    from workbench.core.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    graphs = CudaGraphRunner(runner, [1, 2, 4], StandInGraphMechanism())
    assert graphs.verify_tokens_per_req == 0  # no speculative decoding: decode graphs only
    spec_args = dataclasses.replace(runner.server_args, speculative_algorithm="NGRAM", speculative_num_draft_tokens=3)
    saved = runner.server_args
    runner.server_args = spec_args
    try:
        graphs = CudaGraphRunner(runner, [1, 2, 4], StandInGraphMechanism())
    finally:
        runner.server_args = saved
    assert graphs.verify_tokens_per_req == 4
    graphs.capture()
    assert sorted(graphs.verify_graphs) == [1, 2, 4]
    pool, alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
    prompts, drafts = [[1, 504, 3458, 314, 260], [1, 1066, 1745]], [[28, 2], []]
    rows = pool.alloc(2)
    try:
        # Prefill the prompts, then build one verify batch: last prompt token + drafts per request.
        for row, p in zip(rows, prompts):
            loc = alloc.alloc(len(p))
            pool.req_to_token[row, : len(p)] = loc
            n = len(p)
            runner.forward(
                ForwardBatch(
                    forward_mode=ForwardMode.EXTEND,
                    batch_size=1,
                    input_ids=torch.tensor(p),
                    positions=torch.arange(n),
                    req_pool_indices=torch.tensor([int(row)]),
                    seq_lens=torch.tensor([n]),
                    out_cache_loc=loc,
                    seq_lens_cpu=[n],
                    extend_seq_lens_cpu=[n],
                    extend_prefix_lens_cpu=[0],
                )
            )
        ids, pos, locs, prefix, n_rows = [], [], [], [], []
        for row, p, d in zip(rows, prompts, drafts):
            n = 1 + len(d)
            loc = alloc.alloc(n)
            pool.req_to_token[row, len(p) : len(p) + n] = loc
            ids += [p[-1]] + d
            pos += list(range(len(p), len(p) + n))
            locs.append(loc)
            prefix.append(len(p))
            n_rows.append(n)

        def batch():
            return ForwardBatch(
                forward_mode=ForwardMode.TARGET_VERIFY,
                batch_size=2,
                input_ids=torch.tensor(ids),
                positions=torch.tensor(pos),
                req_pool_indices=torch.tensor(rows, dtype=torch.int64),
                seq_lens=torch.tensor([p + n for p, n in zip(prefix, n_rows)]),
                out_cache_loc=torch.cat(locs),
                seq_lens_cpu=[p + n for p, n in zip(prefix, n_rows)],
                extend_seq_lens_cpu=n_rows,
                extend_prefix_lens_cpu=prefix,
                return_all_logits=True,
                req_to_token_pool=pool,
                token_to_kv_pool=runner.token_to_kv_pool,
                attn_backend=runner.attn_backend,
            )

        assert graphs.can_run(batch()) and graphs.plan(ForwardMode.TARGET_VERIFY, 5) is None
        with torch.inference_mode():
            all_rows, last = graphs.replay_verify(batch())
            assert graphs.verify_replay_count[2] == 1
            eager = batch()
            runner.attn_backend.init_forward_metadata(eager)
            want = runner.model.compute_logits(runner.model(eager.input_ids, eager.positions, eager))
        assert all_rows.shape == want.shape == (4, want.shape[1])
        torch.testing.assert_close(all_rows, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(last, want[[2, 3]], rtol=1e-4, atol=1e-4)
        for loc in locs:
            alloc.free(loc)
    finally:
        for row, p in zip(rows, prompts):
            alloc.free(pool.req_to_token[row, : len(p)].clone())
        pool.free(rows)
