"""End-to-end part of tests/fast/test_model_loader.py (what starts processes, engines or servers, or loads the
reference model).

Model loader: GGUF conversion (against transformers' own GGUF loader), HF dirs, cache, errors.

The expensive pieces (converting the default SmolLM2 GGUF, loading
transformers' reference model and tokenizer from the same file) run once per
module; everything else uses tiny random models from tiny_models.py.
"""

from __future__ import annotations

import contextlib
import functools
import json

import pytest
import torch
from tiny_models import (
    llamacpp_permute,
)
from workbench.core.model_loader import (
    DEFAULT_MODEL_NAME,
    cache_root,
    default_gguf_path,
    gguf_loader,
    iter_weights,
    load_tokenizer,
    prepare_model,
)

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Héllo! What is 2+2? ✓ 日本語"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And  3*3?\n"},
]


@pytest.fixture(scope="module")
def converted(cache_dir):
    """The default model converted once (the first prepare_model of this module's cache)."""
    return prepare_model(None, progress=False)


@pytest.fixture(scope="module")
def gguf_file():
    return default_gguf_path()


@pytest.fixture(scope="module")
def gguf_parsed_once():
    """A context in which transformers' GGUF loader parses the file once and builds gguf's tensor-name
    table once, for the references below only (never around our own conversion).

    Left alone it parses the header (a 49k-entry vocabulary, in Python) for the config, again for the
    weights and again for the tokenizer, and rebuilds the name table for each of the model's ~400
    modules: ~35 of the ~55 s these references took. Both are pure: same file (opened read-only) or
    same (architecture, layers) in, same object out, so what transformers returns is unchanged."""
    import gguf

    readers: dict = {}
    new_reader, name_map = gguf.GGUFReader, functools.cache(gguf.get_tensor_name_map)

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = new_reader(path, *args, **kwargs)
        return readers[key]

    @contextlib.contextmanager
    def active():
        # transformers imports both names from gguf inside its functions, at each call.
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gguf, "GGUFReader", reader)
            mp.setattr(gguf, "get_tensor_name_map", name_map)
            yield

    yield active
    readers.clear()


@pytest.fixture(scope="module")
def reference_state_dict(gguf_file, gguf_parsed_once):
    from transformers import AutoModelForCausalLM

    with gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
        )
    state = {k: v.detach() for k, v in model.state_dict().items()}
    config = model.config
    del model
    return state, config


def test_converted_weights_equal_transformers_gguf_loader(converted, reference_state_dict):
    reference, _ = reference_state_dict
    ours = dict(iter_weights(converted.model_dir, progress=False))
    # SmolLM2 ties lm_head to the embeddings: transformers lists the tied alias, the file does not store it.
    assert converted.config.tie_word_embeddings
    assert set(ours) == set(reference) - {"lm_head.weight"}
    assert torch.equal(reference["lm_head.weight"], reference["model.embed_tokens.weight"])
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == reference[name].shape, name
        # Exact equality is the expected case; torch.allclose is ~10x slower on CPU at this size.
        assert torch.equal(tensor, reference[name]) or (tensor - reference[name]).abs().max().item() <= 1e-6, name
    # The comparison is only meaningful if the Q/K reordering is not a no-op on this model.
    k_proj = ours["model.layers.0.self_attn.k_proj.weight"]
    assert not torch.equal(k_proj, torch.from_numpy(llamacpp_permute(k_proj.numpy(), 3)))


@pytest.fixture(scope="module")
def reference_tokenizer(gguf_file, gguf_parsed_once):
    from transformers import AutoTokenizer

    with gguf_parsed_once():
        return AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


def _ids(encoded):
    # transformers 5 returns a BatchEncoding from apply_chat_template by default; 4.x a list.
    return list(encoded["input_ids"]) if hasattr(encoded, "keys") else list(encoded)


def test_converted_config_matches_transformers(converted, reference_state_dict):
    _, ref = reference_state_dict
    ours = converted.config
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"] == 100000.0


def test_tokenizer_matches_transformers_gguf_tokenizer(converted, reference_tokenizer):
    ours = load_tokenizer(converted.model_dir)
    assert ours.chat_template and ours.chat_template == reference_tokenizer.chat_template
    for generation_prompt in (True, False):
        a = ours.apply_chat_template(CHAT, add_generation_prompt=generation_prompt)
        b = reference_tokenizer.apply_chat_template(CHAT, add_generation_prompt=generation_prompt)
        assert _ids(a) == _ids(b)
    text = ours.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == reference_tokenizer.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == text
    assert ours.eos_token_id == reference_tokenizer.eos_token_id == converted.config.eos_token_id


def test_default_gguf_converts_into_the_cache(converted, cache_dir, gguf_file):
    assert converted.source == "gguf"
    assert converted.from_cache is False
    assert converted.architecture == "LlamaForCausalLM"
    assert converted.gguf_path == gguf_file.resolve()
    assert converted.model_dir.parent == cache_dir / "converted" == cache_root()
    names = {p.name for p in converted.model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", gguf_loader.MARKER_FILE} <= names
    # Atomic publish: no temporary directory is left beside the entry.
    assert not [p for p in cache_root().iterdir() if p.name.startswith(".tmp-")]
    marker = json.loads((converted.model_dir / gguf_loader.MARKER_FILE).read_text())
    assert marker["source"] == str(gguf_file.resolve())


def test_second_prepare_is_served_from_cache(converted, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a cache hit must not read or dequantize the GGUF")

    monkeypatch.setattr(gguf_loader, "open_gguf", fail)
    monkeypatch.setattr(gguf_loader, "dequantize_tensors", fail)
    weights_mtime = (converted.model_dir / "model.safetensors").stat().st_mtime_ns
    for name in (None, DEFAULT_MODEL_NAME, str(converted.gguf_path)):
        again = prepare_model(name, progress=False)
        assert again.from_cache is True and again.source == "gguf"
        assert again.model_dir == converted.model_dir
    assert (converted.model_dir / "model.safetensors").stat().st_mtime_ns == weights_mtime
