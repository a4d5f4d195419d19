"""GGUF -> HF directory conversion, with a cache of converted models.

A GGUF file (llama.cpp's format) is turned into the same kind of directory a
user would download from the hub: config.json, model.safetensors (float32)
and tokenizer files with the chat template. The rest of the engine then only
ever reads HF directories.

Two details matter for correctness:
- llama.cpp names tensors differently (`blk.3.attn_q.weight`); we rename them
  to transformers' parameter names.
- For Llama-family models llama.cpp's converter reorders the rows of the Q and
  K projections (it pairs rotary dimensions as adjacent rows, GPT-J style,
  while HF pairs dimension i with i + head_dim/2). We undo that per head, the
  same maths as transformers' own GGUF loader, so the converted weights equal
  what `AutoModelForCausalLM.from_pretrained(gguf_file=...)` produces.
- Each family has its own names, layouts and unstored config (Gemma's 1 + w
  norms, stacked experts, Phi-3's LongRoPE factors): gguf_families.py.

Conversion takes seconds (dequantizing, building the tokenizer), so results
are cached under `${WORKBENCH_CACHE_DIR:-~/.cache/workbench}/converted/`,
keyed by the file's size, mtime and first MiB; a directory is published by an
atomic rename only once complete, so a crash never leaves a half cache entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from workbench.core.model_loader.errors import ModelLoadError, describe
from workbench.core.model_loader.gguf_families import (
    CONFIG_TENSORS,
    FAMILIES,
    GgufFamily,
    expected_tensors,
    family_key,
    hf_tensors,
)

logger = logging.getLogger(__name__)

# Bump when the output layout changes, so stale cache entries are not reused.
CONVERTER_VERSION = 1
MARKER_FILE = ".workbench-converted.json"
WEIGHTS_FILE = "model.safetensors"

# general.architecture -> transformers class. Mistral GGUFs say "llama" and convert to an
# equivalent Llama model (same weights, same maths); a "llama" file with experts is Mixtral.
GGUF_ARCHITECTURES = {k: f.architecture for k, f in FAMILIES.items() if k != "mixtral"}


# ---------------------------------------------------------------- cache keys


def cache_root() -> Path:
    """Where converted models live: `$WORKBENCH_CACHE_DIR/converted` (default ~/.cache/workbench)."""
    base = os.environ.get("WORKBENCH_CACHE_DIR") or "~/.cache/workbench"
    return Path(base).expanduser() / "converted"


def cache_key(gguf_path: Path) -> str:
    """A short hash of the file's size, mtime and first MiB (cheap; no full read of a large file)."""
    stat = gguf_path.stat()
    digest = hashlib.sha256(f"v{CONVERTER_VERSION}:{stat.st_size}:{stat.st_mtime_ns}:".encode())
    with open(gguf_path, "rb") as handle:
        digest.update(handle.read(1 << 20))
    return digest.hexdigest()[:16]


def converted_dir_for(gguf_path: Path) -> Path:
    """The cache directory a conversion of `gguf_path` is (or will be) stored in."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", gguf_path.stem) or "model"
    return cache_root() / f"{stem}-{cache_key(gguf_path)}"


def _is_complete(directory: Path) -> bool:
    return all((directory / name).is_file() for name in (MARKER_FILE, WEIGHTS_FILE, "config.json"))


@contextlib.contextmanager
def _conversion_lock(target: Path) -> Iterator[None]:
    """Serialise conversions of one file across processes (e.g. several TP ranks starting together)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone keeps the cache consistent
        yield
        return
    with open(target.parent / f".{target.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---------------------------------------------------------------- metadata


def open_gguf(gguf_path: Path):
    """A GGUFReader for the file, with damage reported as a ModelLoadError naming it."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(gguf_path))
    except Exception as exc:  # gguf raises ValueError/IndexError/struct errors on damaged files
        raise ModelLoadError(
            f"{gguf_path} is truncated or not a valid GGUF file ({describe(exc)}); re-download it."
        ) from None


def _meta(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_architecture(reader, gguf_path: Path) -> str:
    """general.architecture, checked against what this converter supports."""
    arch = _meta(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{gguf_path} has GGUF architecture {arch!r}; supported GGUF architectures are "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))} (use an HF safetensors directory for others)."
        )
    return arch


def gguf_family(reader, gguf_path: Path) -> GgufFamily:
    """The file's family (gguf_families.FAMILIES)."""
    arch = gguf_architecture(reader, gguf_path)
    return FAMILIES[family_key(arch, int(_meta(reader, f"{arch}.expert_count", 0) or 0))]


def build_config(reader, gguf_path: Path):
    """A transformers PretrainedConfig of the file's family from the GGUF metadata."""
    from transformers import AutoConfig

    arch = gguf_architecture(reader, gguf_path)
    if int(_meta(reader, "split.count", 1)) > 1:
        raise ModelLoadError(
            f"{gguf_path} is one part of a split GGUF; merge the parts first "
            "(llama-gguf-split --merge FIRST-PART OUT.gguf) and pass the merged file."
        )
    tensors = {t.name: t for t in reader.tensors}
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{gguf_path} has no token_embd.weight tensor; it is not a usable language model.")

    def required(key: str) -> Any:
        value = _meta(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{gguf_path} lacks the metadata key {arch}.{key}; re-export the GGUF with llama.cpp.")
        return value

    family = gguf_family(reader, gguf_path)
    hidden = int(required("embedding_length"))
    heads = int(required("attention.head_count"))
    kwargs: dict[str, Any] = dict(
        architectures=[family.architecture],
        # The embedding matrix is the truth for vocab size: llama.vocab_size is optional metadata.
        vocab_size=int(embed.shape[1]),
        hidden_size=hidden,
        intermediate_size=int(required("feed_forward_length")),
        num_hidden_layers=int(required("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_meta(reader, f"{arch}.attention.head_count_kv", heads)),
        max_position_embeddings=int(_meta(reader, f"{arch}.context_length", 2048)),
        rms_norm_eps=float(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_meta(reader, f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensors,
        dtype="float32",
    )
    rope_dim = _meta(reader, f"{arch}.rope.dimension_count")
    if arch == "llama" and rope_dim is not None:
        # Llama allows head_dim != hidden/heads; rotary covers the whole head there.
        kwargs["head_dim"] = int(rope_dim)
    scaling_type = _meta(reader, f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        kwargs["rope_scaling"] = {"rope_type": "linear", "factor": float(_meta(reader, f"{arch}.rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        logger.warning("%s: rope scaling %r is not converted; long contexts may degrade", gguf_path.name, scaling_type)
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        token_id = _meta(reader, f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            kwargs[key] = int(token_id)
    values = {n: _dequantize(tensors[n], gguf_path).reshape(-1).tolist() for n in CONFIG_TENSORS if n in tensors}
    kwargs.update(
        family.config(lambda key, default=None: _meta(reader, f"{arch}.{key}", default), {**tensors, **values}, kwargs)
    )
    return AutoConfig.for_model(family.model_type, **kwargs)


# ---------------------------------------------------------------- tensors


def unpermute_qk(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row interleaving of a Q or K projection (weight or bias).

    Within each head llama.cpp stores the rows as (pair, 2): row 2j is HF row j
    and row 2j+1 is HF row j + head_dim/2. Viewing the rows as
    (n_head, head_dim/2, 2) and swapping the last two axes restores HF's
    (n_head, 2, head_dim/2) order. `n_head` is the KV head count for K.
    """
    rows = weights.shape[0]
    if rows % (2 * n_head):
        raise ModelLoadError(
            f"a Q/K tensor with {rows} rows cannot be split into {n_head} heads; the GGUF is inconsistent."
        )
    half = rows // n_head // 2
    grouped = weights.reshape(n_head, half, 2, *weights.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(weights.shape)


def _dequantize(tensor, gguf_path: Path) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        weights = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ModelLoadError(
            f"{gguf_path}: tensor {tensor.name} uses quantization {tensor.tensor_type.name}, which the gguf "
            "package cannot dequantize; use another quantization of the model."
        ) from None
    except Exception as exc:
        raise ModelLoadError(
            f"{gguf_path}: tensor {tensor.name} is corrupt ({describe(exc)}); re-download the file."
        ) from None
    # ggml lists dimensions fastest-first; numpy/torch want them slowest-first.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    weights = weights.reshape(shape)
    # F32 tensors come back as views into the file's memory map: copy them out.
    return np.array(weights, dtype=np.float32, copy=not weights.flags.owndata)


def dequantize_tensors(reader, config, gguf_path: Path, progress: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF as float32 under its HF checkpoint name (experts one by one), in HF
    layout (Q/K rows in HF order, Gemma's norms as HF stores them)."""
    family = gguf_family(reader, gguf_path)
    out: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    for tensor in tqdm(reader.tensors, desc=f"Dequantizing {gguf_path.name}", unit="tensor", disable=not progress):
        if tensor.name in CONFIG_TENSORS:
            continue  # read into the config (build_config)
        weights = _dequantize(tensor, gguf_path)
        produced = False
        for name, w in hf_tensors(family, tensor.name, weights):
            produced = True
            if family.qk_permuted and ".self_attn.q_proj." in name:
                w = unpermute_qk(w, config.num_attention_heads)
            elif family.qk_permuted and ".self_attn.k_proj." in name:
                w = unpermute_qk(w, config.num_key_value_heads)
            out[name] = torch.from_numpy(np.ascontiguousarray(w))
        if not produced:
            skipped.append(tensor.name)
    if skipped:
        # e.g. llama3's rope_freqs: transformers' GGUF loader ignores these too.
        logger.warning("%s: ignored tensors with no HF counterpart: %s", gguf_path.name, ", ".join(skipped[:8]))
    missing = sorted(expected_tensors(family, config) - out.keys())
    if missing:
        raise ModelLoadError(
            f"{gguf_path} lacks {len(missing)} expected tensors (first: {missing[0]}); it is incomplete or not a "
            f"{family.architecture} checkpoint."
        )
    return out


# ---------------------------------------------------------------- tokenizer


def build_tokenizer(reader, gguf_path: Path):
    """transformers' tokenizer converted from the GGUF's vocabulary, with its chat template."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        except ValueError as exc:
            if "not supported" not in str(exc):
                raise
            # AutoTokenizer reads the model config first, and transformers' GGUF reader knows fewer
            # architectures than this converter (OLMoE); the tokenizer itself needs none of it.
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:  # the conversion raises many types on unusual vocabularies
        raise ModelLoadError(
            f"could not build a tokenizer from {gguf_path} ({type(exc).__name__}: {describe(exc)}); "
            "use an HF directory with tokenizer files instead."
        ) from None
    template = _meta(reader, "tokenizer.chat_template")
    if template:
        tokenizer.chat_template = template
    return tokenizer


# ---------------------------------------------------------------- entry point


def convert_gguf(gguf_path: str | Path, progress: bool = True) -> tuple[Path, bool]:
    """Convert a GGUF file to a cached HF directory; return `(directory, served_from_cache)`.

    A cache hit costs a stat and a 1 MiB read. On a miss the file is
    dequantized, written to a private temporary directory next to the cache
    entry, and renamed into place once complete.
    """
    from safetensors.torch import save_file

    gguf_path = Path(gguf_path).expanduser().resolve()
    target = converted_dir_for(gguf_path)
    if _is_complete(target):
        return target, True
    with _conversion_lock(target):
        if _is_complete(target):  # another process finished it while we waited
            return target, True
        started = time.monotonic()
        if progress:  # said only when it happens, so a bad model path is not preceded by it
            print(f"converting {gguf_path.name} to a cached HF directory (once): {target}", file=sys.stderr, flush=True)
        reader = open_gguf(gguf_path)
        config = build_config(reader, gguf_path)
        tmp = target.parent / f".tmp-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir(parents=True)
            # transformers' tokenizer conversion re-parses the file in pure Python while
            # dequantizing is mostly numpy (GIL released): overlapping them saves seconds.
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gguf-tokenizer") as pool:
                tokenizer_future = pool.submit(build_tokenizer, reader, gguf_path)
                tensors = dequantize_tensors(reader, config, gguf_path, progress)
                save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
                del tensors
                config.save_pretrained(str(tmp))
                tokenizer_future.result().save_pretrained(str(tmp))
            stat = gguf_path.stat()
            marker = {
                "converter_version": CONVERTER_VERSION,
                "source": str(gguf_path),
                "size": stat.st_size,
                "mtime_ns": stat.st_mtime_ns,
                "architecture": config.architectures[0],
                "seconds": round(time.monotonic() - started, 2),
            }
            # The marker is written last: its presence means the directory is whole.
            (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2))
            if target.exists():  # an incomplete leftover from an older, non-atomic writer
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s to %s in %.1fs", gguf_path.name, target, time.monotonic() - started)
    return target, False
