"""Re-record tests/data/tui_trace.jsonl, the fixed trace behind the TUI snapshot and tmux tests.

    .venv/bin/python tests/data/record_tui_trace.py

A real engine on the default model: four shared-prefix chat requests (one
system prompt, different questions), then a long prompt that is prefilled in
chunks while two short chats decode next to it. Greedy, few tokens. The
snapshots must be updated after re-recording (`pytest --snapshot-update`).
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "tui_trace.jsonl")

QUESTIONS = ["What is a radix tree?", "Why is the sky blue?", "Name three prime numbers.", "What does a scheduler do?"]


def main() -> int:
    from workbench.core.engine import Engine
    from workbench.core.trace.recorder import Recorder

    from workbench.workloads import _LONG_TEXT, SHARED_SYSTEM, chat_text

    engine = Engine(show_progress=False, chunked_prefill_size=64, max_running_requests=8, random_seed=0)
    rec = Recorder(OUT, model=engine.served_model_name)
    handle = engine.subscribe_callback(rec, name="fixture")
    sp = {"max_new_tokens": 6, "temperature": 0.0}
    try:
        time.sleep(0.3)
        with ThreadPoolExecutor(8) as pool:
            futs = []
            for i, q in enumerate(QUESTIONS):
                text = chat_text(engine, [{"role": "system", "content": SHARED_SYSTEM}, {"role": "user", "content": q}])
                futs.append(pool.submit(engine.generate, prompt=text, sampling_params=sp, rid=f"sp-{i + 1}"))
                time.sleep(0.05)
            for f in futs:
                f.result()
            long_text = chat_text(
                engine, [{"role": "user", "content": _LONG_TEXT * 3 + "\nIn short: what is this about?"}]
            )
            futs = [pool.submit(engine.generate, prompt=long_text, sampling_params=sp, rid="long-1")]
            time.sleep(0.02)
            for i, q in enumerate(["What is 12 times 12?", "Suggest a name for a cat."]):
                futs.append(
                    pool.submit(
                        engine.generate,
                        prompt=chat_text(engine, [{"role": "user", "content": q}]),
                        sampling_params={"max_new_tokens": 12, "temperature": 0.0},
                        rid=f"chat-{i + 1}",
                    )
                )
            for f in futs:
                f.result()
        time.sleep(0.5)
    finally:
        handle.close()
        rec.close()
        engine.shutdown()
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes, {rec.events_written} events)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
