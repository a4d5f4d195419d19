"""An Engine in a script: without the `if __name__ == "__main__":` guard it fails with one line that names
the guard (multiprocessing re-runs the script in each child), and with the guard it runs."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """from workbench import Engine
{indent}engine = Engine(dtype="float32", show_progress=False, max_total_tokens=1024)
{indent}print(repr(engine.generate("The capital of France is", {{"max_new_tokens": 3, "temperature": 0}})["text"]))
{indent}engine.shutdown()
"""


def _run(tmp_path, guarded: bool) -> subprocess.CompletedProcess:
    body = SCRIPT.format(indent="    " if guarded else "")
    if guarded:
        head, rest = body.split("\n", 1)
        body = head + '\nif __name__ == "__main__":\n' + rest
    path = tmp_path / ("guarded.py" if guarded else "unguarded.py")
    path.write_text(body)
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_a_script_without_the_main_guard_fails_with_one_line(tmp_path):
    proc = _run(tmp_path, guarded=False)
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and 'if __name__ == "__main__":' in lines[0] and "Traceback" not in proc.stderr, proc.stderr[
        -3000:
    ]


def test_the_same_script_with_the_guard_runs(tmp_path):
    proc = _run(tmp_path, guarded=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Paris" in proc.stdout
