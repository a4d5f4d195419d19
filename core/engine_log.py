"""The engine's log file: where its processes' log records (and, under the TUI, all their output) go.

Every Engine has one (`Engine.log_path`), so a slow or failed start can always say where to look:
`$WORKBENCH_CACHE_DIR/logs/engine-<time>-<pid>.log` (~/.cache/workbench; `$WORKBENCH_LOG_DIR`
instead of that folder where set) unless the caller names
one (the TUI names the file its children's stdout and stderr already go to). The newest
KEEP_LOGS files are kept.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

#: The key under which PortArgs.extra carries the log path to the children.
LOG_PATH_KEY = "log_path"
KEEP_LOGS = 20
_FORMAT = "%(asctime)s [%(processName)s %(process)d] %(levelname)s %(name)s: %(message)s"


def default_log_dir() -> str:
    """`$WORKBENCH_LOG_DIR`, else `$WORKBENCH_CACHE_DIR/logs` (default ~/.cache/workbench/logs)."""
    if os.environ.get("WORKBENCH_LOG_DIR"):
        return os.path.expanduser(os.environ["WORKBENCH_LOG_DIR"])
    base = os.environ.get("WORKBENCH_CACHE_DIR") or "~/.cache/workbench"
    return os.path.join(os.path.expanduser(base), "logs")


def new_log_path(prefix: str = "engine") -> str:
    """A fresh log file's path in default_log_dir() (the folder is made; old logs beyond KEEP_LOGS go)."""
    folder = default_log_dir()
    os.makedirs(folder, exist_ok=True)
    _prune(folder, prefix)
    return os.path.join(folder, f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log")


def _prune(folder: str, prefix: str) -> None:
    with contextlib.suppress(OSError):
        logs = sorted(
            (os.path.join(folder, n) for n in os.listdir(folder) if n.startswith(prefix + "-") and n.endswith(".log")),
            key=os.path.getmtime,
        )
        for old in logs[: max(0, len(logs) - KEEP_LOGS + 1)]:
            with contextlib.suppress(OSError):
                os.unlink(old)


class _LogFile(logging.FileHandler):
    """A FileHandler that keeps the console as it was: where no other handler would take a record,
    Python's last-resort handler prints warnings to stderr, and having a handler at all stops that,
    so this one hands such records on to it too (a scheduler's warning still reaches `serve`'s console)."""

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        last = logging.lastResort
        if last is not None and record.levelno >= last.level and not logging.getLogger().handlers:
            last.handle(record)


def _stderr_is(path: str) -> bool:
    """Whether fd 2 already writes to `path` (the TUI redirects its children's output there)."""
    try:
        a, b = os.fstat(2), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def attach_log_file(
    path: str | None, level: int = logging.INFO, *, own_process: bool = False
) -> logging.Handler | None:
    """Copy this process's `workbench` log records at `level` and above into `path` (appending).

    `own_process`: a child the engine started, whose logger levels are ours to lower so that
    `level` records are made at all (the console's handlers keep their threshold); in the
    caller's process (a script, a notebook, a test run) its logging is left as it is.
    Skipped where stderr already goes to that file (every record reaching the console is in it
    then) and where the file cannot be opened (the log is a help, never a reason to fail).
    Returns the handler added (for `detach_log_file`), or None."""
    if not path or _stderr_is(path):
        return None
    root = logging.getLogger("workbench")
    if any(isinstance(h, logging.FileHandler) and h.baseFilename == os.path.abspath(path) for h in root.handlers):
        return None
    try:
        handler = _LogFile(path, encoding="utf-8")
    except OSError:
        return None
    handler.setLevel(level)
    handler.setFormatter(logging.Formatter(_FORMAT))
    root.addHandler(handler)
    if own_process and root.getEffectiveLevel() > level:
        # the records must reach the file; the console's handlers keep their own threshold
        root.setLevel(level)
        for h in logging.getLogger().handlers:
            if h.level == logging.NOTSET:
                h.setLevel(logging.getLogger().getEffectiveLevel())
    return handler


def detach_log_file(handler: logging.Handler | None) -> None:
    """Undo attach_log_file (an Engine that shuts down in a process that goes on)."""
    if handler is not None:
        logging.getLogger("workbench").removeHandler(handler)
        handler.close()


def append_line(path: str | None, line: str) -> None:
    """One line straight into the log (the engine's phases), never raising."""
    if not path or not line:
        return
    with contextlib.suppress(OSError), open(path, "a", encoding="utf-8") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} [engine {os.getpid()}] {line}\n")
