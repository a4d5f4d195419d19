"""End-to-end part of tests/fast/test_weight_updates.py (what starts processes, engines or servers, or loads the
reference model).

Live weight updates against a running Engine (CPU, gloo, the real default model in float32).

A trainer process perturbs a copy of the weights and broadcasts them over its own gloo group;
a second checkpoint is loaded from disk; tensors are pushed in process. After each update
`get_weights_by_name` returns the new values (HF names, fused parts included) and greedy output
equals transformers run with the same weights. Rejected updates leave the old weights serving.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import chat_ids
from pipeline_helpers import drain_events
from workbench.core.engine import Engine
from workbench.core.trace import events as ev

NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
GROUP = "test_weight_sync"
Q = "model.layers.0.self_attn.q_proj.weight"
K = "model.layers.0.self_attn.k_proj.weight"
UP = "model.layers.1.mlp.up_proj.weight"
EMBED = "model.embed_tokens.weight"
# The trainer's "training step": noise on a few weights, fused parts and the tied embedding included.
PERTURBED = {
    Q: 0.6,
    K: 0.6,
    UP: 0.6,
    "model.layers.0.self_attn.o_proj.weight": 0.6,
    "model.layers.2.post_attention_layernorm.weight": 0.3,
    EMBED: 0.05,
}
# The second checkpoint on disk: a few tensors scaled.
DISK_SCALES = {
    "model.layers.3.self_attn.v_proj.weight": -1.0,
    "model.layers.4.mlp.gate_proj.weight": 1.7,
    "model.norm.weight": 1.2,
}


def perturbed(state: dict) -> dict:
    """Deterministic, so the trainer process and this one compute the same new weights."""
    g = torch.Generator().manual_seed(1234)
    return {
        n: state[n] + scale * state[n].std() * torch.randn(state[n].shape, generator=g)
        for n, scale in sorted(PERTURBED.items())
    }


def _trainer(model_dir: str, port: int, result_q, done) -> None:
    """Rank 0 of the weight-update group: perturb every weight's copy, broadcast them all."""
    from safetensors.torch import load_file
    from workbench.core.managers.weight_updater import TrainerWeightSync

    torch.set_num_threads(1)
    state = load_file(str(Path(model_dir) / "model.safetensors"))
    state.update(perturbed(state))
    with TrainerWeightSync("127.0.0.1", port, world_size=2, group_name=GROUP, timeout_s=60) as sync:
        result_q.put(sync.broadcast(sorted(state.items())))
        done.wait(60)  # keep the store up until the server has left the group


# ---- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(default_prepared):
    with Engine(dtype="float32", max_total_tokens=4096, show_progress=False) as e:
        yield e


@pytest.fixture(scope="module")
def model_dir(default_prepared) -> Path:
    return Path(default_prepared.model_dir)


@pytest.fixture(scope="module")
def original(model_dir) -> dict:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def ref_model(model_dir):
    """transformers on the same weights; this module's own copy, since the tests swap its weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [chat_ids(tokenizer, t) for t in ("Name three colors.", "What is a compiler?")]


@pytest.fixture(scope="module")
def baseline(engine, prompts):
    return greedy(engine, prompts)


def greedy(engine, prompts, sp=GREEDY) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=sp)]


@torch.no_grad()
def hf_greedy_with(model, prompts, new_weights: dict, max_new_tokens: int = NEW) -> list[list[int]]:
    """transformers' greedy continuations with `new_weights` swapped in (restored afterwards)."""
    saved = {n: model.get_parameter(n).detach().clone() for n in new_weights}
    try:
        for n, t in new_weights.items():
            model.get_parameter(n).copy_(t)
        return [
            model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
    finally:
        for n, t in saved.items():
            model.get_parameter(n).copy_(t)


def restore(engine, original, names) -> None:
    engine.update_weights_from_tensor([(n, original[n]) for n in names])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def trainer_process(model_dir: Path, port: int):
    with trainer_group_process(_trainer, (str(model_dir), port)) as result_q:
        yield result_q


@contextmanager
def trainer_group_process(target, args: tuple):
    """Run `target(*args, result_q, done)` in a spawned process (a trainer); yields result_q."""
    ctx = mp.get_context("spawn")
    result_q, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=target, args=(*args, result_q, done), daemon=True)
    proc.start()
    try:
        yield result_q
    finally:
        done.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def _close(a: list[float], b: torch.Tensor) -> bool:
    return torch.equal(torch.tensor(a), b.flatten()[: len(a)].float())


# ---- tests ----------------------------------------------------------------------------------


def test_trainer_broadcasts_weights_over_gloo(engine, model_dir, original, ref_model, prompts, baseline):
    new = perturbed(original)
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = sorted(f.keys())
        shapes = [f.get_slice(n).get_shape() for n in names]
    sub = engine.subscribe(with_snapshot=False)
    port = free_port()
    try:
        with trainer_process(model_dir, port) as result_q:
            out = engine.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, "gloo", timeout_s=60)
            assert "rank 1 of 2" in out["message"]
            # Checked before anything is received: the trainer's broadcast is still waiting.
            with pytest.raises(ValueError, match=r"shape.*expects \[576, 576\]"):
                engine.update_weights_from_distributed([Q], ["float32"], [[576, 5]], GROUP)
            t0 = time.perf_counter()
            out = engine.update_weights_from_distributed(names, [torch.float32] * len(names), shapes, GROUP)
            seconds = time.perf_counter() - t0
            trainer_s = result_q.get(timeout=60)
            engine.destroy_weights_update_group(GROUP)
        mb = sum(t.numel() * t.element_size() for t in original.values()) / 2**20
        print(
            f"\npushed all {len(names)} tensors ({mb:.0f} MiB float32) through update_weights_from_distributed "
            f"in {seconds:.2f} s (trainer broadcast {trainer_s:.2f} s; {out['message']})"
        )
        assert out["version"] >= 1
        for name in (Q, K, UP, EMBED, "lm_head.weight"):
            expect = new[EMBED if name == "lm_head.weight" else name]
            assert _close(engine.get_weights_by_name(name, 50), expect), name
        now = greedy(engine, prompts)
        assert now != baseline
        assert now == hf_greedy_with(ref_model, prompts, new)
        events = [e for e in drain_events(sub) if isinstance(e, ev.WeightsUpdated)]
        assert events and events[-1].source == f"distributed:{GROUP}" and events[-1].version == out["version"]
        with pytest.raises(ValueError, match="no weight-update group"):
            engine.update_weights_from_distributed([Q], ["float32"], [[576, 576]], GROUP)
    finally:
        sub.close()
        restore(engine, original, PERTURBED)
    assert _close(engine.get_weights_by_name(EMBED, 50), original[EMBED])


def test_trainer_with_the_wrong_world_size_times_out_clearly_and_the_engine_keeps_serving(
    engine, model_dir, prompts, baseline
):
    """The trainer counts 3 ranks, the engine 2: both give up after the timeout, saying what to check."""
    from openrlhf_trainer import trainer_main

    port = free_port()
    t0 = time.monotonic()
    args = (str(model_dir), port, 3, GROUP, "test_weight_updates_e2e:perturbed", 8.0)
    with trainer_group_process(trainer_main, args) as result_q:
        with pytest.raises(
            ValueError,
            match=r"did not form within 8 s at tcp://127\.0\.0\.1:\d+ "
            r"\(this side: rank 1 of world_size 2, gloo\).*world_size",
        ):
            engine.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, "gloo", timeout_s=8)
        status, message = result_q.get(timeout=60)
    assert time.monotonic() - t0 < 60
    assert status == "error", message
    assert engine.is_healthy
    assert greedy(engine, prompts) == baseline


def test_a_trainer_written_the_openrlhf_way_updates_the_engine(
    engine, model_dir, original, ref_model, prompts, baseline
):
    """rendezvous -> PrefixStore(group_name) -> torch's group helper -> dist.broadcast, no workbench import.

    Runs after the failed attempt above with the same group name: a failure leaves nothing behind.
    """
    from openrlhf_trainer import trainer_main
    from safetensors import safe_open

    new = perturbed(original)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = sorted(f.keys())
        shapes = [f.get_slice(n).get_shape() for n in names]
    port = free_port()
    try:
        args = (str(model_dir), port, 2, GROUP, "test_weight_updates_e2e:perturbed", 60.0)
        with trainer_group_process(trainer_main, args) as result_q:
            out = engine.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, "gloo", timeout_s=60)
            assert "rank 1 of 2" in out["message"]
            out = engine.update_weights_from_distributed(
                names=names, dtypes=["float32"] * len(names), shapes=shapes, group_name=GROUP, flush_cache=True
            )
            status, message = result_q.get(timeout=60)
            assert status == "ok", message
            engine.destroy_weights_update_group(GROUP)
        assert out["success"]
        for name in (Q, K, UP, EMBED):
            assert _close(engine.get_weights_by_name(name, 50), new[name]), name
        now = greedy(engine, prompts)
        assert now != baseline
        assert now == hf_greedy_with(ref_model, prompts, new)
    finally:
        restore(engine, original, PERTURBED)
    assert greedy(engine, prompts) == baseline


def test_flush_cache_false_keeps_the_radix_cache(engine, original, prompts):
    """SGLang's `flush_cache`: True (the default) empties the prefix cache after an update, False keeps it."""
    engine.generate(input_ids=prompts[0], sampling_params=GREEDY)  # cache the prompt
    same = [(Q, original[Q])]
    engine.update_weights_from_tensor(same, flush_cache=False)
    kept = engine.generate(input_ids=prompts[0], sampling_params=GREEDY)["meta_info"]["cached_tokens"]
    engine.update_weights_from_tensor(same)
    flushed = engine.generate(input_ids=prompts[0], sampling_params=GREEDY)["meta_info"]["cached_tokens"]
    assert kept >= len(prompts[0]) - 1 and flushed == 0


def test_update_from_disk(engine, model_dir, original, ref_model, prompts, baseline, tmp_path):
    from safetensors.torch import save_file

    ckpt = tmp_path / "ckpt2"
    ckpt.mkdir()
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, ckpt / f.name)
    scaled = {n: original[n] * s for n, s in DISK_SCALES.items()}
    save_file({**original, **scaled}, str(ckpt / "model.safetensors"))
    sub = engine.subscribe(with_snapshot=False)
    try:
        out = engine.update_weights_from_disk(str(ckpt))
        assert out["success"] and "272 tensors" in out["message"]
        for name, t in scaled.items():
            assert _close(engine.get_weights_by_name(name, 64), t), name
        now = greedy(engine, prompts)
        assert now != baseline
        assert now == hf_greedy_with(ref_model, prompts, scaled)
        events = [e for e in drain_events(sub) if isinstance(e, ev.WeightsUpdated)]
        assert events and events[-1].source == f"disk:{ckpt}"
        # The prefix cache was flushed: the same prompt again is not served from stale KV.
        again = engine.generate(input_ids=prompts[0], sampling_params=GREEDY)
        assert again["output_ids"] == now[0]
    finally:
        sub.close()
        restore(engine, original, DISK_SCALES)


def test_mismatches_are_rejected_and_old_weights_serve(engine, model_dir, original, prompts, baseline, tmp_path):
    from safetensors.torch import save_file
    from tiny_models import make_tiny_llama, make_tiny_qwen2

    before = engine.get_weights_by_name(Q, 32)
    # One bad tensor rejects the whole batch: the good one before it is not applied either.
    with pytest.raises(
        ValueError,
        match=r"old weights are unchanged.*k_proj.weight has shape \[10, 576\], "
        r"the model expects \[192, 576\]",
    ):
        engine.update_weights_from_tensor([(Q, original[Q] * 2), (K, torch.zeros(10, 576))])
    with pytest.raises(ValueError, match="does not have: model.layers.0.self_attn.qkv_proj.weight"):
        engine.update_weights_from_tensor([("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(960, 576))])
    with pytest.raises(ValueError, match="dtype.*int32"):
        engine.update_weights_from_tensor([(Q, original[Q].to(torch.int32))])
    with pytest.raises(ValueError, match="Qwen2ForCausalLM; the running model is a LlamaForCausalLM"):
        engine.update_weights_from_disk(str(make_tiny_qwen2(tmp_path / "qwen")))
    with pytest.raises(ValueError, match="different shape of LlamaForCausalLM: hidden_size"):
        engine.update_weights_from_disk(str(make_tiny_llama(tmp_path / "llama")))
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, bad / f.name)
    save_file({n: torch.zeros(2) for n in original}, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"272 shape mismatch\(es\)"):
        engine.update_weights_from_disk(str(bad))
    save_file({Q: original[Q]}, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 271 weight"):
        engine.update_weights_from_disk(str(bad))
    with pytest.raises(ValueError, match="call init_weights_update_group first"):
        engine.update_weights_from_distributed([Q], ["float32"], [[576, 576]], "nope")
    assert engine.get_weights_by_name(Q, 32) == before
    assert greedy(engine, prompts) == baseline


def test_update_waits_for_inflight_holds_new_and_can_abort(engine, original, prompts, baseline):
    long_sp = dict(GREEDY, max_new_tokens=16)
    old_long = greedy(engine, prompts[1:], long_sp)[0]
    tm = engine.tokenizer_manager
    new = [(n, t) for n, t in perturbed(original).items() if n != EMBED]

    def wait_for(cond):
        deadline = time.monotonic() + 60
        while not cond():
            assert time.monotonic() < deadline
            time.sleep(0.002)

    with cf.ThreadPoolExecutor(2) as pool:
        # Paused, the request stays in flight for as long as the test needs. Pause before it runs and
        # step it to its first token: a pause sent after that token can arrive after the last one.
        engine.step_gate("pause")
        stream = engine.generate(input_ids=prompts[1], sampling_params=long_sp, stream=True)
        first = pool.submit(next, stream)
        wait_for(lambda: engine.get_internal_state()["num_waiting"] == 1)
        engine.step_gate("step")  # its prefill (one chunk): the first token
        first.result(timeout=60)
        update = pool.submit(engine.update_weights_from_tensor, new)
        wait_for(lambda: not tm._weights_gate.is_set())  # the update waits for it...
        held = pool.submit(greedy, engine, prompts[:1])
        wait_for(lambda: tm.num_held_requests == 1)  # ...and holds a new request
        assert not update.done()
        engine.step_gate("resume")
        chunks = list(stream)
        assert update.result(timeout=60)["success"]
        # The in-flight request finished entirely on the old weights...
        assert chunks[-1]["output_ids"] == old_long
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
        # ...and the held one ran entirely on the new ones.
        assert held.result(timeout=60) == greedy(engine, prompts[:1]) != baseline[:1]
    # abort_all_requests: a long request is cut short instead of waited for.
    stream = engine.generate(input_ids=prompts[0], sampling_params=dict(GREEDY, max_new_tokens=2000), stream=True)
    next(stream)
    engine.update_weights_from_tensor([(n, original[n]) for n, _ in new], abort_all_requests=True)
    assert list(stream)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert greedy(engine, prompts) == baseline


def test_http_weight_routes(engine, model_dir, original):
    import httpx
    from workbench.core.entrypoints.http_server import bind_socket, start_server

    running = start_server(engine, engine.server_args, bind_socket("127.0.0.1", 0))
    try:
        url = running.url
        r = httpx.post(url + "/get_weights_by_name", json={"name": K, "truncate_size": 6}, timeout=60)
        assert r.status_code == 200 and _close(r.json(), original[K])
        r = httpx.post(
            url + "/update_weights_from_distributed",
            timeout=60,
            json={"names": [Q], "dtypes": ["float32"], "shapes": [[576, 576]], "group_name": "g"},
        )
        assert r.status_code == 400 and not r.json()["success"]
        assert "init_weights_update_group" in r.json()["message"]
        r = httpx.post(url + "/update_weights_from_disk", json={"model_pth": "x"}, timeout=60)
        assert r.status_code == 422 and "model_pth" in r.json()["error"]["message"]  # a misspelt field
        r = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(model_dir)}, timeout=120)
        assert r.status_code == 200 and r.json()["success"] and r.json()["version"] >= 1
    finally:
        running.stop(timeout_s=5)
