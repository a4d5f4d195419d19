"""End-to-end part of tests/fast/test_model_loader.py (what starts processes, engines or servers, or loads the
reference model).

Model loader: GGUF conversion (against transformers' own GGUF loader), HF dirs, cache, errors.

The expensive pieces (converting the default SmolLM2 GGUF, loading
transformers' reference model and tokenizer from the same file) run once per
module; everything else uses tiny random models from tiny_models.py.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import (
    llamacpp_permute,
)
from workbench.core.model_loader import (
    default_gguf_path,
    iter_weights,
    prepare_model,
)


@pytest.fixture(scope="module")
def converted(cache_dir):
    """The default model converted once (the first prepare_model of this module's cache)."""
    return prepare_model(None, progress=False)


@pytest.fixture(scope="module")
def gguf_file():
    return default_gguf_path()


@pytest.fixture(scope="module")
def reference_state_dict(gguf_file):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32)
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
