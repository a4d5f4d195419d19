"""End-to-end part of tests/fast/test_detokenizer.py (what starts processes, engines or servers, or loads the
reference model).

Detokenizer: incremental decoding with the real SmolLM2 tokenizer, and the real process over ipc."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from workbench.core.ipc import PortArgs
from workbench.core.managers.detokenizer_manager import run_detokenizer_process

# ---- the manager, in process and as a real process --------------------------------


@pytest.fixture
def port_args():
    pa = PortArgs.create()
    yield pa
    pa.cleanup()


_ORPHAN_SCRIPT = textwrap.dedent("""
    import multiprocessing as mp, sys, tempfile, time
    from workbench.core.ipc import PortArgs
    from workbench.core.managers.detokenizer_manager import run_detokenizer_process
    if __name__ == "__main__":
        tempfile.tempdir = sys.argv[2]  # the ipc dir lands in pytest's tmp dir: no leak when killed
        pa = PortArgs.create()
        reader, writer = mp.get_context("spawn").Pipe(duplex=False)
        p = mp.get_context("spawn").Process(target=run_detokenizer_process,
                                            args=(sys.argv[1], pa, writer))
        p.start()
        assert reader.poll(120) and reader.recv()["status"] == "ready"
        print(p.pid, flush=True)
        time.sleep(600)
""")


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie has exited


def test_detokenizer_exits_when_parent_dies(tokenizer_dir, tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_SCRIPT, tokenizer_dir, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    child_pid = None
    try:
        child_pid = int(parent.stdout.readline())
        assert not _gone(child_pid)
        parent.send_signal(signal.SIGKILL)  # no chance to clean up its children
        parent.wait(30)
        deadline = time.monotonic() + 30
        while not _gone(child_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(child_pid), "detokenizer survived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        if child_pid is not None and not _gone(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def test_bad_model_dir_reports_error_and_exits(tmp_path, port_args):
    reader, writer = mp.get_context("spawn").Pipe(duplex=False)
    proc = mp.get_context("spawn").Process(
        target=run_detokenizer_process, args=(str(tmp_path), port_args, writer)
    )  # no tokenizer files
    proc.start()
    try:
        assert reader.poll(120)
        msg = reader.recv()
        assert msg["status"] == "error" and msg["role"] == "detokenizer" and msg["error"]
        proc.join(60)
        assert proc.exitcode == 1
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def test_module_import_stays_light():
    code = (
        "import sys, workbench.core.managers.detokenizer_manager; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_detokenizer_process_stays_free_of_torch(tokenizer_dir):
    code = (
        "import sys; from workbench.core.managers.incremental_detokenize import load_decode_tokenizer; "
        f"load_decode_tokenizer({tokenizer_dir!r}); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
