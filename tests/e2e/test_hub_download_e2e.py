"""End-to-end part of tests/fast/test_hub_download.py: engines over a model downloaded from a local
Hub-compatible server (tests/fake_hub.py, HF_ENDPOINT at it, HF_HOME in tmp_path).

The downloaded model generates the same greedy tokens as the same files given as a directory, and
the Engine's child processes load the local snapshot (the Hub sees one model-info request);
`workbench generate --model ORG/NAME --revision --download-dir` does the same from the command line;
and a simulated engine (`--simulate h100 --model ORG/NAME`) fetches the config.json alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_hub import FakeHub, point_hf_at
from tiny_models import make_tiny_llama

from workbench import Engine

WORKBENCH = str(Path(sys.executable).with_name("workbench"))
GREEDY = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[5, 17, 42, 99, 100], [200, 3, 3, 3, 7, 8, 150, 11], [64] * 12]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("hub-e2e") / "tiny", tie_word_embeddings=False, seed=5)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with FakeHub() as server:
        point_hf_at(monkeypatch, server, tmp_path / "hf-home")
        yield server


def _outputs(model: str, **kw) -> tuple[list[list[int]], str]:
    with Engine(model_path=model, dtype="float32", show_progress=False, max_total_tokens=2048, **kw) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        return [o["output_ids"] for o in outs], engine.model_path


def test_downloaded_model_generates_what_the_directory_does(hub, tiny_dir):
    sha = hub.add_repo("acme/tiny-e2e", tiny_dir)
    from_dir, _ = _outputs(str(tiny_dir))
    from_hub, loaded = _outputs("acme/tiny-e2e", revision="main")
    assert from_hub == from_dir and all(len(o) == GREEDY["max_new_tokens"] for o in from_hub)
    assert loaded.endswith(f"models--acme--tiny-e2e/snapshots/{sha}")  # what the children were handed
    assert [r for r in hub.requests if r[1].startswith("/api/models/")][0][
        1
    ] == "/api/models/acme/tiny-e2e/revision/main"
    assert len(hub.gets("model.safetensors")) == 1  # the children did not download again


def test_cli_generate_downloads_with_revision_and_download_dir(hub, tiny_dir, tmp_path):
    hub.add_repo("acme/tiny-cli", tiny_dir)
    common = ["generate", "hello there", "--raw", "--max-new-tokens", "8", "--dtype", "float32", "--no-show-progress"]
    env = dict(os.environ)

    def run(*model_flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([WORKBENCH, *common, *model_flags], capture_output=True, text=True, timeout=300, env=env)

    from_dir = run("--model", str(tiny_dir))
    assert from_dir.returncode == 0, from_dir.stderr[-2000:]
    downloads = tmp_path / "downloads"
    from_hub = run("--model", "acme/tiny-cli", "--revision", "main", "--download-dir", str(downloads))
    assert from_hub.returncode == 0, from_hub.stderr[-2000:]
    assert from_hub.stdout == from_dir.stdout and from_hub.stdout.strip()
    assert (downloads / "models--acme--tiny-cli" / "refs" / "main").is_file()
    missing = run("--model", "acme/not-there")
    assert missing.returncode == 2 and "no model repository 'acme/not-there'" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_simulated_engine_over_a_hub_config_fetches_only_the_config(hub, tmp_path):
    root = tmp_path / "big-repo"
    root.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
    }
    (root / "config.json").write_text(json.dumps(config))
    (root / "model-00001-of-00030.safetensors").write_bytes(b"\0" * 4096)  # must never be asked for
    hub.add_repo("acme/Big-70B", root)
    with Engine(simulate="h100", model_path="acme/Big-70B", tp_size=4, show_progress=False, sim_speed=0) as engine:
        out = engine.generate(prompt="hello", sampling_params={"max_new_tokens": 4, "ignore_eos": True})
        assert len(out["output_ids"]) == 4
        assert "Big-70B" in engine.trace_label
    assert [r[1].rsplit("/", 1)[-1] for r in hub.gets()] == ["config.json"]
