"""End-to-end part of tests/fast/test_plugins.py (what starts processes, engines or servers, or loads the
reference model).

The plugin host, as a third party meets it: a real (tiny) installed distribution.

The `plugin_dir` fixture (tests/conftest.py) copies the modules in tests/data/plugins plus
their `*.dist-info` (METADATA + entry_points.txt in group `workbench.plugins`) into a temporary
directory and puts that directory on sys.path, which is all `importlib.metadata` needs to find it. The plugin adds a
TUI panel, a Jupyter view and a workload; two more entry points are broken (one
raises inside `register`, one names a module that does not exist).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.plugins import load_plugins


def test_builtin_views_register_without_importing_plotly():
    code = (
        "import sys; from workbench.plugins import load_plugins; r = load_plugins(); "
        "print(sorted(r.views)); print('plotly' in sys.modules, 'ipywidgets' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    views, loaded = out.stdout.strip().splitlines()
    assert "'gantt'" in views and "'latency'" in views
    assert loaded == "False False"


def test_workbench_plugins_cli_lists_them(plugin_dir):
    exe = Path(sys.executable).with_name("workbench")
    env = dict(os.environ, PYTHONPATH=f"{plugin_dir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    helptext = subprocess.run([str(exe), "--help"], capture_output=True, text=True, env=env, timeout=60)
    if "plugins" not in helptext.stdout + helptext.stderr:
        pytest.skip("the workbench CLI has no `plugins` command yet")
    out = subprocess.run([str(exe), "plugins"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for needle in ("reqcount", "wb-reqcount", "countdown", "broken", "boom", "ghost", "builtin", "gantt"):
        assert needle in text, f"{needle!r} missing from `workbench plugins`:\n{text}"


def test_the_scheduler_runs_a_plugin_policy(plugin_dir, monkeypatch, tmp_path):
    """A real engine started with the plugin's policy: its scheduler process calls it (the log it
    writes), and the requests are answered."""
    from workbench import Engine

    log = tmp_path / "policy.log"
    monkeypatch.setenv("WB_POLICY_LOG", str(log))
    load_plugins(reload=True)
    prompts = [[1, 504, 3003] * k for k in (6, 1, 3)]
    with Engine(
        schedule_policy="shortest-first", dtype="float32", max_total_tokens=2048, show_progress=False
    ) as engine:
        outs = engine.generate(
            input_ids=prompts, sampling_params={"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
        )
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [2, 2, 2]
    orders = [line.split() for line in log.read_text().splitlines()]
    assert orders and all(o == sorted(o, key=int) for o in orders), orders
