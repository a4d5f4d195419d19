"""Reading an HF-style model directory: safetensors weights and the tokenizer.

Both the user's own HF directories and the directories the GGUF converter
writes go through here, so the model runner has one way to read weights.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm
from workbench.core.model_loader.errors import ModelLoadError, describe

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"

# Any one of these lets AutoTokenizer build a tokenizer without the network.
_TOKENIZER_FILE_SETS = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))

# Used only when a directory ships no chat template at all: ChatML is what
# SmolLM2 and Qwen2 use, so it is the least surprising guess for this project.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def list_safetensors(model_dir: Path) -> list[Path]:
    """The weight files of `model_dir`, in shard order.

    When a sharded checkpoint has an index, the index is the source of truth:
    every shard it names must exist, and stray *.safetensors files that it does
    not name (left over from an older download, say) are ignored.
    """
    model_dir = Path(model_dir)
    index_path = model_dir / SAFETENSORS_INDEX
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(
                f"{index_path} is not a valid safetensors index ({describe(exc)}); re-download or re-save the model."
            ) from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(
                f"{index_path} names shards that are missing: {', '.join(missing)}; re-download the model."
            )
        return files
    return sorted(model_dir.glob("*.safetensors"))


def check_safetensors(path: Path) -> int:
    """Validate one safetensors file's header against its size; return its tensor count.

    safetensors compares the header's offsets with the file length when the
    file is opened, so a truncated download is caught here, before any weight
    is read, rather than half way through loading.
    """
    try:
        with safe_open(str(path), framework="pt") as handle:
            return len(list(handle.keys()))
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(
            f"{path} is truncated or corrupt ({describe(exc)}); delete it and re-download or re-convert the model."
        ) from None


def has_tokenizer_files(model_dir: Path) -> bool:
    """Whether `model_dir` holds enough files for AutoTokenizer to work offline."""
    return any(all((Path(model_dir) / name).is_file() for name in group) for group in _TOKENIZER_FILE_SETS)


def _thread_only_tqdm_lock() -> None:
    """tqdm's default lock includes a multiprocessing semaphore; a scheduler process ends by
    SIGTERM and cannot unlink it, so every engine shutdown warned of a leaked semaphore.
    No bar here is shared across processes, so a thread lock is all it needs."""
    import threading

    if getattr(tqdm, "_lock", None) is None:
        tqdm.set_lock(threading.RLock())


def iter_weights(model_dir: str | Path, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_parameter_name, tensor)` for every tensor in the directory's safetensors files.

    Works across one file or many shards. Tensors keep the dtype they were
    stored in (the model runner casts them); a tied `lm_head.weight` is absent
    when the checkpoint ties it to the embeddings, as transformers saves it.
    A tqdm bar counts tensors across all shards unless `progress` is False.
    """
    model_dir = Path(model_dir)
    files = list_safetensors(model_dir)
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors files; save the model with safe_serialization=True.")
    total = sum(check_safetensors(f) for f in files)
    _thread_only_tqdm_lock()
    with tqdm(total=total, desc=f"Loading weights ({model_dir.name})", unit="tensor", disable=not progress) as bar:
        for path in files:
            try:
                with safe_open(str(path), framework="pt") as handle:
                    for name in handle.keys():
                        tensor = handle.get_tensor(name)
                        bar.update(1)
                        yield name, tensor
            except (SafetensorError, OSError) as exc:
                raise ModelLoadError(
                    f"{path} could not be read ({describe(exc)}); delete it and re-download or re-convert the model."
                ) from None


def load_tokenizer(model_dir: str | Path):
    """The directory's tokenizer (AutoTokenizer), guaranteed to carry a chat template.

    A directory without a chat template gets a plain ChatML one (logged), so
    chat requests work rather than fail on a base model.
    """
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # transformers raises many types for a broken tokenizer
        raise ModelLoadError(
            f"could not load the tokenizer from {model_dir} ({type(exc).__name__}: {describe(exc)}); "
            "check its tokenizer.json / tokenizer_config.json."
        ) from None
    if not tokenizer.chat_template:
        logger.warning("%s has no chat template; using a generic ChatML template", model_dir)
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    return tokenizer
