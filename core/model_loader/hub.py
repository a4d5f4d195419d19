"""Models from the Hugging Face Hub: fetch what the engine reads, and nothing else.

`download_model("Qwen/Qwen2.5-0.5B-Instruct")` returns a local snapshot directory holding the
safetensors weights (with their index), config.json, generation_config.json, the tokenizer files
and the chat template; never PyTorch .bin, .pt, .h5, ONNX or the other formats a repository may
also carry. With `gguf_file` it fetches that one .gguf file instead (a GGUF repository), which
resolve.py then converts like a local GGUF. `download_config` fetches config.json alone (a
simulated model needs its shapes, not its weights).

Everything goes through `huggingface_hub`, into its cache (or `download_dir`), so a model
downloaded here is shared with transformers, vLLM and SGLang. The environment is read at call
time: HF_ENDPOINT (a mirror or a private hub), HF_TOKEN (gated and private models), HF_HOME /
HF_HUB_CACHE (the cache) and HF_HUB_OFFLINE (no network: the cache only). Files finished by an
earlier, interrupted run are kept, so running again fetches only the rest; a connection dropped
in the middle of a file is resumed by huggingface_hub with a Range request; and a file a killed
run left half-written (huggingface_hub 2.x leaves `<etag>.<id>.incomplete` in the cache's blobs
and starts such a file over) is continued from where it stopped by `_resume_leftovers`. Every
failure a user can cause becomes a one-line ModelLoadError saying what to do next.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from tqdm.auto import tqdm as _base_tqdm
from workbench.core.model_loader.errors import ModelLoadError, describe

DEFAULT_ENDPOINT = "https://huggingface.co"
SAFETENSORS_INDEX = "model.safetensors.index.json"
CONFIG_FILES = ("config.json", "generation_config.json")
# What AutoTokenizer and apply_chat_template read; a repository has some of them.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
_PYTORCH_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx")
_TRUE = {"1", "on", "yes", "true"}


# ---------------------------------------------------------------- settings


def hub_endpoint() -> str:
    """The Hub this process talks to: HF_ENDPOINT, else huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hub_cache_dir(download_dir: str | os.PathLike | None = None) -> Path:
    """Where downloads go: `download_dir`, else HF_HUB_CACHE, else $HF_HOME/hub (~/.cache/huggingface/hub)."""
    if download_dir:
        return Path(download_dir).expanduser()
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set: use the cache, never the network."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in _TRUE


def looks_like_repo_id(text: str) -> bool:
    """'ORG/NAME' with the Hub's characters (what model_specs treats as a Hub config)."""
    return bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*", text)) and ".." not in text


# ---------------------------------------------------------------- what to fetch


def select_files(repo_id: str, repo_files: Iterable[str], gguf_file: str | None = None) -> list[str]:
    """The files of `repo_files` the engine needs, or a ModelLoadError saying why the repository won't do.

    Top-level files only (sub-folders hold other formats: onnx/, original/ consolidated .pth, ...).
    The weights are every *.safetensors, or, with an index, the index and the shards it names are
    fetched (see `download_model`), so a repository's second copy of the weights is left alone.
    """
    files = list(repo_files)
    top = [f for f in files if "/" not in f]
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    if gguf_file:
        if gguf_file not in files:
            listed = f"its GGUF files: {', '.join(ggufs[:8])}" if ggufs else "it has no .gguf files"
            raise ModelLoadError(f"{repo_id} has no file {gguf_file!r} ({listed}); pass one of them to --gguf-file.")
        return [gguf_file]
    weights = sorted(f for f in top if f.endswith(".safetensors"))
    if not weights:
        if ggufs:
            raise ModelLoadError(
                f"{repo_id} is a GGUF repository ({', '.join(ggufs[:6])}{', ...' if len(ggufs) > 6 else ''}); "
                f"pick one with --gguf-file FILE, e.g. --gguf-file {_suggest_gguf(ggufs)}."
            )
        if any(f.endswith(_PYTORCH_SUFFIXES) for f in top):
            raise ModelLoadError(
                f"{repo_id} has only PyTorch/TF weights (.bin/.pt/.h5), no *.safetensors; pick a repository with "
                "safetensors weights (most models have one), or a GGUF repository with --gguf-file."
            )
        raise ModelLoadError(f"{repo_id} has no model weights (*.safetensors or .gguf); is it a model repository?")
    if "config.json" not in top:
        raise ModelLoadError(f"{repo_id} has no config.json at its top level; pass a transformers model repository.")
    wanted = [f for f in (*CONFIG_FILES, SAFETENSORS_INDEX, *TOKENIZER_FILES) if f in top]
    if SAFETENSORS_INDEX not in top:
        wanted += weights
    return wanted


def _suggest_gguf(ggufs: list[str]) -> str:
    for quant in ("Q4_K_M", "Q4_0", "Q8_0", "Q4_1"):
        for name in ggufs:
            if quant.lower() in name.lower():
                return name
    return ggufs[0]


# ---------------------------------------------------------------- progress


class _QuietTqdm(_base_tqdm):
    """No bar at all (progress=False)."""

    def __init__(self, *args, **kwargs):
        kwargs.pop("name", None)
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def _reporting_tqdm(on_progress: Callable[[str], None], label: str) -> type[_base_tqdm]:
    """A tqdm class that draws nothing and reports the byte bars to `on_progress` at most every 2 s
    (the TUI's start-up screen and notebooks show these lines instead of a terminal bar)."""
    last = {"t": 0.0}

    class Reporting(_base_tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            kwargs["disable"] = False  # counts, draws nowhere
            kwargs["file"] = _NullWriter()
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            out = super().update(n)
            now = time.monotonic()
            if self.unit == "B" and self.total and now - last["t"] >= 2.0:
                last["t"] = now
                on_progress(
                    f"downloading {label}: {self.n / self.total:.0%} of {_size(self.total)} "
                    f"({_size(self.format_dict.get('rate') or 0)}/s)"
                )
            return out

    return Reporting


class _NullWriter:
    """A file for tqdm to draw on that keeps nothing."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _tqdm_for(progress: bool, on_progress: Callable[[str], None] | None, label: str) -> type[_base_tqdm] | None:
    if not progress:
        return _QuietTqdm
    if on_progress is not None:
        return _reporting_tqdm(on_progress, label)
    return None  # huggingface_hub's own bars on stderr


def _say(progress: bool, on_progress: Callable[[str], None] | None, message: str) -> None:
    if not progress:
        return
    if on_progress is not None:
        on_progress(message)
    else:
        print(f"[workbench] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the cache


def cached_snapshot(repo_id: str, revision: str | None, download_dir=None, need: str = "config.json") -> Path | None:
    """The cached snapshot of `repo_id` at `revision` holding `need`, or None; never the network."""
    from huggingface_hub.file_download import REGEX_COMMIT_HASH, repo_folder_name

    storage = hub_cache_dir(download_dir) / repo_folder_name(repo_id=repo_id, repo_type="model")
    revision = revision or "main"
    if REGEX_COMMIT_HASH.fullmatch(revision):
        commit = revision
    else:
        try:
            commit = (storage / "refs" / revision).read_text().strip()
        except OSError:
            return None
    snapshot = storage / "snapshots" / commit
    return snapshot if (snapshot / need).is_file() else None


# ---------------------------------------------------------------- errors


def hub_error(exc: BaseException, repo_id: str, revision: str | None, download_dir=None) -> ModelLoadError:
    """A one-line, actionable ModelLoadError for a huggingface_hub failure (the cause chain is searched:
    huggingface_hub wraps a refused HEAD call in LocalEntryNotFoundError)."""
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    chain, seen = [], exc
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    endpoint, page = hub_endpoint(), f"{hub_endpoint()}/{repo_id}"
    has_token = bool(os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN"))
    for e in chain:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(e, GatedRepoError) or (
            status in (401, 403) and not isinstance(e, (RepositoryNotFoundError, RevisionNotFoundError))
        ):
            if has_token:
                return ModelLoadError(
                    f"{repo_id} is gated or private and HF_TOKEN's account has no access ({status}): accept the "
                    f"model's licence at {page} with that account, or set HF_TOKEN to a token of one that has access."
                )
            return ModelLoadError(
                f"{repo_id} is gated or private ({status}): accept the model's licence at {page}, then set HF_TOKEN "
                f"to an access token of that account ({DEFAULT_ENDPOINT}/settings/tokens), or run `hf auth login`."
            )
        if isinstance(e, RevisionNotFoundError):
            return ModelLoadError(
                f"{repo_id} has no revision {revision!r}; pass a branch, tag or commit it has to --revision "
                "(or leave --revision out for main)."
            )
        if isinstance(e, RepositoryNotFoundError):
            private = "" if has_token else ", or it is private and HF_TOKEN is not set"
            return ModelLoadError(
                f"no model repository {repo_id!r} at {endpoint} (check the name: ORG/NAME as on the model's page"
                f"{private}); or pass a local directory or .gguf file."
            )
        if isinstance(e, RemoteEntryNotFoundError):
            return ModelLoadError(f"{repo_id} lost a file while downloading ({describe(e)}); run the command again.")
        if isinstance(e, OfflineModeIsEnabled):
            break
        if isinstance(e, (httpx2.TransportError, ConnectionError, TimeoutError)):
            return ModelLoadError(
                f"cannot reach {endpoint} ({describe(e, 120)}) and {repo_id} is not in the cache "
                f"{hub_cache_dir(download_dir)}; check the network (or HF_ENDPOINT), then run again: finished files "
                "are kept. Or pass a local directory or .gguf file."
            )
        if isinstance(e, HfHubHTTPError):
            return ModelLoadError(
                f"{endpoint} answered {status} for {repo_id} ({describe(e, 120)}); try again later, or pass a local "
                "directory or .gguf file."
            )
    return ModelLoadError(
        f"downloading {repo_id} from {endpoint} failed ({describe(exc)}); run again to finish it "
        "(finished files are kept), or pass a local directory or .gguf file."
    )


def _offline_error(repo_id: str, revision: str | None, download_dir, what: str) -> ModelLoadError:
    rev = f" at revision {revision}" if revision else ""
    return ModelLoadError(
        f"HF_HUB_OFFLINE is set and {repo_id}{rev} has no {what} in the cache {hub_cache_dir(download_dir)}; "
        "unset HF_HUB_OFFLINE to download it, or pass a local directory or .gguf file."
    )


# ---------------------------------------------------------------- downloads


def download_model(
    repo_id: str,
    *,
    revision: str | None = None,
    download_dir: str | os.PathLike | None = None,
    gguf_file: str | None = None,
    progress: bool = True,
    on_progress: Callable[[str], None] | None = None,
    check_config: Callable[[dict], None] | None = None,
) -> Path:
    """Fetch `repo_id` (see the module docstring); return its snapshot directory, or the .gguf file's path.

    progress: show it (huggingface_hub's bars on stderr, or lines to `on_progress` when given).
    check_config: called with config.json's contents before any weight is fetched, to refuse a model
    the engine cannot run without downloading gigabytes first (it raises ModelLoadError).
    Files already in the cache are not fetched again. Raises ModelLoadError.
    """
    need = gguf_file or "config.json"
    if hub_offline():
        snapshot = cached_snapshot(repo_id, revision, download_dir, need)
        if snapshot is None:
            raise _offline_error(repo_id, revision, download_dir, need)
        return snapshot / gguf_file if gguf_file else snapshot
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    endpoint, cache_dir = hub_endpoint(), hub_cache_dir(download_dir)
    try:
        info = HfApi(endpoint=endpoint).model_info(repo_id, revision=revision, files_metadata=True)
    except Exception as exc:
        error = hub_error(exc, repo_id, revision, download_dir)
        snapshot = cached_snapshot(repo_id, revision, download_dir, need)
        unreachable = str(error).startswith(("cannot reach", f"{endpoint} answered 5"))  # no network, Hub down
        if snapshot is not None and unreachable:  # the cached copy will do
            _say(progress, on_progress, f"cannot reach {endpoint}; using the cached {repo_id} ({snapshot})")
            return snapshot / gguf_file if gguf_file else snapshot
        raise error from None
    sizes = {s.rfilename: (s.size or 0) for s in (info.siblings or [])}
    files = select_files(repo_id, sizes, gguf_file)
    label = f"{repo_id}" + (f"@{revision}" if revision else "")
    common = dict(repo_id=repo_id, revision=info.sha, cache_dir=str(cache_dir), endpoint=endpoint)
    tqdm_class = _tqdm_for(progress, on_progress, label)
    try:
        if check_config is not None and not gguf_file:
            config = hf_hub_download(filename="config.json", tqdm_class=_QuietTqdm, **common)
            try:
                parsed = json.loads(Path(config).read_text())
            except (OSError, ValueError) as exc:
                raise ModelLoadError(f"{repo_id}'s config.json could not be read ({describe(exc)}).") from None
            check_config(parsed)
        if SAFETENSORS_INDEX in files:  # the shards the index names, not every *.safetensors
            index = hf_hub_download(filename=SAFETENSORS_INDEX, tqdm_class=_QuietTqdm, **common)
            try:
                shards = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ModelLoadError(
                    f"{repo_id}'s {SAFETENSORS_INDEX} is not a safetensors index ({describe(exc)})."
                ) from None
            missing = [s for s in shards if s not in sizes]
            if missing:
                raise ModelLoadError(
                    f"{repo_id}'s {SAFETENSORS_INDEX} names shards the repository lacks ({', '.join(missing[:3])})."
                )
            files += shards
        total = sum(sizes.get(f, 0) for f in files)
        _say(progress, on_progress, f"fetching {label}: {len(files)} files, {_size(total)}, into {cache_dir}")
        _resume_leftovers(repo_id, [gguf_file] if gguf_file else files, common, cache_dir, tqdm_class)
        if gguf_file:
            path = Path(hf_hub_download(filename=gguf_file, tqdm_class=tqdm_class, **common))
        else:
            path = Path(snapshot_download(allow_patterns=files, tqdm_class=tqdm_class, max_workers=4, **common))
    except ModelLoadError:
        raise
    except Exception as exc:
        raise hub_error(exc, repo_id, revision, download_dir) from None
    # The files were fetched at the commit `revision` resolved to; remember that, so a run with
    # HF_HUB_OFFLINE (or without a network) finds them under the name the user gave.
    _write_ref(cache_dir, repo_id, revision or "main", info.sha)
    return path


def _resume_leftovers(repo_id: str, files: list[str], common: dict, cache_dir: Path, tqdm_class) -> None:
    """Continue the files a killed run left half-written, so a multi-GB shard is not fetched again
    from its first byte. huggingface_hub 2.x writes each file to `blobs/<etag>.<id>.incomplete` and,
    in a new run, starts a fresh one; a leftover is appended to with a Range request, checked against
    its etag (the sha256 of an LFS file) and moved to `blobs/<etag>`, where the download that follows
    finds it done. Under huggingface_hub's own lock for that blob, so a download still running in
    another process is waited for, never written into. Anything unexpected leaves the leftover alone
    (the normal download then fetches the file whole)."""
    import hashlib

    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get, repo_folder_name
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    folder = repo_folder_name(repo_id=repo_id, repo_type="model")
    blobs = cache_dir / folder / "blobs"
    leftovers = list(blobs.glob("*.incomplete")) if blobs.is_dir() else []
    if not leftovers:
        return
    etags = {p.name.split(".", 1)[0] for p in leftovers}
    for name in files:
        url = hf_hub_url(repo_id, name, revision=common["revision"], endpoint=common["endpoint"])
        meta = get_hf_file_metadata(url, endpoint=common["endpoint"])
        etag = meta.etag
        if not etag or etag not in etags:
            continue
        blob = blobs / etag
        with WeakFileLock(cache_dir / ".locks" / folder / f"{etag}.lock"):
            parts = [p for p in blobs.glob(f"{etag}.*.incomplete") if p.is_file()]
            if blob.exists() or not parts:
                continue
            part = max(parts, key=lambda p: p.stat().st_size)
            have = part.stat().st_size
            if meta.size is not None and have >= meta.size:
                continue  # complete but never moved, or longer than the file: let the normal path decide
            with part.open("ab") as fh:
                http_get(
                    meta.location,
                    fh,
                    resume_size=have,
                    headers=build_hf_headers(),
                    expected_size=meta.size,
                    displayed_filename=name,
                    tqdm_class=tqdm_class,
                )
            if re.fullmatch(r"[0-9a-f]{64}", etag):  # an LFS file: its etag is its sha256
                digest = hashlib.sha256()
                with part.open("rb") as fh:
                    for chunk in iter(lambda: fh.read(1 << 22), b""):
                        digest.update(chunk)
                if digest.hexdigest() != etag:
                    part.unlink()  # the leftover was not a prefix of this file: fetch it whole
                    continue
            os.replace(part, blob)
            for other in parts:
                if other != part:
                    other.unlink(missing_ok=True)


def _write_ref(cache_dir: Path, repo_id: str, revision: str, commit: str | None) -> None:
    from huggingface_hub.file_download import REGEX_COMMIT_HASH, repo_folder_name

    if not commit or REGEX_COMMIT_HASH.fullmatch(revision):
        return
    ref = cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model") / "refs" / revision
    try:
        if ref.is_file() and ref.read_text() == commit:
            return
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
        tmp.write_text(commit)
        os.replace(tmp, ref)
    except OSError:  # a read-only cache still serves this run
        pass


def download_config(
    repo_id: str, *, revision: str | None = None, download_dir: str | os.PathLike | None = None
) -> Path:
    """The local path of `repo_id`'s config.json, fetched if it is not cached (only that file).

    A cached copy is used without asking the network, so the processes of a simulated engine,
    which each resolve the model's spec, make at most one request between them.
    """
    cached = cached_snapshot(repo_id, revision, download_dir)
    if cached is not None:
        return cached / "config.json"
    if hub_offline():
        raise _offline_error(repo_id, revision, download_dir, "config.json")
    from huggingface_hub import HfApi, hf_hub_download

    endpoint, cache_dir = hub_endpoint(), hub_cache_dir(download_dir)
    try:
        # model_info first: it fails at once without a network (a file download retries for ~20 s)
        # and pins the commit the config comes from.
        info = HfApi(endpoint=endpoint).model_info(repo_id, revision=revision)
        path = hf_hub_download(
            repo_id,
            "config.json",
            revision=info.sha,
            cache_dir=str(cache_dir),
            endpoint=endpoint,
            tqdm_class=_QuietTqdm,
        )
    except Exception as exc:
        raise hub_error(exc, repo_id, revision, download_dir) from None
    _write_ref(cache_dir, repo_id, revision or "main", info.sha)
    return Path(path)
