"""Security properties of a real server (real engine, real sockets).

- `--api-key` is enforced on every route the app has (enumerated from the app itself,
  docs included) except the health checks, and on unknown paths too;
- the HTTP server and the trace publisher listen on loopback only, and nothing the
  engine starts listens anywhere else;
- no pickle is ever read from a socket: a pickle that would create a marker file when
  loaded is sent to the trace publisher, to the HTTP server (as a body and as raw
  bytes) and to every ipc:// socket of the engine, and the marker never appears
  (while the same bytes do create it when unpickled, so the check can fail);
- the ipc:// directory is private (0700, owned by us) and removed on shutdown.

The end-to-end tests of this module are in tests/e2e/test_security_e2e.py.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_no_code_path_unpickles_network_data():
    """Source guard: the serving code never calls the pickle readers (msgspec only on the wire)."""
    banned = re.compile(r"\b(pickle\.loads?|recv_pyobj|recv_serialized|cPickle|dill\.loads?)\b")
    hits = []
    for top in ("core", "workbench", "tui", "widgets"):
        for f in (REPO / top).rglob("*.py"):
            for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
                code = line.split("#", 1)[0]
                if banned.search(code) and '"""' not in code:
                    hits.append(f"{f.relative_to(REPO)}:{i}: {line.strip()}")
    assert not hits, hits
