"""Multi-LoRA served end to end (docs/lora.md): greedy tokens of two adapters and the base model in
flight together equal transformers + PEFT (float32, the default model SmolLM2-135M), the radix cache
never serves one adapter's KV to another, adapters load and unload while serving, and the HTTP
routes (/generate's lora_path, OpenAI's model = BASE:ADAPTER, /load_lora_adapter,
/unload_lora_adapter) answer as SGLang's do. The tiny-qwen2 family check is in tests/fast/test_lora.py."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from lora_helpers import make_peft_adapter, peft_greedy
from workbench.core.engine import Engine
from workbench.core.entrypoints.server_process import ServerProcess

N = 6  # greedy tokens compared per request


@pytest.fixture(scope="module")
def model_dir(default_prepared) -> Path:
    return Path(default_prepared.model_dir)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_adapters")
    return {
        "sql": make_peft_adapter(model_dir, root / "sql", seed=11, r=8, alpha=16, targets=["q_proj", "v_proj"]),
        "code": make_peft_adapter(model_dir, root / "code", seed=12, r=4, alpha=8, std=0.03),
        "late": make_peft_adapter(model_dir, root / "late", seed=13, r=4, alpha=8, targets=["o_proj", "down_proj"]),
    }


@pytest.fixture(scope="module")
def prompts(tokenizer):
    # Short raw prompts: the PEFT reference runs every prefix in full, which on a loaded machine is slow.
    return [tokenizer.encode(t, add_special_tokens=False) for t in ("The three primary colors are", "A compiler is")]


@pytest.fixture(scope="module")
def expected(model_dir, adapters, prompts) -> dict:
    """PEFT's greedy tokens per (adapter or None, prompt index)."""
    out = {}
    for name in (None, "sql", "code", "late"):
        for i, toks in enumerate(peft_greedy(model_dir, adapters[name] if name else None, prompts, N)):
            out[(name, i)] = toks
    # The adapters matter: each changes the base model's continuation of some prompt.
    for name in ("sql", "code", "late"):
        assert any(out[(name, i)] != out[(None, i)] for i in range(len(prompts))), name
    return out


@pytest.fixture(scope="module")
def engine(default_prepared, adapters):
    with Engine(
        dtype="float32",
        max_total_tokens=4096,
        show_progress=False,
        lora_paths=[f"sql={adapters['sql']}", f"code={adapters['code']}"],
        lora_target_modules=["all"],
        max_loras_per_batch=2,
    ) as e:
        yield e


def _greedy(n: int = N) -> dict:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def test_two_adapters_and_the_base_in_one_batch_match_peft(engine, prompts, expected):
    loras = ["sql", None, "code", "code", None, "sql"]
    batch = [prompts[i % 2] for i in range(len(loras))]
    outs = engine.generate(input_ids=batch, sampling_params=_greedy(), lora_path=loras)
    for i, (name, out) in enumerate(zip(loras, outs)):
        assert out["output_ids"] == expected[(name, i % 2)], f"request {i} under {name}"
    # Again, now that every prompt's KV is cached under each adapter: a prefix cached under one adapter
    # (or the base) never serves another; each request is served only its own adapter's KV.
    for name in ("code", None, "sql"):
        out = engine.generate(input_ids=prompts[0], sampling_params=_greedy(), lora_path=name)
        assert out["output_ids"] == expected[(name, 0)], name
        assert out["meta_info"]["cached_tokens"] > 0  # its own namespace's prefix was reused


def test_hot_load_and_unload_while_serving(engine, adapters, prompts, expected):
    from workbench.core.managers.tokenizer_manager import RequestFailedError

    with pytest.raises(RequestFailedError, match="unknown LoRA adapter 'late'.*load it"):
        engine.generate(input_ids=prompts[0], sampling_params=_greedy(), lora_path="late")
    # A long request under "sql" runs while "late" is loaded and used beside it.
    long_out: dict = {}
    t = threading.Thread(
        target=lambda: long_out.update(
            engine.generate(input_ids=prompts[1], sampling_params=_greedy(200), lora_path="sql")
        )
    )
    t.start()
    reply = engine.load_lora_adapter("late", str(adapters["late"]))
    assert reply["success"] and set(reply["loaded_adapters"]) == {"sql", "code", "late"}
    out = engine.generate(input_ids=prompts[0], sampling_params=_greedy(), lora_path="late")
    assert out["output_ids"] == expected[("late", 0)]
    if t.is_alive():  # refused while the long request uses it; nothing else changes
        with pytest.raises(ValueError, match="'sql' is in use"):
            engine.unload_lora_adapter("sql")
    t.join(timeout=600)
    assert long_out["output_ids"][:N] == expected[("sql", 1)]
    assert engine.unload_lora_adapter("sql")["loaded_adapters"].keys() == {"code", "late"}
    with pytest.raises(RequestFailedError, match="unknown LoRA adapter 'sql'"):
        engine.generate(input_ids=prompts[1], sampling_params=_greedy(), lora_path="sql")
    with pytest.raises(ValueError, match="no adapter_config.json"):
        engine.load_lora_adapter("bad", str(adapters["late"].parent))
    # The base model and the other adapters serve as before.
    outs = engine.generate(input_ids=prompts, sampling_params=_greedy(), lora_path=[None, "code"])
    assert [o["output_ids"] for o in outs] == [expected[(None, 0)], expected[("code", 1)]]
    engine.load_lora_adapter("sql", str(adapters["sql"]))  # reloaded: a new load, its own namespace
    out = engine.generate(input_ids=prompts[1], sampling_params=_greedy(), lora_path="sql")
    assert out["output_ids"] == expected[("sql", 1)]


def _post(srv, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        srv.base_url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_http_routes(default_prepared, adapters, prompts, expected, tokenizer):
    """/generate with one adapter per prompt, OpenAI's BASE:ADAPTER, load/unload, and
    --max-loras-per-batch 1 (the second adapter's request waits for a batch of its own)."""
    args = ["--dtype", "float32", "--max-total-tokens", "4096", "--max-loras-per-batch", "1"]
    args += ["--lora-paths", f"sql={adapters['sql']}", f"code={adapters['code']}", "--lora-target-modules", "all"]
    with ServerProcess(args) as srv:
        status, outs = _post(
            srv,
            "/generate",
            {
                "input_ids": [prompts[0], prompts[1], prompts[0]],
                "sampling_params": _greedy(),
                "lora_path": ["code", "sql", None],
            },
        )
        assert status == 200, outs
        assert [o["output_ids"] for o in outs] == [expected[("code", 0)], expected[("sql", 1)], expected[(None, 0)]]
        status, models = 200, json.loads(urllib.request.urlopen(srv.base_url + "/v1/models", timeout=60).read())
        base = models["data"][0]["id"]
        text = tokenizer.decode(prompts[1])
        for model, name in ((f"{base}:code", "code"), (base, None)):
            status, body = _post(
                srv, "/v1/completions", {"model": model, "prompt": text, "max_tokens": N, "temperature": 0}
            )
            assert status == 200, body
            want = tokenizer.decode(expected[(name, 1)])
            assert body["choices"][0]["text"] == want and body["model"] == model
        status, body = _post(srv, "/v1/completions", {"model": f"{base}:nope", "prompt": text, "max_tokens": 2})
        assert status == 400 and "unknown LoRA adapter 'nope'" in body["error"]["message"]
        status, body = _post(srv, "/unload_lora_adapter", {"lora_name": "nope"})
        assert status == 400 and body["success"] is False and "unknown LoRA adapter" in body["message"]
        status, body = _post(srv, "/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"])})
        assert status == 200 and body["success"] and set(body["loaded_adapters"]) == {"sql", "code", "late"}
        status, body = _post(srv, "/unload_lora_adapter", {"lora_name": "late"})
        assert status == 200 and set(body["loaded_adapters"]) == {"sql", "code"}
        # /metrics counts requests per adapter (folded from the trace: it may lag a moment)
        import re
        import time

        for _ in range(50):
            text = urllib.request.urlopen(srv.base_url + "/metrics", timeout=60).read().decode()
            counts = dict(re.findall(r'sglang:num_lora_requests_total\{[^}]*lora_name="(\w+)"[^}]*\} (\S+)', text))
            if float(counts.get("code", 0)) >= 2:
                break
            time.sleep(0.2)
        assert float(counts["code"]) == 2 and float(counts["sql"]) == 1, counts
