"""Model loading: resolve `--model` to an HF directory, read its weights and tokenizer.

The model runner calls `prepare_model(path)` once, then `iter_weights` and
`load_tokenizer` on the returned `PreparedModel.model_dir`. GGUF files
(including the default SmolLM2-135M-Instruct) are converted to a cached HF
directory first, so everything downstream reads one format.
"""

from workbench.core.model_loader.errors import ModelLoadError
from workbench.core.model_loader.gguf_loader import cache_root, convert_gguf, converted_dir_for
from workbench.core.model_loader.hf_loader import iter_weights, load_tokenizer
from workbench.core.model_loader.resolve import (
    DEFAULT_MODEL_NAME,
    SUPPORTED_ARCHITECTURES,
    PreparedModel,
    default_gguf_path,
    prepare_model,
)

__all__ = [
    "DEFAULT_MODEL_NAME",
    "SUPPORTED_ARCHITECTURES",
    "ModelLoadError",
    "PreparedModel",
    "cache_root",
    "convert_gguf",
    "converted_dir_for",
    "default_gguf_path",
    "iter_weights",
    "load_tokenizer",
    "prepare_model",
]
