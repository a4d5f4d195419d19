"""Tensor parallelism on CPU (gloo): real scheduler ranks, real models, transformers as the reference.

- `--tp-size 3` on the default model (9 query / 3 KV heads) gives transformers' greedy tokens;
- `--tp-size 2` on a tiny random Llama over one node, and on a tiny Qwen2 (q/k/v biases)
  over two "nodes" on loopback (`workbench serve` twice);
- TP sizes that cannot split the heads, and bad multi-node flags, are rejected up front;
- weight updates at TP 3 from a trainer written the OpenRLHF/SGLang way (torch only), and at TP 2
  from the project's own `TrainerWeightSync`: a trainer process broadcasts to every rank, `get_weights_by_name`
  returns the gathered full tensor, `update_weights_from_disk` loads every rank's shard.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import pytest
import torch
from conftest import chat_ids, hf_greedy
from test_weight_updates_e2e import free_port, trainer_group_process
from tiny_models import make_tiny_family, make_tiny_llama, make_tiny_qwen2
from workbench.core.args import ServerArgs
from workbench.core.engine import Engine

NEW = 16
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
TINY_PROMPTS = [[5, 17, 99, 3], [200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 10, 11], [42]]
GROUP = "tp_weight_sync"


@torch.no_grad()
def hf_tokens(model_dir, prompts, new_weights: dict | None = None) -> list[list[int]]:
    """transformers' greedy continuations of `prompts` (optionally with some weights replaced)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for name, t in (new_weights or {}).items():
        model.get_parameter(name).copy_(t)
    return [
        model.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)[
            0, len(p) :
        ].tolist()
        for p in prompts
    ]


def greedy(engine, prompts) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]


# ---- the default model at TP 3 ------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_tp3(default_prepared):
    with Engine(dtype="float32", tp_size=3, max_total_tokens=2048, show_progress=False) as engine:
        yield engine


@pytest.fixture(scope="module")
def tp3_prompts(tokenizer):
    return [chat_ids(tokenizer, t) for t in ("What is 2+2?", "Name a primary color.")]


def test_tp3_default_model_equals_reference(default_tp3, tp3_prompts, hf_model):
    engine, prompts = default_tp3, tp3_prompts
    out = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    info = engine.get_server_info()
    # KV split by heads: 3 KV heads over 3 ranks is one per rank (rank 0 reports its own pool).
    assert engine.scheduler_info["kv_head_num"] == 1 and engine.scheduler_info["tp_size"] == 3
    # A second, prefix-sharing request exercises the radix cache across ranks.
    again = engine.generate(input_ids=prompts[0], sampling_params=GREEDY)
    assert {"scheduler", "scheduler-tp1", "scheduler-tp2", "detokenizer"} <= set(info["pids"])
    for p, o in zip(prompts, out):
        assert o["output_ids"] == hf_greedy(hf_model, p, NEW, hint=o["output_ids"])  # hint: one forward, not 16
    assert again["output_ids"] == out[0]["output_ids"] and again["meta_info"]["cached_tokens"] > 0


def test_tp3_a_trainer_written_the_openrlhf_way_updates_every_rank(
    default_tp3, tp3_prompts, default_prepared, hf_model
):
    """World of 4: the trainer (rank 0, torch only) and TP ranks 1-3, each keeping its shard."""
    from openrlhf_trainer import trainer_main
    from safetensors import safe_open
    from safetensors.torch import load_file
    from test_weight_updates_e2e import hf_greedy_with, perturbed

    engine, prompts, model_dir = default_tp3, tp3_prompts, Path(default_prepared.model_dir)
    original = load_file(str(model_dir / "model.safetensors"))
    new = perturbed(original)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = sorted(f.keys())
        shapes = [f.get_slice(n).get_shape() for n in names]
    baseline = greedy(engine, prompts)
    port = free_port()
    args = (str(model_dir), port, 4, GROUP, "test_weight_updates_e2e:perturbed", 90.0)
    with trainer_group_process(trainer_main, args) as result_q:
        out = engine.init_weights_update_group("127.0.0.1", port, 1, 4, GROUP, "gloo", timeout_s=90)
        assert "rank 1 of 4" in out["message"]
        out = engine.update_weights_from_distributed(names, ["float32"] * len(names), shapes, GROUP)
        status, message = result_q.get(timeout=90)
        assert status == "ok", message
        engine.destroy_weights_update_group(GROUP)
    assert out["success"]
    for name, t in new.items():  # gathered across the three ranks' shards
        got = torch.tensor(engine.get_weights_by_name(name, t.numel()))
        assert torch.equal(got, t.flatten()), name
    now = greedy(engine, prompts)
    assert now != baseline
    # transformers with the same weights (EOS not special: the engine ignores it too).
    assert now == hf_greedy_with(hf_model, prompts, new, NEW)


# ---- bad sizes and flags ------------------------------------------------------------------------


def test_bad_tp_sizes_and_node_flags_are_rejected(default_prepared):
    with pytest.raises(
        ValueError,
        match=r"--tp-size 2 does not divide this model's 9 attention heads and 3 "
        r"key/value heads.*one of \[1, 3\]",
    ):
        Engine(tp_size=2, show_progress=False)
    with pytest.raises(ValueError, match="multiple of --nnodes"):
        ServerArgs(tp_size=3, nnodes=2, dist_init_addr="127.0.0.1:29500")
    with pytest.raises(ValueError, match="needs --dist-init-addr"):
        ServerArgs(tp_size=2, nnodes=2)
    with pytest.raises(ValueError, match="HOST:PORT"):
        ServerArgs(tp_size=2, dist_init_addr="localhost")
    with pytest.raises(ValueError, match="runs only scheduler ranks"):
        Engine(tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:29500", show_progress=False)


# ---- tiny Llama at TP 2, with weight updates ----------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    # Untied: a tiny random *tied* Llama mostly repeats its input token, which would test little
    # (the tied vocab-parallel head is covered by the default model at TP 3).
    return make_tiny_llama(tmp_path_factory.mktemp("tp") / "llama", tie_word_embeddings=False)


@pytest.fixture(scope="module")
def llama_tp2(llama_dir):
    with Engine(
        model_path=str(llama_dir), dtype="float32", tp_size=2, max_total_tokens=1024, show_progress=False
    ) as engine:
        yield engine


def test_tp2_tiny_llama_equals_transformers(llama_dir, llama_tp2):
    assert llama_tp2.scheduler_info["kv_head_num"] == 1  # 2 KV heads over 2 ranks
    assert greedy(llama_tp2, TINY_PROMPTS) == hf_tokens(llama_dir, TINY_PROMPTS)
    # Prompt logprobs need the vocab-sharded head gathered over every position.
    out = llama_tp2.generate(
        input_ids=TINY_PROMPTS[1],
        sampling_params=dict(GREEDY, max_new_tokens=1),
        return_logprob=True,
        logprob_start_len=0,
    )
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([TINY_PROMPTS[1]])).logits[0].float()
    expect = torch.log_softmax(logits, -1)[torch.arange(len(TINY_PROMPTS[1]) - 1), TINY_PROMPTS[1][1:]]
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])
    assert torch.allclose(got, expect, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "gemma3"])
def test_tp2_mixture_of_experts_equals_transformers(family, tmp_path):
    """Experts split by intermediate size over 2 ranks; Qwen3's per-head and OLMoE's whole-vector
    q/k norms (the latter summed over ranks); Gemma 3's windowed layers, post-norms and two rotary
    tables with the heads split over ranks."""
    model_dir = make_tiny_family(tmp_path / family, family, seed=31)
    with Engine(
        model_path=str(model_dir), dtype="float32", tp_size=2, max_total_tokens=1024, show_progress=False
    ) as engine:
        assert greedy(engine, TINY_PROMPTS) == hf_tokens(model_dir, TINY_PROMPTS)


@pytest.mark.parametrize("family", ["qwen3_moe"])
def test_tp2_expert_parallel_equals_transformers(family, tmp_path):
    """--ep-size 2: each rank holds half the experts whole (no intermediate split); the all-reduce
    sums each token's experts across ranks. Equal to transformers, and to the sliced layout."""
    model_dir = make_tiny_family(tmp_path / family, family, seed=31)
    with Engine(
        model_path=str(model_dir),
        dtype="float32",
        tp_size=2,
        ep_size=2,
        max_total_tokens=1024,
        show_progress=False,
    ) as engine:
        assert greedy(engine, TINY_PROMPTS) == hf_tokens(model_dir, TINY_PROMPTS)


def test_ep_size_must_divide_tp_size():
    from workbench.core.args import ServerArgs

    with pytest.raises(ValueError, match="must divide --tp-size"):
        ServerArgs(tp_size=2, ep_size=3)


def _perturbed_tiny(state: dict) -> dict:
    g = torch.Generator().manual_seed(7)
    names = (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
        "model.embed_tokens.weight",
    )
    return {n: state[n] + 0.5 * state[n].std() * torch.randn(state[n].shape, generator=g) for n in names}


def _tiny_trainer(model_dir: str, port: int, world_size: int, result_q, done) -> None:
    """Rank 0 of the weight-update group: broadcast every weight, some of them perturbed."""
    from safetensors.torch import load_file
    from workbench.core.managers.weight_updater import TrainerWeightSync

    torch.set_num_threads(1)
    state = load_file(str(Path(model_dir) / "model.safetensors"))
    state.update(_perturbed_tiny(state))
    with TrainerWeightSync("127.0.0.1", port, world_size=world_size, group_name=GROUP, timeout_s=60) as sync:
        result_q.put(sync.broadcast(sorted(state.items())))
        done.wait(60)


def test_tp2_weight_update_from_trainer_reaches_every_rank(llama_dir, llama_tp2):
    from safetensors import safe_open
    from safetensors.torch import load_file

    original = load_file(str(llama_dir / "model.safetensors"))
    new = _perturbed_tiny(original)
    with safe_open(str(llama_dir / "model.safetensors"), framework="pt") as f:
        names = sorted(f.keys())
        shapes = [f.get_slice(n).get_shape() for n in names]
    baseline = greedy(llama_tp2, TINY_PROMPTS)
    port = free_port()
    # A world without room for both ranks is refused before any rank tries to join.
    with pytest.raises(ValueError, match="world_size >= 3"):
        llama_tp2.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, "gloo", timeout_s=5)
    # The trainer's world: itself plus both TP ranks of the server (ranks 1 and 2).
    with trainer_group_process(_tiny_trainer, (str(llama_dir), port, 3)) as result_q:
        out = llama_tp2.init_weights_update_group("127.0.0.1", port, 1, 3, GROUP, "gloo", timeout_s=60)
        assert "rank 1 of 3" in out["message"]
        out = llama_tp2.update_weights_from_distributed(names, [torch.float32] * len(names), shapes, GROUP)
        assert result_q.get(timeout=60) >= 0
        llama_tp2.destroy_weights_update_group(GROUP)
    assert out["success"] and out["version"] >= 1
    # Read back whole: each rank holds half of q/k/up rows, o_proj columns, embedding rows.
    for name, t in new.items():
        got = torch.tensor(llama_tp2.get_weights_by_name(name, t.numel()))
        assert torch.equal(got, t.flatten()), name
    now = greedy(llama_tp2, TINY_PROMPTS)
    assert now != baseline
    assert now == hf_tokens(llama_dir, TINY_PROMPTS, new)


def test_tp2_update_from_disk_and_rejects_mismatch(llama_dir, llama_tp2, tmp_path):
    from safetensors.torch import load_file, save_file

    original = load_file(str(llama_dir / "model.safetensors"))
    ckpt = tmp_path / "ckpt2"
    ckpt.mkdir()
    for f in llama_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, ckpt / f.name)
    scaled = {
        "model.layers.1.self_attn.v_proj.weight": -original["model.layers.1.self_attn.v_proj.weight"],
        "model.layers.0.mlp.down_proj.weight": 1.7 * original["model.layers.0.mlp.down_proj.weight"],
    }
    save_file({**original, **scaled}, str(ckpt / "model.safetensors"))
    out = llama_tp2.update_weights_from_disk(str(ckpt))
    assert out["success"]
    for name, t in scaled.items():
        assert torch.equal(torch.tensor(llama_tp2.get_weights_by_name(name, t.numel())), t.flatten()), name
    now = greedy(llama_tp2, TINY_PROMPTS)
    assert now == hf_tokens(llama_dir, TINY_PROMPTS, scaled)
    # A wrong shape is rejected on every rank and the weights just loaded keep serving.
    with pytest.raises(ValueError, match=r"shape mismatch.*expects \[64, 64\]"):
        llama_tp2.update_weights_from_tensor([("model.layers.0.self_attn.q_proj.weight", torch.zeros(32, 64))])
    assert greedy(llama_tp2, TINY_PROMPTS) == now
    llama_tp2.update_weights_from_disk(str(llama_dir))  # back to the original for later tests
    assert greedy(llama_tp2, TINY_PROMPTS) == hf_tokens(llama_dir, TINY_PROMPTS)


def test_dead_tp_rank_fails_the_engine_instead_of_hanging(llama_tp2):
    """Runs last on this engine: a rank > 0 dies; rank 0 loses its peer, the engine says so."""
    import os
    import signal

    from workbench.core.engine import EngineDeadError

    os.kill(llama_tp2.get_server_info()["pids"]["scheduler-tp1"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while llama_tp2.is_healthy and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not llama_tp2.is_healthy
    with pytest.raises(EngineDeadError, match="scheduler"):
        llama_tp2.generate(input_ids=TINY_PROMPTS[0], sampling_params=GREEDY)


# ---- two "nodes" on loopback --------------------------------------------------------------------


def test_two_node_loopback_launch_serves(tmp_path):
    """`workbench serve` as node 0 (front end + rank 0) and node 1 (rank 1 only), TP 2 over both.

    It also runs the overlap loop, where the message broadcast (scheduler thread) and the model's
    collectives (forward thread) use their two groups at the same time.
    """
    from workbench.core.entrypoints.server_process import ServerProcess

    model_dir = make_tiny_qwen2(tmp_path / "qwen")
    addr = f"127.0.0.1:{free_port()}"
    common = [
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--tp-size",
        "2",
        "--nnodes",
        "2",
        "--dist-init-addr",
        addr,
        "--max-total-tokens",
        "1024",
        "--no-disable-overlap-schedule",
    ]
    node1 = ServerProcess([*common, "--node-rank", "1"], wait=False)
    try:
        with ServerProcess([*common, "--node-rank", "0"], start_timeout_s=300) as node0:
            r = httpx.post(
                node0.base_url + "/generate", timeout=120, json={"input_ids": TINY_PROMPTS, "sampling_params": GREEDY}
            )
            assert r.status_code == 200, r.text
            assert [o["output_ids"] for o in r.json()] == hf_tokens(model_dir, TINY_PROMPTS)
            info = httpx.get(node0.base_url + "/get_server_info", timeout=30).json()
            # Node 0 runs rank 0 only; rank 1 lives in node 1's process tree.
            assert "scheduler" in info["pids"] and "scheduler-tp1" not in info["pids"]
            assert node1.proc.poll() is None and "TP ranks [1] of 2 ready" in node1.log()
        # Node 0 gone: node 1's rank loses its peer and the node stops instead of hanging.
        node1.proc.wait(timeout=60)
        assert node1.proc.returncode != 0
    finally:
        node1.stop(timeout_s=10)
