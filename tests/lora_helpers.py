"""LoRA adapters for tests, made with PEFT itself (the reference the server is checked against).

    from lora_helpers import make_peft_adapter, peft_greedy
    path = make_peft_adapter(model_dir, tmp_path / "a", seed=1, r=4, targets=["q_proj", "v_proj"])
    tokens = peft_greedy(model_dir, path, prompts, n=8)   # transformers + PEFT, float32, greedy

PEFT initialises B to zero (an adapter that changes nothing); here A and B are both random and
non-zero, scaled so the adapter changes the model's greedy tokens without drowning the base.
"""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(
    model_dir,
    out: str | Path,
    *,
    seed: int,
    r: int = 4,
    alpha: float = 8.0,
    targets: list[str] | None = None,
    std: float = 0.05,
    use_rslora: bool = False,
) -> Path:
    """Save a random LoRA adapter of the model at `model_dir` to `out` (PEFT's format); returns `out`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets or ALL_TARGETS,
        lora_dropout=0.0,
        bias="none",
        use_rslora=use_rslora,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    out = Path(out)
    peft_model.save_pretrained(str(out), safe_serialization=True)
    return out


def peft_model(model_dir, adapter_dir=None):
    """transformers' model with the adapter applied by PEFT (float32, eval), or the base model for None."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if adapter_dir is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(adapter_dir)).eval()


@torch.no_grad()
def peft_greedy(model_dir, adapter_dir, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuations of n tokens per prompt, one prompt at a time (no padding), by PEFT."""
    model = peft_model(model_dir, adapter_dir)
    outs = []
    for ids in prompts:
        seq = torch.tensor([ids])
        for _ in range(n):
            logits = model(input_ids=seq).logits[0, -1]
            seq = torch.cat([seq, logits.argmax().view(1, 1)], dim=1)
        outs.append(seq[0, len(ids) :].tolist())
    return outs


@torch.no_grad()
def peft_last_logits(model_dir, adapter_dir, prompt: list[int]) -> torch.Tensor:
    """The next-token logits after `prompt` (float32), by PEFT."""
    return peft_model(model_dir, adapter_dir)(input_ids=torch.tensor([prompt])).logits[0, -1]
