"""Re-record tests/data/serve_record.jsonl, a real `workbench serve --record` run that the simulator
replays (tests/fast/test_trace_workloads.py):

    .venv/bin/python tests/data/record_serve_trace.py

The HTTP server on the default model, recorded without token ids (as `serve --record` records by
default): three chat requests with one system prompt, sent 0.7 s apart (the second and third find
the system prompt in the radix cache), one short chat of its own, then the system prompt again.
Greedy, 6 to 8 tokens each. About 30 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "serve_record.jsonl")
SYSTEM = (
    "You are a support agent for a small bookshop. Answer in one short sentence, politely, and never "
    "invent prices or opening hours that you were not told. The shop opens at nine and closes at six."
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chat(port: int, question: str, system: bool = True, max_tokens: int = 8) -> str:
    messages = ([{"role": "system", "content": SYSTEM}] if system else []) + [{"role": "user", "content": question}]
    body = {"model": "default", "max_tokens": max_tokens, "temperature": 0, "messages": messages}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json.dumps(body).encode(),
        {"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["choices"][0]["message"]["content"]


def main() -> int:
    port = _free_port()
    if os.path.exists(OUT):
        os.remove(OUT)
    server = subprocess.Popen(
        [sys.executable, "-m", "workbench.cli", "serve", "--port", str(port), "--record", OUT, "--random-seed", "0"]
    )
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        with ThreadPoolExecutor(3) as pool:
            futures = []
            for q in ("Do you sell maps?", "Can I order a book?", "Are you open on Sunday?"):
                futures.append(pool.submit(_chat, port, q))
                time.sleep(0.7)
            print([f.result() for f in futures])
        print(_chat(port, "Name a fruit.", system=False, max_tokens=6))
        time.sleep(0.5)
        print(_chat(port, "When do you open?"))
    finally:
        server.send_signal(2)
        server.wait(60)
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
