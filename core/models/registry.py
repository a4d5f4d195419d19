"""Model classes by `config.architectures[0]`."""

from __future__ import annotations

from workbench.core.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from workbench.core.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from workbench.core.models.mixtral import MixtralForCausalLM
from workbench.core.models.olmoe import OlmoeForCausalLM
from workbench.core.models.phi3 import Phi3ForCausalLM
from workbench.core.models.qwen3 import Qwen3ForCausalLM
from workbench.core.models.qwen3_moe import Qwen3MoeForCausalLM

# Every architecture's class is a LlamaForCausalLM (the runner calls its load_weights, compute_logits, lm_head).
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None
