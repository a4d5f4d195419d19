"""Reading a LoRA adapter in PEFT's format: adapter_config.json + adapter_model.safetensors.

PEFT stores, for each targeted projection `...layers.{i}.{self_attn|mlp}.{name}`, a down
projection `lora_A.weight` [r, in] and an up projection `lora_B.weight` [out, r]; the layer
then computes base(x) + (x @ A^T @ B^T) * scaling, with scaling = lora_alpha / r
(lora_alpha / sqrt(r) under rsLoRA). Here the scaling is folded into B once at load time.

Everything a user can get wrong (a missing or corrupt file, a rank above --max-lora-rank,
a projection the server does not serve) raises `LoRAError` with what to do next.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

# The projections an adapter may target, as PEFT names them (Llama-family layer names).
SUPPORTED_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",  # Phi-3's fused projections, as its checkpoints (and so PEFT) name them
    "gate_up_proj",
)
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class LoRAError(ValueError):
    """A user-caused LoRA problem (bad adapter, unknown name, adapter in use); the message says what to do."""


class LoRABusyError(LoRAError):
    """Every loaded adapter is in use and --max-loaded-loras allows no more: not the request's fault; a
    request naming an adapter that is not loaded waits in the queue until one is idle."""


@dataclass
class LoRAConfig:
    """The fields of adapter_config.json the server uses."""

    r: int
    lora_alpha: float
    target_modules: list[str]
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def from_dir(cls, path: Path) -> LoRAConfig:
        cfg_path = path / "adapter_config.json"
        if not cfg_path.is_file():
            raise LoRAError(
                f"{path} has no adapter_config.json: a LoRA adapter is a directory in PEFT's format "
                "(adapter_config.json + adapter_model.safetensors, as PeftModel.save_pretrained writes it)"
            )
        try:
            raw = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as e:
            raise LoRAError(f"{cfg_path} is not valid JSON ({e}); save the adapter again") from e
        if not isinstance(raw, dict):
            raise LoRAError(f"{cfg_path} must hold a JSON object")
        peft_type = str(raw.get("peft_type", "LORA")).upper()
        if peft_type != "LORA":
            raise LoRAError(f"{path} is a {peft_type} adapter; only LoRA adapters are served")
        for key, why in (
            ("use_dora", "DoRA"),
            ("rank_pattern", "per-module ranks"),
            ("alpha_pattern", "per-module alphas"),
        ):
            if raw.get(key):
                raise LoRAError(f"{path} uses {why} ({key}), which this server does not serve; use a plain LoRA")
        if raw.get("bias", "none") != "none":
            raise LoRAError(f"{path} trains biases (bias={raw['bias']!r}); only bias='none' adapters are served")
        if raw.get("modules_to_save"):
            raise LoRAError(f"{path} saves whole modules ({raw['modules_to_save']}); only LoRA weights are served")
        try:
            r, alpha = int(raw["r"]), float(raw.get("lora_alpha", raw["r"]))
        except (KeyError, TypeError, ValueError) as e:
            raise LoRAError(f"{cfg_path} lacks a valid rank `r` ({e})") from e
        if r < 1:
            raise LoRAError(f"{cfg_path}: the rank r must be at least 1, not {r}")
        targets = raw.get("target_modules") or []
        if isinstance(targets, str):  # PEFT also takes a regex over module names
            targets = [t for t in SUPPORTED_TARGETS if re.fullmatch(targets, t) or re.search(rf"\.{t}$", targets)]
        return cls(r=r, lora_alpha=alpha, target_modules=sorted(set(targets)), use_rslora=bool(raw.get("use_rslora")))


@dataclass
class LoRAAdapter:
    """One loaded adapter: per (layer, PEFT projection name), A [r, in] and B*scaling [out, r]."""

    name: str
    path: str
    uid: int  # unique per load: keys the radix cache's namespace (a reload never reuses old KV)
    config: LoRAConfig
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # per host layer ("{layer}.{host path}"), this rank's stacked weights (LoRAManager builds them)
    hosts: dict = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.config.r

    def nbytes(self) -> int:
        total = 0
        for d in self.hosts.values():
            total += d.a_t.numel() * d.a_t.element_size() + sum(b.numel() * b.element_size() for *_, b in d.slices)
        return total


def read_adapter(
    name: str,
    path: str,
    uid: int,
    dtype: torch.dtype,
    max_rank: int | None,
    allowed_targets: set[str],
    num_layers: int,
) -> LoRAAdapter:
    """Load and check one adapter directory (weights on the CPU, in `dtype`, scaling folded into B)."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise LoRAError(f"LoRA adapter {name!r}: {path} is not a directory; give the folder PEFT saved the adapter to")
    config = LoRAConfig.from_dir(root)
    if max_rank is not None and config.r > max_rank:
        raise LoRAError(
            f"LoRA adapter {name!r} has rank {config.r}, above --max-lora-rank {max_rank}; restart with "
            f"--max-lora-rank {config.r} (or more)"
        )
    unknown = sorted(set(config.target_modules) - set(SUPPORTED_TARGETS))
    if unknown:
        raise LoRAError(
            f"LoRA adapter {name!r} targets {unknown}, which this model has no such projection for "
            f"(served: {', '.join(SUPPORTED_TARGETS)})"
        )
    outside = sorted(set(config.target_modules) - allowed_targets)
    if outside:
        raise LoRAError(
            f"LoRA adapter {name!r} targets {outside}, outside --lora-target-modules "
            f"({' '.join(sorted(allowed_targets))}); restart with them added (or `all`)"
        )
    tensors = _read_tensors(name, root)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoRAError(
                f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A/B weight of a decoder layer's projection "
                "(embedding or LM-head adapters are not served)"
            )
        layer, target, ab = int(m.group(1)), m.group(2), m.group(3)
        if target not in SUPPORTED_TARGETS:
            raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} targets {target}, which is not served")
        if layer >= num_layers:
            raise LoRAError(f"LoRA adapter {name!r}: {key!r} names layer {layer}; the model has {num_layers}")
        pairs.setdefault((layer, target), {})[ab] = t
    if not pairs:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    adapter = LoRAAdapter(name=name, path=str(root), uid=uid, config=config)
    scaling = config.scaling
    for (layer, target), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {target} has lora_{''.join(ab)} only; save it again")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoRAError(
                f"LoRA adapter {name!r}: layer {layer} {target} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                "which do not chain (A is [r, in], B is [out, r])"
            )
        if max_rank is not None and a.shape[0] > max_rank:
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {target} has rank {a.shape[0]} > {max_rank}")
        adapter.weights[(layer, target)] = (
            a.to(dtype).contiguous(),
            (b.to(torch.float32) * scaling).to(dtype).contiguous(),
        )
    return adapter


def _read_tensors(name: str, root: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    st = root / "adapter_model.safetensors"
    if not st.is_file():
        bin_path = root / "adapter_model.bin"
        hint = " (it has adapter_model.bin: save with safe_serialization=True)" if bin_path.is_file() else ""
        raise LoRAError(f"LoRA adapter {name!r}: {root} has no adapter_model.safetensors{hint}")
    try:
        return load_file(str(st), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: {st} cannot be read ({e}); the file is corrupt, save it again") from e
