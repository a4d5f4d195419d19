"""`--model ORG/NAME` downloads from the Hugging Face Hub (core/model_loader/hub.py), tested offline
against a local Hub-compatible file server (tests/fake_hub.py) that HF_ENDPOINT points at, with
HF_HOME in tmp_path: only the files the engine reads are fetched; a dropped connection is resumed
with a Range request, a killed run's half-written file is continued by the next from where it
stopped, and a failed run is finished by the next one without fetching twice; a
missing repository, a missing revision, a gated one (401 without a token, 403 with one that has no
access), no network and HF_HUB_OFFLINE with nothing cached each give one clear line; a GGUF
repository with --gguf-file; and a simulated model's spec from a Hub config fetches config.json
only. (tests/e2e/test_hub_download_e2e.py: the downloaded model generates the tokens the same
files give as a directory.)"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
import torch
from fake_hub import FakeHub, point_hf_at
from safetensors.torch import save_file
from tiny_models import make_tiny_gguf, make_tiny_llama, make_tiny_llama_sharded
from workbench.core.args import ServerArgs
from workbench.core.model_loader import ModelLoadError, prepare_model
from workbench.core.model_loader.hub import download_model, select_files
from workbench.core.simulation.model_specs import model_spec

ENGINE_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
}


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory) -> Path:
    """A tiny Llama as a repository would hold it: the engine's files and others it must not fetch."""
    root = make_tiny_llama(tmp_path_factory.mktemp("repo") / "tiny")
    (root / "pytorch_model.bin").write_bytes(b"\0" * 4096)
    (root / "README.md").write_text("# tiny\n")
    (root / "onnx").mkdir()
    (root / "onnx" / "model.safetensors").write_bytes(b"\0" * 1024)
    return root


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A running FakeHub with HF_ENDPOINT at it, HF_HOME in tmp_path, no token, online."""
    with FakeHub() as server:
        point_hf_at(monkeypatch, server, tmp_path / "hf-home")
        monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "workbench-cache"))
        yield server


def _same_bytes(a: Path, b: Path) -> bool:
    return a.read_bytes() == b.read_bytes()


def test_download_fetches_only_what_the_engine_reads(hub, tiny_repo, tmp_path):
    sha = hub.add_repo("acme/tiny", tiny_repo)
    prepared = prepare_model("acme/tiny", progress=False)
    snapshot = prepared.model_dir
    assert snapshot == tmp_path / "hf-home" / "hub" / "models--acme--tiny" / "snapshots" / sha
    assert {p.name for p in snapshot.iterdir()} == ENGINE_FILES
    assert prepared.architecture == "LlamaForCausalLM" and prepared.source == "hf"
    for name in ENGINE_FILES:
        assert _same_bytes(snapshot / name, tiny_repo / name), name
    fetched = {r[1].rsplit("/", 1)[-1] for r in hub.gets()}
    assert fetched == ENGINE_FILES  # never the .bin, the README or onnx/
    # A second prepare asks the Hub what main is, and fetches nothing again.
    before = len(hub.gets())
    assert prepare_model("acme/tiny", progress=False).model_dir == snapshot
    assert len(hub.gets()) == before


def test_sharded_repository_fetches_the_shards_its_index_names(hub, tmp_path):
    root = make_tiny_llama_sharded(tmp_path / "sharded")
    shards = sorted(p.name for p in root.glob("model-*.safetensors"))
    assert len(shards) > 1
    (root / "consolidated.safetensors").write_bytes((root / shards[0]).read_bytes())  # a second copy, as Mistral's
    hub.add_repo("acme/sharded", root)
    prepared = prepare_model("acme/sharded", progress=False, download_dir=str(tmp_path / "mine"))
    assert str(prepared.model_dir).startswith(str(tmp_path / "mine"))
    names = {p.name for p in prepared.model_dir.iterdir()}
    assert set(shards) <= names and "model.safetensors.index.json" in names
    assert "consolidated.safetensors" not in names and not hub.gets("consolidated.safetensors")


def test_unsupported_architecture_is_refused_before_the_weights(hub, tiny_repo, tmp_path):
    root = shutil.copytree(tiny_repo, tmp_path / "neox")
    config = json.loads((root / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (root / "config.json").write_text(json.dumps(config))
    hub.add_repo("acme/neox", root)
    with pytest.raises(ModelLoadError, match="acme/neox is a GPTNeoXForCausalLM .nothing else was downloaded"):
        prepare_model("acme/neox", progress=False)
    assert [r[1].rsplit("/", 1)[-1] for r in hub.gets()] == ["config.json"]


def test_dropped_connection_is_resumed_with_a_range_request(hub, tmp_path):
    root = tmp_path / "big"
    root.mkdir()
    (root / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    # Larger than huggingface_hub's 10 MB read chunk, so half of it has reached the disk when the line drops.
    save_file({"w": torch.arange(6 * 1024 * 1024, dtype=torch.float32)}, str(root / "model.safetensors"))
    hub.add_repo("acme/big", root)
    hub.drop_once.add("model.safetensors")
    snapshot = download_model("acme/big", progress=False)
    assert _same_bytes(snapshot / "model.safetensors", root / "model.safetensors")
    gets = hub.gets("model.safetensors")
    assert len(gets) == 2 and gets[0][2] is None
    resumed_at = int(gets[1][2].removeprefix("bytes=").rstrip("-"))
    assert resumed_at >= 10 * 1024 * 1024  # from where it stopped, not from the start


def test_a_killed_download_is_continued_where_it_stopped(hub, tmp_path):
    """A run killed in the middle of a file (no exception handler runs) leaves its partial blob; the
    next run continues it with a Range request from there, not from the first byte, and the bytes
    are the file's."""
    import os
    import subprocess
    import sys
    import time

    root = tmp_path / "big"
    root.mkdir()
    (root / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    save_file({"w": torch.arange(4 * 1024 * 1024, dtype=torch.float32)}, str(root / "model.safetensors"))  # 16 MiB
    hub.add_repo("acme/big", root)
    hub.slow.add("model.safetensors")  # ~1.3 s for the whole file: time to kill the first run
    code = "from workbench.core.model_loader.hub import download_model; download_model('acme/big', progress=False)"
    first = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ))
    blobs = tmp_path / "hf-home" / "hub" / "models--acme--big" / "blobs"
    deadline, partial = time.monotonic() + 60, []
    while time.monotonic() < deadline:
        partial = [p for p in blobs.glob("*.incomplete")] if blobs.is_dir() else []
        if partial and partial[0].stat().st_size >= 4 * 1024 * 1024:
            break
        time.sleep(0.01)
    first.kill()
    first.wait()
    assert partial, "the first run never started writing the file"
    had = partial[0].stat().st_size
    assert had < (root / "model.safetensors").stat().st_size  # killed in the middle
    hub.slow.clear()
    snapshot = download_model("acme/big", progress=False)
    assert _same_bytes(snapshot / "model.safetensors", root / "model.safetensors")
    second = hub.gets("model.safetensors")[-1]
    assert second[2] is not None and int(second[2].removeprefix("bytes=").rstrip("-")) >= had
    assert not list(blobs.glob("*.incomplete"))  # nothing left behind


def test_progress_goes_to_on_progress_as_lines(hub, tiny_repo):
    """What the TUI's start-up screen shows while a model downloads (no terminal bar)."""
    hub.add_repo("acme/tiny", tiny_repo)
    lines: list[str] = []
    prepare_model("acme/tiny", on_progress=lines.append)
    assert lines[0].startswith("fetching acme/tiny: 6 files, ") and "hf-home" in lines[0]
    assert any(line.startswith("downloading acme/tiny: ") and "% of " in line for line in lines[1:]), lines


def test_a_failed_run_is_finished_by_the_next_without_fetching_twice(hub, tiny_repo):
    hub.add_repo("acme/tiny", tiny_repo)
    hub.fail.add("tokenizer.json")  # the Hub stumbles on one file
    with pytest.raises(ModelLoadError, match="answered 500 for acme/tiny"):
        prepare_model("acme/tiny", progress=False)
    assert hub.gets("model.safetensors")  # fetched before the failure (the first four start together)
    hub.fail.clear()
    prepared = prepare_model("acme/tiny", progress=False)
    assert _same_bytes(prepared.model_dir / "tokenizer.json", tiny_repo / "tokenizer.json")
    assert len(hub.gets("tokenizer.json")) == 2
    assert len(hub.gets("model.safetensors")) == 1  # kept from the failed run


def test_missing_repository_and_revision_say_what_to_do(hub, tiny_repo, monkeypatch):
    hub.add_repo("acme/tiny", tiny_repo)
    with pytest.raises(ModelLoadError) as exc:
        prepare_model("acme/no-such-model", progress=False)
    message = str(exc.value)
    assert "no model repository 'acme/no-such-model'" in message and "HF_TOKEN" in message
    assert "\n" not in message
    monkeypatch.setenv("HF_TOKEN", "hf_any")  # with a token the Hub says 404, and the line drops the token hint
    with pytest.raises(ModelLoadError, match="no model repository 'acme/no-such-model'.*as on the model's page[)]"):
        prepare_model("acme/no-such-model", progress=False)
    with pytest.raises(ModelLoadError, match="has no revision 'v9'.*--revision"):
        prepare_model("acme/tiny", progress=False, revision="v9")


def test_gated_repository_asks_for_a_token_and_the_licence(hub, tiny_repo, monkeypatch):
    hub.add_repo("meta/gated", tiny_repo, gated=True, tokens={"hf_good"})
    with pytest.raises(ModelLoadError) as exc:  # no token: 401
        prepare_model("meta/gated", progress=False)
    message = str(exc.value)
    assert "gated" in message and "(401)" in message and "HF_TOKEN" in message
    assert f"{hub.url}/meta/gated" in message and "\n" not in message
    monkeypatch.setenv("HF_TOKEN", "hf_other")  # a token without access: 403
    with pytest.raises(ModelLoadError, match=r"\(403\).*accept the model's licence"):
        prepare_model("meta/gated", progress=False)
    monkeypatch.setenv("HF_TOKEN", "hf_good")  # HF_TOKEN is what huggingface_hub sends
    assert prepare_model("meta/gated", progress=False).architecture == "LlamaForCausalLM"


def test_offline_and_unreachable_hub(hub, tiny_repo, monkeypatch):
    hub.add_repo("acme/tiny", tiny_repo)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set and acme/tiny has no config.json in the cache"):
        prepare_model("acme/tiny", progress=False)
    assert hub.requests == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", closed)
    with pytest.raises(ModelLoadError, match=f"cannot reach {closed}.*not in the cache"):
        prepare_model("acme/tiny", progress=False)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    snapshot = prepare_model("acme/tiny", progress=False).model_dir
    # Cached now: offline, and with the Hub unreachable, the same snapshot without a request.
    count = len(hub.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert prepare_model("acme/tiny", progress=False).model_dir == snapshot
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", closed)
    assert prepare_model("acme/tiny", progress=False).model_dir == snapshot
    assert len(hub.requests) == count
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    hub.down = True  # the Hub answers 503: the cached copy too
    assert prepare_model("acme/tiny", progress=False).model_dir == snapshot
    hub.repos.clear()
    hub.down = False
    with pytest.raises(ModelLoadError, match="no model repository"):  # but a refusal is not papered over
        prepare_model("acme/tiny", progress=False)


def test_gguf_repository_needs_gguf_file(hub, tmp_path):
    root = tmp_path / "gguf-repo"
    root.mkdir()
    make_tiny_gguf(root / "tiny-Q8_0.gguf")
    shutil.copy(root / "tiny-Q8_0.gguf", root / "tiny-F32.gguf")
    hub.add_repo("acme/tiny-gguf", root)
    with pytest.raises(ModelLoadError, match="GGUF repository.*--gguf-file tiny-Q8_0.gguf"):
        prepare_model("acme/tiny-gguf", progress=False)
    with pytest.raises(ModelLoadError, match="has no file 'nope.gguf'.*tiny-F32.gguf"):
        prepare_model("acme/tiny-gguf", progress=False, gguf_file="nope.gguf")
    prepared = prepare_model("acme/tiny-gguf", progress=False, gguf_file="tiny-Q8_0.gguf")
    assert prepared.source == "gguf" and prepared.architecture == "LlamaForCausalLM"
    assert [r[1].rsplit("/", 1)[-1] for r in hub.gets()] == ["tiny-Q8_0.gguf"]


def test_simulated_model_spec_from_a_hub_config_fetches_config_only(hub, tiny_repo):
    hub.add_repo("acme/tiny", tiny_repo)
    spec = model_spec("acme/tiny")
    assert spec.name == "acme/tiny" and (spec.hidden, spec.layers, spec.heads, spec.kv_heads) == (64, 2, 4, 2)
    assert [r[1].rsplit("/", 1)[-1] for r in hub.gets()] == ["config.json"]
    count = len(hub.requests)
    assert model_spec("acme/tiny") == spec  # the simulated engine's processes each ask: from the cache
    assert len(hub.requests) == count
    hub.add_repo("meta-llama/Llama-3.1-70B-Instruct", tiny_repo, gated=True)
    with pytest.raises(ValueError, match="gated.*HF_TOKEN.*--model llama-3.1-70b"):
        model_spec("meta-llama/Llama-3.1-70B-Instruct")


def test_sim_run_over_a_hub_id_at_a_revision_fetches_its_config_into_the_download_dir(hub, tiny_repo, tmp_path, capsys):
    from workbench.cli import build_parser

    sha = hub.add_repo("acme/tiny", tiny_repo)
    where = tmp_path / "models"
    argv = ["sim", "run", "--model", "acme/tiny", "--revision", sha, "--download-dir", str(where)]
    args = build_parser().parse_args(argv + ["--simulate", "h100", "--num-requests", "4", "--rate", "0"])
    assert args.func(args) == 0
    assert "acme/tiny" in capsys.readouterr().out  # the simulated model, named after its repository
    assert [r[1] for r in hub.gets()] == [f"/acme/tiny/resolve/{sha}/config.json"]  # once, at that revision
    assert list(where.rglob("config.json")) and not list(where.rglob("*.safetensors"))


def test_select_files_and_the_new_flags():
    listing = ["config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.model", "onnx/model.onnx"]
    assert select_files("a/b", listing) == ["config.json", "tokenizer.model", "model.safetensors"]
    with pytest.raises(ModelLoadError, match="only PyTorch"):
        select_files("a/b", ["config.json", "pytorch_model.bin"])
    sa = ServerArgs(model_path="acme/tiny", revision="v1", download_dir="/tmp/x", gguf_file="m-Q4_K_M.gguf")
    assert (sa.revision, sa.download_dir, sa.gguf_file) == ("v1", "/tmp/x", "m-Q4_K_M.gguf")
    with pytest.raises(ValueError, match="--gguf-file"):
        ServerArgs(gguf_file="model.safetensors")
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(
        ["--model", "acme/tiny", "--revision", "v1", "--download-dir", "d", "--gguf-file", "f.gguf"]
    )
    assert (args.model_path, args.revision, args.download_dir, args.gguf_file) == ("acme/tiny", "v1", "d", "f.gguf")
    helps = {a.dest: a.help for a in parser._actions}
    assert all(helps[k] for k in ("revision", "download_dir", "gguf_file"))
