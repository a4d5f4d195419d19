"""Run `workbench serve` as a child process and wait for it: for tests, notebooks and benchmarks.

    with ServerProcess(["--max-total-tokens", "4096"]) as srv:
        OpenAI(base_url=srv.base_url + "/v1", api_key="-")...

The child runs in its own session so a terminal's Ctrl-C does not reach it;
`stop()` sends SIGTERM (the graceful path) and falls back to SIGKILL of the
whole group after a timeout, so no process outlives it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """A `python -m workbench.core.entrypoints.http_server` child on a free loopback port."""

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        env: dict | None = None,
        start_timeout_s: float = 300.0,
        wait: bool = True,
    ):
        self.host = host
        self.port = port or free_port(host)
        self.base_url = f"http://{host}:{self.port}"
        self.log_path = tempfile.NamedTemporaryFile(prefix="workbench-serve-", suffix=".log", delete=False).name
        self._log = open(self.log_path, "wb")
        cmd = [
            sys.executable,
            "-m",
            "workbench.core.entrypoints.http_server",
            "--host",
            host,
            "--port",
            str(self.port),
            "--no-show-progress",
            *args,
        ]
        child_env = dict(os.environ, **(env or {}))
        child_env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=child_env, start_new_session=True
        )
        self.health_statuses: list[int] = []
        if wait:
            self.wait_healthy(start_timeout_s)

    def log(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        """Poll GET /health until 200; raise with the server's log if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} during start-up:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    self.health_statuses.append(r.status)
                    if r.status == 200:
                        return
            except urllib.error.HTTPError as e:
                self.health_statuses.append(e.code)
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.25)
        self.kill()
        raise RuntimeError(f"the server did not become healthy in {timeout_s:.0f} s:\n{self.log()}")

    def descendants(self) -> list[int]:
        """pids of the server's child processes (for orphan checks)."""
        try:
            import psutil

            return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        except Exception:  # noqa: BLE001 - psutil missing or the process is gone
            return []

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, wait, then SIGKILL the group if it hangs. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(10)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
