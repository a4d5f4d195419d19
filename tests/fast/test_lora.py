"""Multi-LoRA (core/lora/): PEFT adapters read with clear errors, the manager's LRU, the radix
cache's per-adapter namespaces, and one mixed batch's logits against transformers + PEFT on tiny
random models of two families (llama, qwen2). The served path end to end: tests/e2e/test_lora_e2e.py."""

from __future__ import annotations

import json

import pytest
import torch
from lora_helpers import make_peft_adapter, peft_last_logits
from tiny_models import make_tiny_family, make_tiny_llama, make_tiny_qwen2
from workbench.core.args import ServerArgs
from workbench.core.lora.adapter import LoRAError, read_adapter
from workbench.core.mem_cache.radix_cache import RadixCache
from workbench.core.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from workbench.core.model_executor.model_runner import ModelRunner

ALL = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_llama")
    model = make_tiny_llama(root / "model")
    a = make_peft_adapter(model, root / "ad_a", seed=1, r=4, targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    b = make_peft_adapter(model, root / "ad_b", seed=2, r=8, alpha=4.0, use_rslora=True)
    c = make_peft_adapter(model, root / "ad_c", seed=3, r=2, targets=["gate_proj", "up_proj", "down_proj"])
    return model, {"a": a, "b": b, "c": c}


def _runner(model_dir, **kw) -> ModelRunner:
    args = ServerArgs(
        model_path=str(model_dir), dtype="float32", max_total_tokens=4096, show_progress=False, enable_lora=True, **kw
    )
    return ModelRunner(args)


def _extend(runner: ModelRunner, prompts: list[list[int]], loras: list[str | None]) -> torch.Tensor:
    """One extend pass over every prompt (fresh rows); returns each prompt's next-token logits."""
    total = sum(len(p) for p in prompts)
    loc = runner.token_to_kv_pool_allocator.alloc(total)
    rows = runner.req_to_token_pool.alloc(len(prompts))
    ids, pos, off = [], [], 0
    for row, p in zip(rows, prompts):
        runner.req_to_token_pool.req_to_token[row, : len(p)] = loc[off : off + len(p)]
        ids += p
        pos += range(len(p))
        off += len(p)
    fb = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(prompts),
        input_ids=torch.tensor(ids),
        positions=torch.tensor(pos),
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor([len(p) for p in prompts]),
        out_cache_loc=loc,
        seq_lens_cpu=[len(p) for p in prompts],
        extend_seq_lens_cpu=[len(p) for p in prompts],
        extend_prefix_lens_cpu=[0] * len(prompts),
        lora_paths=loras if any(loras) else None,
    )
    out = runner.forward(fb).next_token_logits
    runner.req_to_token_pool.free(rows)
    runner.token_to_kv_pool_allocator.free(loc)
    return out


PROMPTS = [[5, 17, 33, 80, 9, 61], [100, 4, 77], [3, 3, 150, 42, 18], [250, 12, 8, 91]]


def test_mixed_batch_matches_peft_llama(llama):
    """Four requests in one pass: adapter a, the base model, b (rsLoRA, all targets), c (MLP only)."""
    model, ads = llama
    runner = _runner(model, lora_paths=[f"{n}={p}" for n, p in ads.items()])
    loras = ["a", None, "b", "c"]
    got = _extend(runner, PROMPTS, loras)
    for i, (prompt, name) in enumerate(zip(PROMPTS, loras)):
        want = peft_last_logits(model, ads[name] if name else None, prompt)
        torch.testing.assert_close(got[i], want, atol=2e-4, rtol=1e-4, msg=f"request {i} ({name})")
    # The adapters change the model: the base logits differ from each adapter's.
    base = peft_last_logits(model, None, PROMPTS[0])
    assert (got[0] - base).abs().max() > 1e-2
    # One adapter covering every row (no row gather) gives the same numbers as in the mixed batch.
    alone = _extend(runner, [PROMPTS[2]], ["b"])
    torch.testing.assert_close(alone[0], got[2], atol=1e-5, rtol=1e-5)


def test_mixed_batch_matches_peft_qwen2(tmp_path):
    """Another family: Qwen2's q/k/v biases and untied head, two adapters and the base model."""
    model = make_tiny_qwen2(tmp_path / "qwen")
    a = make_peft_adapter(model, tmp_path / "qa", seed=4, r=4)
    b = make_peft_adapter(model, tmp_path / "qb", seed=5, r=2, targets=["v_proj", "down_proj"])
    runner = _runner(model, lora_paths=[f"qa={a}", f"qb={b}"], max_loras_per_batch=2)
    loras = ["qb", "qa", None]
    got = _extend(runner, PROMPTS[:3], loras)
    for i, (prompt, name) in enumerate(zip(PROMPTS, loras)):
        want = peft_last_logits(model, {"qa": a, "qb": b}[name] if name else None, prompt)
        torch.testing.assert_close(got[i], want, atol=2e-4, rtol=1e-4, msg=f"request {i} ({name})")


def test_mixed_batch_matches_peft_phi3_fused_projections(tmp_path):
    """Phi-3 names its fused projections in the checkpoint, so PEFT adapters target qkv_proj and gate_up_proj:
    one A, B over the whole fused output (GQA here: q and k/v of different sizes)."""
    model = make_tiny_family(tmp_path / "phi3", "phi3", num_key_value_heads=2)
    a = make_peft_adapter(model, tmp_path / "pa", seed=6, r=4, targets=["qkv_proj", "o_proj", "gate_up_proj"])
    b = make_peft_adapter(model, tmp_path / "pb", seed=7, r=2, targets=["down_proj", "qkv_proj"])
    runner = _runner(model, lora_paths=[f"pa={a}", f"pb={b}"], max_loras_per_batch=2)
    loras = ["pa", None, "pb"]
    got = _extend(runner, PROMPTS[:3], loras)
    for i, (prompt, name) in enumerate(zip(PROMPTS, loras)):
        want = peft_last_logits(model, {"pa": a, "pb": b}[name] if name else None, prompt)
        torch.testing.assert_close(got[i], want, atol=2e-4, rtol=1e-4, msg=f"request {i} ({name})")
    assert (got[0] - peft_last_logits(model, None, PROMPTS[0])).abs().max() > 1e-2  # the adapter counts


def test_manager_lru_eviction_in_use_and_errors(llama, tmp_path):
    model, ads = llama
    # By default a later adapter may not exceed the start-up ones' rank nor targets (SGLang's rule).
    first = _runner(model, lora_paths=[f"a={ads['a']}"]).lora_manager
    with pytest.raises(LoRAError, match=r"rank 8, above --max-lora-rank 4"):
        first.load("b", str(ads["b"]))
    with pytest.raises(LoRAError, match=r"outside --lora-target-modules \(k_proj o_proj q_proj v_proj\)"):
        first.load("c", str(ads["c"]))
    assert list(first.loaded) == ["a"]
    runner = _runner(
        model,
        lora_paths=[f"a={ads['a']}"],
        max_loaded_loras=2,
        max_loras_per_batch=1,
        max_lora_rank=8,
        lora_target_modules=["all"],
    )
    mgr = runner.lora_manager
    mgr.load("b", str(ads["b"]))
    mgr.acquire("a")  # a is now the most recently used: b goes first
    mgr.load("c", str(ads["c"]))
    assert list(mgr.loaded) == ["a", "c"] and set(mgr.known) == {"a", "b", "c"}
    # An evicted adapter is still known: naming it loads it again (evicting the LRU one not in use).
    mgr.in_use = lambda: {"a"}
    uid_before = mgr.loaded["a"].uid
    assert mgr.acquire("b").name == "b" and list(mgr.loaded) == ["a", "b"]
    assert mgr.loaded["a"].uid == uid_before  # untouched, so its cached KV stays valid
    with pytest.raises(LoRAError, match="in use"):
        mgr.unload("a")
    mgr.unload("c")
    with pytest.raises(LoRAError, match="unknown LoRA adapter 'c'.*load it"):
        mgr.acquire("c")
    mgr.in_use = lambda: {"a", "b"}
    with pytest.raises(LoRAError, match="max-loaded-loras"):
        mgr.load("c", str(ads["c"]))
    assert list(mgr.loaded) == ["a", "b"]  # nothing else disturbed


def test_loader_errors(llama, tmp_path):
    model, ads = llama

    def read(path, max_rank=None, allowed=ALL):
        return read_adapter("x", str(path), 1, torch.float32, max_rank, set(allowed), 2)

    assert read(ads["b"]).config.scaling == pytest.approx(4.0 / 8**0.5)  # rsLoRA: alpha / sqrt(r)
    with pytest.raises(LoRAError, match="not a directory"):
        read(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        read(tmp_path / "empty")
    with pytest.raises(LoRAError, match="rank 8, above --max-lora-rank 4.*--max-lora-rank 8"):
        read(ads["b"], max_rank=4)
    with pytest.raises(LoRAError, match="outside --lora-target-modules"):
        read(ads["a"], allowed={"q_proj"})
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((ads["a"] / "adapter_config.json").read_text())
    with pytest.raises(LoRAError, match="no adapter_model.safetensors"):
        read(broken)
    (broken / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00not a safetensors file")
    with pytest.raises(LoRAError, match="corrupt"):
        read(broken)
    lacking = tmp_path / "lacking"
    lacking.mkdir()
    cfg = json.loads((ads["a"] / "adapter_config.json").read_text())
    (lacking / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj", "c_attn"]}))
    with pytest.raises(LoRAError, match=r"\['c_attn'\].*no such projection"):
        read(lacking)


def test_radix_cache_keys_prefixes_by_adapter():
    class Alloc:
        device = "cpu"

        def free(self, _):
            pass

    tree = RadixCache(None, Alloc())
    ids = [1, 2, 3, 4, 5]
    tree.insert(ids, torch.arange(5))
    tree.insert(ids, torch.arange(10, 15), extra_key=7)
    assert tree.match_prefix(ids).device_indices.tolist() == [0, 1, 2, 3, 4]
    assert tree.match_prefix(ids, extra_key=7).device_indices.tolist() == [10, 11, 12, 13, 14]
    assert len(tree.match_prefix(ids, extra_key=8).device_indices) == 0  # another adapter: nothing reused
    assert tree.evictable_size() == 10
    assert tree.evict(100) == 10 and tree.total_size() == 0  # the namespaces' nodes evict like any
    labels = [n.text for n in tree.snapshot()]
    assert "[adapter #7]" in labels and "[adapter #8]" in labels


def _lora_scheduler(model, ads, names: list[str], **kw):
    """The real Scheduler and model worker in-process on the tiny llama with adapters `names` at start-up:
    (scheduler, its list I/O, the trace events it emits)."""
    from workbench.core.managers.scheduler import Scheduler
    from workbench.core.managers.scheduler_contract import ListIO
    from workbench.core.trace.tracer import Tracer

    args = ServerArgs(
        model_path=str(model),
        dtype="float32",
        max_total_tokens=4096,
        show_progress=False,
        device="cpu",
        disable_overlap_schedule=True,
        lora_paths=[f"{n}={ads[n]}" for n in names],
        lora_target_modules=["all"],
        **kw,
    )
    events: list = []
    io = ListIO(roundtrip=True)
    return Scheduler(args, None, io=io, tracer=Tracer("scheduler", sink=events.extend, enabled=True)), io, events


def _step_until_idle(s, io, limit: int = 60):
    """Step until nothing is left: (tokens per rid, error per rid, load/unload replies)."""
    from workbench.core.io_struct import LoRAUpdateOutput

    out: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    replies = []
    for _ in range(limit):
        s.step_normal()
        for msg in io.outbox:
            if isinstance(msg, LoRAUpdateOutput):
                replies.append(msg)
            elif hasattr(msg, "rids"):
                for i, rid in enumerate(msg.rids):
                    out.setdefault(rid, []).extend(msg.new_token_ids[i])
                    if msg.error_messages and msg.error_messages[i]:
                        errors[rid] = msg.error_messages[i]
        io.outbox.clear()
        if not s.has_work() and not io.inbox:
            break
    return out, errors, replies


def test_scheduler_admits_one_adapter_per_batch_and_answers_load_unload(llama):
    """The real Scheduler and model worker in-process: with --max-loras-per-batch 1 the second
    adapter's request waits (the step says so), every request still gets PEFT's tokens, and
    load/unload answer on the scheduler's socket (unloading an adapter in use is refused)."""
    from lora_helpers import peft_greedy
    from workbench.core.io_struct import (
        LoadLoRAAdapterReq,
        LoRAUpdateOutput,
        TokenizedGenerateReqInput,
        UnloadLoRAAdapterReq,
    )
    from workbench.core.sampling.sampling_params import SamplingParams
    from workbench.core.trace import events as ev
    from workbench.core.trace.narration import narrate_step
    from workbench.core.trace.state import TraceState

    model, ads = llama
    s, io, events = _lora_scheduler(model, ads, ["a", "b"], max_loras_per_batch=1)
    loras = {"ra": "a", "rb": "b", "r0": None, "ra2": "a"}
    for i, (rid, name) in enumerate(loras.items()):
        sp = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
        io.inbox.append(
            TokenizedGenerateReqInput(rid=rid, input_text="", input_ids=PROMPTS[i], sampling_params=sp, lora_path=name)
        )
    io.inbox.append(
        TokenizedGenerateReqInput(rid="bad", input_text="", input_ids=PROMPTS[0], sampling_params=sp, lora_path="zz")
    )
    s.step_normal()
    first = sorted(r.rid for r in s.last_batch.reqs)
    assert first == ["r0", "ra", "ra2"]  # b would be a second adapter in the batch: it waits
    decision = [e for e in events if isinstance(e, ev.StepDecision)][-1]
    assert decision.loras == ["a"] and decision.lora_waited == ["rb"]
    io.inbox.append(UnloadLoRAAdapterReq(lora_name="b"))  # rb still waits for it
    out, errors, replies = _step_until_idle(s, io)
    assert "unknown LoRA adapter 'zz'" in errors["bad"]
    assert not replies[0].success and "'b' is in use" in replies[0].message
    for i, (rid, name) in enumerate(loras.items()):
        assert out[rid] == peft_greedy(model, ads[name] if name else None, [PROMPTS[i]], 5)[0], rid
    state = TraceState()
    state.apply_many(events)
    lines = [narrate_step(sv) for sv in state.steps]
    assert any("adapters a" in line and "1 waited for an adapter slot (rb)" in line for line in lines), lines
    # the Batch panel's rows: each request in its adapter's colour (the base model's uncoloured), the
    # step's adapters at the end
    from workbench.core.trace.palette import adapter_colour
    from workbench.tui.panels.batch import composition

    assert state.loras_seen and state.requests["ra"].lora == "a" and state.requests["r0"].lora == ""
    adapters = {rid: r.lora for rid, r in state.requests.items() if r.lora}
    first_step = next(sv for sv in state.steps if any(sr.rid == "ra" for sr in sv.reqs))
    text = composition(first_step, adapters=adapters)
    styles = {text.plain[sp.start : sp.end]: str(sp.style) for sp in text.spans}
    assert adapter_colour("a") in styles["ra"] and adapter_colour("a") in styles["ra2"], styles
    assert "#" not in styles["r0"], styles  # the base model's request keeps the plain style
    assert text.plain.endswith("lora a") and adapter_colour("a") in styles["a"], text.plain
    io.inbox.append(UnloadLoRAAdapterReq(lora_name="b"))
    io.inbox.append(LoadLoRAAdapterReq(lora_name="c", lora_path=str(ads["c"])))
    s.step_normal()
    unload, load = [m for m in io.outbox if isinstance(m, LoRAUpdateOutput)]
    assert unload.success and load.success and set(load.loaded_adapters) == {"a", "c"}


def test_a_request_whose_adapter_has_no_room_waits_for_one_to_go_idle(llama):
    """--max-loaded-loras 1: a request naming an adapter that is not loaded while the loaded one is in use
    waits in the queue (it is not aborted), is loaded once the other's requests finish, and gets PEFT's tokens."""
    from lora_helpers import peft_greedy
    from workbench.core.io_struct import TokenizedGenerateReqInput
    from workbench.core.sampling.sampling_params import SamplingParams
    from workbench.core.trace import events as ev

    model, ads = llama
    s, io, events = _lora_scheduler(model, ads, ["c", "a"], max_loras_per_batch=1, max_loaded_loras=1)
    assert list(s.lora.loaded) == ["a"]  # one slot: loading a at start evicted c (still known)
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    for rid, name, prompt in (("ra", "a", PROMPTS[0]), ("rc", "c", PROMPTS[1])):
        io.inbox.append(
            TokenizedGenerateReqInput(rid=rid, input_text="", input_ids=prompt, sampling_params=sp, lora_path=name)
        )
    out, errors, _ = _step_until_idle(s, io, limit=40)
    assert not errors, errors
    decisions = [e for e in events if isinstance(e, ev.StepDecision)]
    assert any("rc" in d.lora_waited for d in decisions)  # it waited for a slot, said in the step's decision
    assert out["ra"] == peft_greedy(model, ads["a"], [PROMPTS[0]], 4)[0]
    assert out["rc"] == peft_greedy(model, ads["c"], [PROMPTS[1]], 4)[0]
    assert list(s.lora.loaded) == ["c"]  # a went idle and made room
