"""`workbench tui --disaggregation`: a 1P1D pair on this machine as a one-command demo.

Two Engines in this process, a prefill server (`disaggregation_mode="prefill"`, a free bootstrap port)
and a decode server, each with its own trace bus. `PDPair` stands in front of them as SGLang's PD
router does: each request goes to both with the same bootstrap_host / bootstrap_port / a random
bootstrap_room, and the client reads the decode server's answer. It looks enough like an `Engine`
(async_generate, generate, abort_request, step_gate, subscribe, tokenizer) that the TUI's
EngineController, its workloads and its scenarios drive it unchanged.

Why not the real sglang_router: it routes HTTP between servers in processes of their own, while
this demo keeps both Engines in the TUI's process with no HTTP server (a second launch, ports and
a Rust binary to find for a demo); tests/e2e/test_pd_router.py runs the pair behind the real one,
and `workbench tui --attach P D` watches such a deployment. The prefill side's request is named
after the decode side's (`<rid>.p`), so both are easy to tell apart in Queues; a real router leaves
the rids to each server and the views join the two by room either way.

Both traces are merged as two data-parallel replicas (prefill = dp0, decode = dp1), as `--attach`
with two addresses does; both servers stamp this host's monotonic clock, so times compare as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import threading
from typing import Any

from workbench.core.trace import events as ev
from workbench.core.trace.events import Event
from workbench.tui.controller import ControlUnavailable, EngineController, Progress, as_worker

PREFILL, DECODE = 0, 1  # worker index = data-parallel rank in the merged trace


def prefill_rid(rid: str) -> str:
    """The prefill side's rid for the decode side's (client's) `rid`."""
    return f"{rid}.p"


class PDSubscription:
    """The two servers' trace subscriptions as one: each event renamed to its worker (scheduler.dp0
    is the prefill server, scheduler.dp1 the decode server), merged in time order."""

    def __init__(self, subs: list):
        self._subs = subs

    def drain(self, max_items: int | None = None) -> list[Event]:
        out: list[Event] = []
        for i, sub in enumerate(self._subs):
            for e in sub.drain(max_items):
                if isinstance(e, (ev.TraceCounters, ev.TraceReset)):
                    continue  # per server; the views count from the events themselves
                out.append(as_worker(e, i, 0))
        out.sort(key=lambda e: e.ts)
        return out

    def close(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                sub.close()


class PDPair:
    """A prefill Engine and a decode Engine behind a router of a few lines (module docstring)."""

    def __init__(self, prefill: Any, decode: Any, bootstrap_port: int, bootstrap_host: str = "127.0.0.1"):
        self.prefill, self.decode = prefill, decode
        self.bootstrap_host, self.bootstrap_port = bootstrap_host, bootstrap_port
        self.clock = None  # the host's clock (a simulated pair is `workbench sim`'s business)

    # ---- what the workloads and the controller read --------------------------------------
    @property
    def tokenizer(self):
        return self.decode.tokenizer

    @property
    def server_args(self):
        return self.decode.server_args

    @property
    def served_model_name(self) -> str:
        return self.decode.served_model_name

    @property
    def trace_label(self) -> str:
        return f"1P1D {self.decode.trace_label} · prefill dp0 + decode dp1, bootstrap :{self.bootstrap_port}"

    def apply_chat_template(self, messages):
        return self.decode.apply_chat_template(messages)

    # ---- routing ----------------------------------------------------------------------------
    def _bootstrap(self) -> dict:
        """What SGLang's router adds to each request: the prefill's bootstrap address and a fresh room."""
        return dict(
            bootstrap_host=self.bootstrap_host,
            bootstrap_port=self.bootstrap_port,
            bootstrap_room=random.getrandbits(63),
        )

    async def async_generate(self, rid: str | None = None, **kw) -> Any:
        """Send the request to both servers; the decode server's answer is the client's."""
        pd = self._bootstrap()
        pre = asyncio.ensure_future(self.prefill.async_generate(rid=prefill_rid(rid) if rid else None, **kw, **pd))
        try:
            return await self.decode.async_generate(rid=rid, **kw, **pd)
        finally:
            with contextlib.suppress(Exception):  # its failure reaches the client through the decode side
                await pre

    def generate(self, prompt=None, sampling_params=None, rid: str | None = None, stream: bool = False, **kw):
        """Blocking (or streaming) generation through the pair (the TUI's chat)."""
        pd = self._bootstrap()

        def prefill() -> None:
            with contextlib.suppress(Exception):
                self.prefill.generate(
                    prompt=prompt, sampling_params=sampling_params, rid=prefill_rid(rid) if rid else None, **kw, **pd
                )

        threading.Thread(target=prefill, name="pd-prefill", daemon=True).start()
        return self.decode.generate(prompt=prompt, sampling_params=sampling_params, rid=rid, stream=stream, **kw, **pd)

    def abort_request(self, rid: str) -> None:
        self.decode.abort_request(rid)
        with contextlib.suppress(Exception):
            self.prefill.abort_request(prefill_rid(rid))

    def step_gate(self, action: str, steps: int = 1) -> dict:
        """Pause, resume or step both schedulers (the decode server's answer is returned)."""
        self.prefill.step_gate(action, steps)
        return self.decode.step_gate(action, steps)

    def subscribe(self, with_snapshot: bool = True, name: str = "") -> PDSubscription:
        return PDSubscription(
            [
                self.prefill.subscribe(with_snapshot=with_snapshot, name=f"{name}-prefill"),
                self.decode.subscribe(with_snapshot=with_snapshot, name=f"{name}-decode"),
            ]
        )

    def shutdown(self) -> None:
        for engine in (self.decode, self.prefill):
            with contextlib.suppress(Exception):
                engine.shutdown()


class PDController(EngineController):
    """A live 1P1D pair made here (`server_args` for both, the roles set per server); everything else
    (workloads, scenarios, chat, pause and step on both) is EngineController's."""

    def start(self, progress: Progress) -> None:
        if self.engine is None:
            from workbench.core.args import ServerArgs
            from workbench.core.engine import Engine
            from workbench.core.entrypoints.server_process import free_port
            from workbench.tui.controller import _ensure_resource_tracker

            sa = self._server_args
            if isinstance(sa, dict) or sa is None:
                sa = ServerArgs(**(sa or {}))
            # one trace address cannot serve two buses: each server keeps its trace in this process
            sa = dataclasses.replace(sa, trace_publish=None)
            port = free_port()
            _ensure_resource_tracker()
            engines = []
            try:
                for mode, extra in (("prefill", {"disaggregation_bootstrap_port": port}), ("decode", {})):
                    progress(f"starting the {mode} server of the 1P1D pair: model {sa.model_path or 'default'}")
                    role_sa = dataclasses.replace(sa, disaggregation_mode=mode, **extra)
                    engines.append(
                        Engine(server_args=role_sa, on_progress=progress, on_phase=progress, log_path=self.log_path)
                    )
                    with self._lock:
                        if self._closed:
                            raise ControlUnavailable("closed during start-up")
            except BaseException:
                for e in engines:
                    with contextlib.suppress(Exception):
                        e.shutdown()
                raise
            self.engine = PDPair(engines[0], engines[1], port)
        super().start(progress)
