"""Live weight updates against a running Engine (CPU, gloo, the real default model in float32).

A trainer process perturbs a copy of the weights and broadcasts them over its own gloo group;
a second checkpoint is loaded from disk; tensors are pushed in process. After each update
`get_weights_by_name` returns the new values (HF names, fused parts included) and greedy output
equals transformers run with the same weights. Rejected updates leave the old weights serving.

The end-to-end tests of this module are in tests/e2e/test_weight_updates_e2e.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def model_dir(default_prepared) -> Path:
    return Path(default_prepared.model_dir)


@pytest.mark.parametrize("rank", [0, 1])
def test_hf_names_map_to_tp_shards(tmp_path, rank):
    """Under TP 2 every HF name keeps its full shape, and loads into this rank's slice of the fused param."""
    from safetensors.torch import load_file
    from tiny_models import make_tiny_qwen2
    from transformers import AutoConfig
    from workbench.core.distributed.parallel_state import set_tp_group
    from workbench.core.managers.weight_updater import check_weights, weight_specs
    from workbench.core.models.registry import get_model_class

    model_dir = make_tiny_qwen2(tmp_path / "qwen")
    config = AutoConfig.from_pretrained(model_dir)
    set_tp_group(rank, 2)
    try:
        model = get_model_class(config.architectures[0])(config)
    finally:
        set_tp_group(0, 1)
    state = load_file(str(model_dir / "model.safetensors"))
    specs = weight_specs(model)
    assert set(state) <= set(specs)
    check_weights(model, [(n, t.shape, t.dtype) for n, t in state.items()], specs)
    model.load_weights(state.items())
    for name in (
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.self_attn.v_proj.bias",
        "model.layers.0.mlp.up_proj.weight",
    ):
        spec = specs[name]
        part = model.get_parameter(spec.param_name).narrow(0, spec.local_offset, spec.local_size)
        assert torch.equal(part, state[name].chunk(2)[rank]), name
    assert specs["model.layers.0.self_attn.o_proj.weight"].split_dim == 1
