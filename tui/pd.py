"""`workbench tui --disaggregation [xPyD]`: a 1P1D pair on this machine as a one-command demo.

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

Simulated (`--simulate h100 --model llama-3.1-70b --tp-size 8`): both Engines are simulated ones, the
KV handover timed by the link model (core/simulation/pd_live.py), SIMULATED in every view's badge.
Each keeps its own simulated clock, paced to the wall clock at the same --sim-speed and back on the
line `speed x monotonic time` whenever it idles; the pair lines the clocks up when it is made
(`align_clocks`), so the merged trace compares them as they are.
A simulated deployment may also be xPyD (`--disaggregation 2P4D`): requests go round robin to the
prefill servers (dp0..dp{x-1}) and, independently, to the decode servers (dp{x}..); real engines are
1P1D on this machine (several real servers: run them and `--attach` them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
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
    """Prefill Engines and decode Engines behind a router of a few lines (module docstring): one of
    each (1P1D), or lists of them with their bootstrap ports (xPyD, round robin on each side)."""

    def __init__(self, prefill: Any, decode: Any, bootstrap_port: Any, bootstrap_host: str = "127.0.0.1"):
        self.prefills = list(prefill) if isinstance(prefill, (list, tuple)) else [prefill]
        self.decodes = list(decode) if isinstance(decode, (list, tuple)) else [decode]
        self.ports = list(bootstrap_port) if isinstance(bootstrap_port, (list, tuple)) else [bootstrap_port]
        if len(self.ports) != len(self.prefills) or not self.decodes:
            raise ValueError("a PD pair needs a bootstrap port per prefill server and at least one decode server")
        self.prefill, self.decode, self.bootstrap_port = self.prefills[0], self.decodes[0], self.ports[0]
        self.bootstrap_host = bootstrap_host
        self._next = itertools.count()
        clocks = [getattr(e, "clock", None) for e in (*self.prefills, *self.decodes)]
        if all(getattr(c, "simulated", False) for c in clocks):
            # Simulated servers keep a clock each: lined up now, they go on at the same speed (module docstring)
            from workbench.core.simulation.pd_live import align_clocks

            align_clocks(clocks, self.decode.server_args.sim_speed)
            self.clock = self.decode.clock  # the views' "now": simulated time
        else:
            self.clock = None  # the host's clock

    @property
    def shape(self) -> str:
        return f"{len(self.prefills)}P{len(self.decodes)}D"

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
        p, d = len(self.prefills), len(self.decodes)
        if p == d == 1:
            where = f"prefill dp0 + decode dp1, bootstrap :{self.bootstrap_port}"
        else:
            where = f"prefill dp0-dp{p - 1} + decode dp{p}-dp{p + d - 1}"
        return f"{self.shape} {self.decode.trace_label} · {where}"

    def apply_chat_template(self, messages):
        return self.decode.apply_chat_template(messages)

    # ---- routing ----------------------------------------------------------------------------
    def _route(self) -> tuple[Any, Any, dict]:
        """The next request's prefill and decode server (round robin, each side on its own) and what
        SGLang's router adds to it: the prefill's bootstrap address and a fresh room."""
        i = next(self._next)
        p = i % len(self.prefills)
        pd = dict(
            bootstrap_host=self.bootstrap_host, bootstrap_port=self.ports[p], bootstrap_room=random.getrandbits(63)
        )
        return self.prefills[p], self.decodes[i % len(self.decodes)], pd

    async def async_generate(self, rid: str | None = None, **kw) -> Any:
        """Send the request to a prefill and a decode server; the decode server's answer is the client's."""
        prefill, decode, pd = self._route()
        pre = asyncio.ensure_future(prefill.async_generate(rid=prefill_rid(rid) if rid else None, **kw, **pd))
        try:
            return await decode.async_generate(rid=rid, **kw, **pd)
        finally:
            with contextlib.suppress(Exception):  # its failure reaches the client through the decode side
                await pre

    def generate(self, prompt=None, sampling_params=None, rid: str | None = None, stream: bool = False, **kw):
        """Blocking (or streaming) generation through the pair (the TUI's chat)."""
        prefill_engine, decode, pd = self._route()

        def prefill() -> None:
            with contextlib.suppress(Exception):
                prefill_engine.generate(
                    prompt=prompt, sampling_params=sampling_params, rid=prefill_rid(rid) if rid else None, **kw, **pd
                )

        threading.Thread(target=prefill, name="pd-prefill", daemon=True).start()
        return decode.generate(prompt=prompt, sampling_params=sampling_params, rid=rid, stream=stream, **kw, **pd)

    def abort_request(self, rid: str) -> None:
        for engine in self.decodes:  # whichever holds it (the others know no such rid)
            with contextlib.suppress(Exception):
                engine.abort_request(rid)
        for engine in self.prefills:
            with contextlib.suppress(Exception):
                engine.abort_request(prefill_rid(rid))

    def step_gate(self, action: str, steps: int = 1) -> dict:
        """Pause, resume or step every scheduler (the last decode server's answer is returned)."""
        for engine in self.prefills + self.decodes[:-1]:
            engine.step_gate(action, steps)
        return self.decodes[-1].step_gate(action, steps)

    def subscribe(self, with_snapshot: bool = True, name: str = "") -> PDSubscription:
        subs = [
            e.subscribe(with_snapshot=with_snapshot, name=f"{name}-prefill{i}") for i, e in enumerate(self.prefills)
        ]
        subs += [e.subscribe(with_snapshot=with_snapshot, name=f"{name}-decode{i}") for i, e in enumerate(self.decodes)]
        return PDSubscription(subs)

    def shutdown(self) -> None:
        for engine in (*self.decodes, *self.prefills):
            with contextlib.suppress(Exception):
                engine.shutdown()


class PDController(EngineController):
    """A live PD deployment made here: 1P1D, or xPyD of simulated engines (`shape`, e.g. (2, 4));
    `server_args` for every server, the roles set per server. Everything else (workloads, scenarios,
    chat, pause and step on all of them) is EngineController's."""

    def __init__(self, *args, shape: tuple[int, int] = (1, 1), **kw):
        super().__init__(*args, **kw)
        self.shape = shape

    def start(self, progress: Progress) -> None:
        if self.engine is None:
            from workbench.core.args import ServerArgs
            from workbench.core.engine import Engine
            from workbench.core.entrypoints.server_process import free_port
            from workbench.tui.controller import _ensure_resource_tracker

            sa = self._server_args
            if isinstance(sa, dict) or sa is None:
                sa = ServerArgs(**(sa or {}))
            n_prefill, n_decode = self.shape
            if (n_prefill, n_decode) != (1, 1) and not sa.simulate:
                raise ValueError(
                    f"--disaggregation {n_prefill}P{n_decode}D starts that many servers: simulated ones only (add "
                    "--simulate h100 --model llama-3.1-70b --tp-size 8, say); real engines make a 1P1D pair here, "
                    "and a larger real deployment is watched with --attach PREFILL_ADDR... DECODE_ADDR..."
                )
            # one trace address cannot serve two buses: each server keeps its trace in this process
            sa = dataclasses.replace(sa, trace_publish=None)
            ports = [free_port() for _ in range(n_prefill)]
            roles = [("prefill", {"disaggregation_bootstrap_port": p}) for p in ports]
            roles += [("decode", {})] * n_decode
            shape = f"{n_prefill}P{n_decode}D"
            _ensure_resource_tracker()
            engines = []
            try:
                for k, (mode, extra) in enumerate(roles):
                    which = f" {k + 1} of {len(roles)}" if len(roles) > 2 else ""
                    progress(
                        f"starting the {mode} server{which} of the {shape} pair: model {sa.model_path or 'default'}"
                    )
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
            self.engine = PDPair(engines[:n_prefill], engines[n_prefill:], ports)
        super().start(progress)
