"""The plugin host, as a third party meets it: a real (tiny) installed distribution.

The test writes a package plus its `*.dist-info` (METADATA + entry_points.txt in
group `workbench.plugins`) into a temporary directory and puts that directory on
sys.path, which is all `importlib.metadata` needs to find it. The plugin adds a
TUI panel, a Jupyter view and a workload; two more entry points are broken (one
raises inside `register`, one names a module that does not exist).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from workbench.plugins import GROUP, load_plugins

PLUGIN_SRC = '''
"""A third-party workbench plugin: one panel, one view, one workload."""


def make_panel(**kw):
    from textual.widgets import Static

    class RequestCountPanel(Static):
        last_text = ""

        def update_view(self, model):
            self.last_text = f"{len(model.state.requests)} requests seen"
            self.update(self.last_text)
    return RequestCountPanel("waiting for events", **kw)


def make_view(source=None, **kw):
    import ipywidgets as W
    from workbench.widgets import TraceFeed

    class RequestCountView(W.HTML):
        def update(self, state, t0=None):
            self.value = f"<b>{len(state.requests)}</b> requests seen"
    view = RequestCountView()
    if source is not None:
        TraceFeed.of(source).attach(view)
    return view


class Countdown:
    def __init__(self, n=3):
        self.n = n

    def requests(self):
        return [f"count down from {i}" for i in range(self.n, 0, -1)]


class ShortestFirst:
    """Admit the shortest prompt first; log each ordering to $WB_POLICY_LOG (proof the scheduler ran it)."""

    def __init__(self, tree_cache, rng_seed=0):
        self.tree_cache = tree_cache

    def calc_priority(self, waiting_queue):
        waiting_queue.sort(key=lambda r: len(r.origin_input_ids))
        import os
        path = os.environ.get("WB_POLICY_LOG")
        if path and waiting_queue:
            with open(path, "a") as f:
                f.write(" ".join(str(len(r.origin_input_ids)) for r in waiting_queue) + "\\n")


def register(registry):
    registry.add_policy("shortest-first", ShortestFirst, help="shortest prompt first")
    registry.add_panel("reqcount", "Request count", make_panel, help="how many requests the trace saw")
    registry.add_view("reqcount", "Request count", make_view, help="how many requests the trace saw")
    registry.add_workload("countdown", Countdown, help="three numbered prompts")
'''

BROKEN_SRC = """
def register(registry):
    registry.add_view("half-done", "never finished", lambda source=None: None)
    raise RuntimeError("boom: this plugin is broken")
"""


def _dist(root: Path, name: str, entry_points: str) -> None:
    info = root / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n{entry_points}\n")


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    (tmp_path / "wb_reqcount.py").write_text(textwrap.dedent(PLUGIN_SRC))
    (tmp_path / "wb_broken.py").write_text(textwrap.dedent(BROKEN_SRC))
    _dist(tmp_path, "wb-reqcount", "reqcount = wb_reqcount:register")
    _dist(tmp_path, "wb-broken", "broken = wb_broken:register\nghost = wb_no_such_module:register")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    monkeypatch.undo()
    for mod in ("wb_reqcount", "wb_broken"):
        sys.modules.pop(mod, None)
    load_plugins(reload=True)  # leave the process-wide registry as it was


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
