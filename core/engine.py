"""Engine: the serving core as a Python object.

`Engine(...)` launches the Scheduler and Detokenizer processes (spawn), starts the
trace bus, and runs the TokenizerManager on a private asyncio loop in a daemon
thread, so `generate` works from plain scripts, from Jupyter (which already runs
a loop) and from the HTTP server (which runs on `engine.loop` itself).
See docs/engine_api.md for the contract.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from multiprocessing.connection import wait as mp_wait
from typing import Any

import msgspec
from workbench.core.args import ServerArgs
from workbench.core.deployment import resolve_deployment
from workbench.core.distributed.launch import (
    MAIN_GUARD_EXIT,
    MainGuardError,
    spawn_scheduler_ranks,
    tp_ranks_on_node,
    validate_tp_for_model,
    wait_ranks_ready,
    with_dist_init_addr,
)
from workbench.core.engine_log import LOG_PATH_KEY, append_line, attach_log_file, detach_log_file, new_log_path
from workbench.core.ipc import PortArgs
from workbench.core.managers.scheduler_contract import Deployment
from workbench.core.managers.tokenizer_manager import EngineDeadError, GenerateReqInput, TokenizerManager
from workbench.core.model_executor.cpu_threads import omp_wait_env
from workbench.core.model_loader import load_tokenizer, prepare_model
from workbench.core.sampling.sampling_params import SamplingParams, sampling_params_from_dict
from workbench.core.trace import clock as trace_clock
from workbench.core.trace import events as ev
from workbench.core.trace.bus import TraceBus
from workbench.core.trace.startup import PHASE_LABELS, StartupProgress
from workbench.core.trace.tracer import Tracer

logger = logging.getLogger(__name__)

__all__ = ["Engine", "EngineDeadError"]

START_TIMEOUT_S = 600


def _exit_if_starting_child() -> None:
    """In a child that multiprocessing is still starting, an Engine() call means the user's script
    is being re-run without a `__main__` guard: leave quietly with a code the parent recognises."""
    if getattr(mp.current_process(), "_inheriting", False):
        os._exit(MAIN_GUARD_EXIT)


class Engine:
    """The serving engine: processes, trace bus and TokenizerManager. Use as a context manager.

    `deployment` (scheduler_contract.Deployment) says how the scheduler processes are made and how
    the engine describes itself; None: the one the arguments ask for (core/deployment.py).

    Start-up goes through phases (trace/startup.py: model, processes, weights, kernels, warmup,
    ready), each reported by the process doing it: `on_phase` receives them as `engine.phase`
    events (`self.startup` folds them); without it they are printed like `on_progress` lines.
    `log_path`: the engine's log file (default: a new one under ~/.cache/workbench/logs;
    core/engine_log.py); its processes' log records go there."""

    def __init__(
        self,
        model_path: str | None = None,
        *,
        server_args: ServerArgs | None = None,
        on_progress: Callable[[str], None] | None = None,
        deployment: Deployment | None = None,
        on_phase: Callable[[ev.EnginePhase], None] | None = None,
        log_path: str | None = None,
        **kwargs,
    ):
        _exit_if_starting_child()
        if server_args is None:
            server_args = ServerArgs(model_path=model_path, **kwargs)
        elif model_path is not None or kwargs:
            server_args = dataclasses.replace(server_args, model_path=model_path or server_args.model_path, **kwargs)
        if deployment is None:
            server_args, deployment = resolve_deployment(server_args)
        self.deployment = deployment
        self.server_args = server_args
        self._progress = on_progress or (_print_progress if server_args.show_progress else (lambda msg: None))
        self._on_progress = on_progress  # a caller's own progress view (else downloads draw a terminal bar)
        self._on_phase = on_phase
        self.startup = StartupProgress()
        self._shutdown = False
        self.is_healthy = False
        self.procs: dict[str, mp.Process] = {}
        self.t_start = time.monotonic()
        self.port_args = PortArgs.create()
        self.log_path = log_path or new_log_path("engine")
        self.port_args.extra[LOG_PATH_KEY] = self.log_path
        self._log_handler = attach_log_file(self.log_path)
        if on_phase is None:
            self._progress(f"engine log: {self.log_path}")
        try:
            self._launch()
        except MainGuardError as exc:
            self._phase("failed", str(exc))
            self.shutdown()
            raise SystemExit(f"workbench: {exc}") from None  # one line, not a child's traceback
        except BaseException as exc:
            self._phase("failed", f"{type(exc).__name__}: {exc}")
            append_line(self.log_path, getattr(exc, "child_traceback", "") or "")
            self.shutdown()
            raise
        atexit.register(self.shutdown)

    # ==== start-up ====================================================================
    def _launch(self) -> None:
        sa = self.server_args
        if sa.node_rank > 0:
            raise ValueError(
                f"node {sa.node_rank} of a multi-node launch runs only scheduler ranks, no Engine: "
                "start it with `workbench serve --nnodes N --node-rank K --dist-init-addr HOST:PORT` "
                "(or workbench.core.distributed.launch.run_worker_node); the Engine runs on node 0"
            )
        self._phase("model", str(sa.model_path or "the default model"))
        if not self.deployment.loads_weights:  # the default model's tokenizer stands in, the scheduler gets the name
            self.prepared = prepare_model(None, progress=sa.show_progress)
            self.model_path = str(sa.model_path)
            child_args = sa
        else:
            # A Hub id is downloaded here, once; the children get the local directory.
            self.prepared = prepare_model(
                sa.model_path,
                progress=sa.show_progress,
                revision=sa.revision,
                download_dir=sa.download_dir,
                gguf_file=sa.gguf_file,
                on_progress=self._on_progress,
            )
            self.model_path = str(self.prepared.gguf_path or self.prepared.model_dir)
            if sa.tp_size > 1:  # reading the config imports transformers: keep it off the TP-1 warm start
                validate_tp_for_model(self.prepared.config, sa.tp_size)  # before any process starts
            # Children load the converted directory, never the GGUF again.
            child_args = with_dist_init_addr(dataclasses.replace(sa, model_path=str(self.prepared.model_dir)))
        # STANDALONE: the draft model is prepared here too (GGUF, hub); without weights it is a name too
        if sa.speculative_draft_model_path and self.deployment.loads_weights:
            draft = prepare_model(
                sa.speculative_draft_model_path,
                progress=sa.show_progress,
                download_dir=sa.download_dir,
                on_progress=self._on_progress,
            )
            child_args.speculative_draft_model_path = str(draft.model_dir)
        # The trace's clock for this engine's stamps: the host's, or one the processes share
        # (trace/clock.py; the children attach to it by path).
        self.clock: trace_clock.TraceClock = trace_clock.TraceClock()
        if self.deployment.shared_clock:
            path = os.path.join(self.port_args.ipc_dir, "shared-clock")
            self.port_args.extra[trace_clock.SHARED_CLOCK_KEY] = path
            self.clock = trace_clock.SharedClock(path, create=True, replicas=sa.dp_size)
        self.bus = TraceBus(self.port_args.trace_ipc_name, publish_addr=sa.trace_publish, model=self.trace_label)
        ctx = mp.get_context("spawn")
        self._phase("processes", "each imports torch and the serving core")
        from workbench.core.managers.detokenizer_manager import run_detokenizer_process

        readers: dict = {}
        # The children start with SIGINT ignored: a terminal's Ctrl-C goes to the whole process group,
        # and only this process should act on it (it stops them); a child still in interpreter start-up
        # would print a KeyboardInterrupt traceback. An ignored disposition survives spawn's exec (a
        # blocked mask does not: multiprocessing's spawn clears it), and Python then installs no SIGINT
        # handler of its own. The cost: a Ctrl-C in the milliseconds the processes take to start is dropped.
        with _sigint_ignored_by_children():
            with omp_wait_env(sa.device):  # the children's OpenMP threads sleep soon when idle
                self._launch_schedulers(ctx, child_args, readers)
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=run_detokenizer_process,
                name="workbench-detokenizer",
                daemon=True,
                args=(str(self.prepared.model_dir), self.port_args, writer),
            )
            proc.start()
        writer.close()
        self.procs["detokenizer"] = proc
        readers["detokenizer"] = reader
        # The tokenizer loads on a thread while this one reads the children's phase reports as they come.
        tokenizer: dict[str, Any] = {}
        loader = threading.Thread(
            target=_load_tokenizer_into, args=(self.prepared.model_dir, tokenizer), name="workbench-tokenizer"
        )
        loader.start()
        try:
            self.scheduler_info = self._wait_ready(readers)
        finally:
            loader.join()
        if "error" in tokenizer:
            raise tokenizer["error"]
        self.tokenizer = tokenizer["tokenizer"]
        self.context_len = self.scheduler_info["context_len"]
        self.max_total_num_tokens = self.scheduler_info["max_total_num_tokens"]

        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="workbench-engine-loop", daemon=True)
        self._loop_thread.start()
        self.tracer = Tracer("tokenizer", sink=self.bus.publish_batch, clock=self.clock.now_ns)
        self.tokenizer_manager: TokenizerManager = self._run(self._make_tokenizer_manager())
        self.bus.on_listeners_changed = self._on_listeners_changed
        self._recorder = None
        if sa.record:
            from workbench.core.trace.recorder import Recorder

            self._recorder = Recorder(sa.record, model=self.trace_label)
            self.bus.subscribe_callback(self._recorder, name="recorder")
        self._otel = None
        if sa.otlp_traces_endpoint:
            from workbench.core.trace.otel import make_exporter

            self._otel = make_exporter(sa.otlp_traces_endpoint, model=self.served_model_name)
            self.bus.subscribe_callback(self._otel, name="opentelemetry")
        if sa.trace_publish or sa.trace_mode == "on":
            self._on_listeners_changed(True)
        self.is_healthy = True
        self._watchdog = threading.Thread(target=self._watch_children, name="workbench-watchdog", daemon=True)
        self._watchdog.start()
        self.ready_time_s = time.monotonic() - self.t_start
        details = [f"KV pool {self.max_total_num_tokens} tokens"]
        details += [self.scheduler_info[k] for k in ("linears", "huge_pages", "threads") if self.scheduler_info.get(k)]
        self._phase("ready", f"in {self.ready_time_s:.1f} s")
        self._progress(f"ready in {self.ready_time_s:.1f} s ({self.scheduler_info['dtype']}, {'; '.join(details)})")

    def _launch_schedulers(self, ctx, child_args: ServerArgs, readers: dict) -> None:
        """Start this node's scheduler ranks (one per TP rank; rank 0 is role "scheduler").

        Adds each to `self.procs` and its ready pipe to `readers`. With tp_size > 1 the ranks
        meet at `child_args.dist_init_addr`; on several nodes the other nodes' ranks join there too.
        """
        if child_args.dp_size > 1:  # a DataParallelController and N replicas instead
            from workbench.core.managers.data_parallel_controller import launch_data_parallel

            return launch_data_parallel(ctx, child_args, self.port_args, self.procs, readers, self.deployment)
        d = self.deployment
        if d.one_process_per_replica:  # one scheduler process stands for all tp_size devices
            ranks = [0]
        else:
            ranks = tp_ranks_on_node(child_args.tp_size, child_args.nnodes, child_args.node_rank)
        spawn_scheduler_ranks(ctx, child_args, self.port_args, ranks, self.procs, readers, d.scheduler_factory)

    async def _make_tokenizer_manager(self) -> TokenizerManager:
        return TokenizerManager(
            self.server_args,
            self.port_args,
            self.tokenizer,
            self.context_len,
            self.max_total_num_tokens,
            self.tracer,
            asyncio.get_running_loop(),
            clock=self.clock,
        )

    def _wait_ready(self, readers: dict) -> dict:
        hint = (
            " (are all nodes started with the same --dist-init-addr and --nnodes?)"
            if self.server_args.nnodes > 1
            else ""
        )
        infos = wait_ranks_ready(self.procs, readers, START_TIMEOUT_S, timeout_hint=hint, on_phase=self._child_phase)
        info = infos.get("scheduler", {})
        self._progress(f"model loaded in {info.get('load_time_s', 0):.1f} s")
        return info

    def _phase(self, name: str, detail: str = "") -> None:
        """This process begins start-up phase `name`: fold it, log it, hand it on or print it."""
        if name == "failed" and (self.startup.done or not self.startup.phases):
            return  # failed after ready (a later step), or before anything began: nothing to report
        event = ev.EnginePhase(ts=time.monotonic_ns(), proc="engine", phase=name, detail=detail, log_path=self.log_path)
        self._child_phase(event)

    def _child_phase(self, event: ev.EnginePhase) -> None:
        self.startup.apply(event)
        label = PHASE_LABELS.get(event.phase, event.phase)
        line = f"{label}: {event.detail}" if event.detail else label
        append_line(self.log_path, f"phase {event.phase} ({event.proc}): {line}")
        if self._on_phase is not None:
            self._on_phase(event)
        elif event.phase not in ("ready", "failed"):  # the ready line (below) and the error say those
            self._progress(line + " …")

    @property
    def trace_label(self) -> str:
        """The model as the trace's header, the recorder and the views name it: with the deployment's
        badge in front, if it has one (a simulated deployment's `SIMULATED h100x8`)."""
        badge = self.deployment.badge
        return f"{badge} {self.served_model_name}" if badge else self.served_model_name

    @property
    def served_model_name(self) -> str:
        if self.server_args.served_model_name:
            return self.server_args.served_model_name
        path = self.server_args.model_path
        return "smollm2-135m" if path in (None, "smollm2-135m") else os.path.basename(str(path).rstrip("/"))

    # ==== generation ===================================================================
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: Any = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        stream: bool = False,
        rid: str | None = None,
        return_text_in_logprobs: bool = False,
        bootstrap_host: str | list[str] | None = None,
        bootstrap_port: int | list[int] | None = None,
        bootstrap_room: int | list[int] | None = None,
        priority: int | list[int] | None = None,
        lora_path: str | list[str | None] | None = None,
    ):
        """Generate for one prompt (dict), a batch (list of dicts) or stream chunks (iterator).

        Logprobs come as SGLang returns them: meta_info's `output_token_logprobs` (and
        `input_token_logprobs` from prompt position `logprob_start_len` on, -1 for none) are
        [logprob, token_id, text] entries, the text filled when `return_text_in_logprobs`.

        Disaggregated serving (docs/disaggregation.md): on an engine with a `disaggregation_mode`,
        `bootstrap_host`/`bootstrap_port`/`bootstrap_room` name the prefill server's bootstrap port and
        the room both sides of one request meet in (one value, or one per prompt of a batch).

        Priority scheduling (`enable_priority_scheduling`, docs/scheduling.md): `priority` is one value
        for every prompt or one per prompt; larger is more urgent unless `schedule_low_priority_values_first`.
        Without priority scheduling it is ignored, as SGLang does.

        Multi-LoRA (`enable_lora`, docs/lora.md): `lora_path` names the adapter to run under (one name
        for every prompt, or one per prompt, None for the base model)."""
        reqs, is_batch = self._build_reqs(
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            top_logprobs_num,
            logprob_start_len,
            stream,
            rid,
            return_text_in_logprobs,
            (bootstrap_host, bootstrap_port, bootstrap_room),
            priority,
            lora_path,
        )
        if stream:
            if len(reqs) != 1:
                raise ValueError("streaming takes exactly one prompt (and n = 1)")
            return self._stream_sync(reqs[0])
        results = self._run(self._collect(reqs))
        return results if is_batch else results[0]

    async def async_generate(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        return_logprob=False,
        top_logprobs_num=0,
        logprob_start_len=-1,
        stream=False,
        rid=None,
        return_text_in_logprobs=False,
        bootstrap_host=None,
        bootstrap_port=None,
        bootstrap_room=None,
        priority=None,
        lora_path=None,
    ):
        """Like `generate`, awaitable from any event loop; an async iterator when streaming."""
        reqs, is_batch = self._build_reqs(
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            top_logprobs_num,
            logprob_start_len,
            stream,
            rid,
            return_text_in_logprobs,
            (bootstrap_host, bootstrap_port, bootstrap_room),
            priority,
            lora_path,
        )
        if stream:
            if len(reqs) != 1:
                raise ValueError("streaming takes exactly one prompt (and n = 1)")
            return self._stream_async(reqs[0])
        if _running_loop() is self.loop:
            results = await self._collect(reqs)
        else:
            results = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._collect(reqs), self.loop))
        return results if is_batch else results[0]

    def _build_reqs(
        self,
        prompt,
        sampling_params,
        input_ids,
        return_logprob,
        top_logprobs_num,
        logprob_start_len,
        stream,
        rid,
        return_text_in_logprobs=False,
        bootstrap=(None, None, None),
        priority=None,
        lora_path=None,
    ) -> tuple[list[GenerateReqInput], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt or input_ids")
        if prompt is not None:
            is_batch = isinstance(prompt, list)
            texts = prompt if is_batch else [prompt]
            if not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt must be a string or a list of strings")
            items = [(t, None) for t in texts]
        else:
            is_batch = bool(input_ids) and isinstance(input_ids[0], list)
            seqs = input_ids if is_batch else [input_ids]
            items = [(None, list(s)) for s in seqs]
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        if len(sps) != len(items):
            raise ValueError(f"{len(sps)} sampling_params for {len(items)} prompts")
        pd = _bootstrap_per_prompt(bootstrap, len(items))
        prios = _priority_per_prompt(priority, len(items))
        loras = _lora_per_prompt(lora_path, len(items))
        reqs = []
        for i, ((text, ids), sp_in) in enumerate(zip(items, sps)):
            sp = _to_sampling_params(sp_in)
            n = sp.n
            if n > 1 and pd[i][2] is not None:
                raise ValueError("a bootstrap_room names one generation: use n = 1 with disaggregated serving")
            if n < 1 or n > self.server_args.max_n:
                raise ValueError(f"n must be in [1, {self.server_args.max_n}]")
            for j in range(n):
                sp_j = msgspec.structs.replace(sp, n=1, seed=None if sp.seed is None else sp.seed + j)
                req_rid = None if rid is None else (rid if len(items) * n == 1 else f"{rid}-{i}-{j}")
                reqs.append(
                    GenerateReqInput(
                        text=text,
                        input_ids=ids,
                        sampling_params=sp_j,
                        return_logprob=return_logprob,
                        top_logprobs_num=top_logprobs_num,
                        logprob_start_len=logprob_start_len,
                        return_text_in_logprobs=bool(return_text_in_logprobs),
                        stream=stream,
                        rid=req_rid,
                        bootstrap_host=pd[i][0],
                        bootstrap_port=pd[i][1],
                        bootstrap_room=pd[i][2],
                        priority=prios[i],
                        lora_path=loras[i],
                    )
                )
            is_batch = is_batch or n > 1
        return reqs, is_batch

    async def _collect(self, reqs: list[GenerateReqInput]) -> list[dict]:
        async def one(r):
            async for out in self.tokenizer_manager.generate_request(r):
                last = out
            return last

        return list(await asyncio.gather(*(one(r) for r in reqs)))

    def _stream_sync(self, req: GenerateReqInput) -> Iterator[dict]:
        q: queue.Queue = queue.Queue()
        done = object()

        async def produce():
            try:
                async for out in self.tokenizer_manager.generate_request(req):
                    q.put(out)
            except BaseException as exc:  # delivered to the consumer's thread
                q.put(exc)
            finally:
                q.put(done)

        task_fut = asyncio.run_coroutine_threadsafe(produce(), self.loop)
        try:
            while True:
                item = q.get()
                if item is done:
                    return
                if isinstance(item, BaseException):
                    if isinstance(item, asyncio.CancelledError):
                        return
                    raise item
                yield item
        finally:
            if not task_fut.done():
                task_fut.cancel()  # the consumer stopped early: abort the request

    async def _stream_async(self, req: GenerateReqInput) -> AsyncIterator[dict]:
        agen = self.tokenizer_manager.generate_request(req)
        if _running_loop() is self.loop:
            try:
                async for out in agen:
                    yield out
            finally:  # closed early (a client went away): close the request's generator now
                await agen.aclose()
            return
        try:
            while True:
                try:
                    out = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(agen.__anext__(), self.loop))
                except StopAsyncIteration:
                    return
                yield out
        finally:
            asyncio.run_coroutine_threadsafe(agen.aclose(), self.loop)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """Messages -> prompt token ids through the model's chat template (`tools`: OpenAI tool
        definitions, for a template that renders them; see chat_template_renders_tools)."""
        kw = {"tools": tools} if tools else {}
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kw
        )
        return list(ids["input_ids"] if not isinstance(ids, list) else ids)

    @property
    def chat_template_renders_tools(self) -> bool:
        """Whether the model's chat template has a place for a tool list (it mentions `tools`);
        without one the server describes the tools in a system message instead."""
        return "tools" in (getattr(self.tokenizer, "chat_template", None) or "")

    # ==== control ====================================================================
    def abort_request(self, rid: str) -> None:
        self._run(self.tokenizer_manager.abort_request(rid))

    def flush_cache(self) -> bool:
        return self._run(self.tokenizer_manager.flush_cache()).success

    def get_internal_state(self) -> dict:
        return msgspec.structs.asdict(self._run(self.tokenizer_manager.get_internal_state()))

    def get_server_info(self) -> dict:
        """The server's settings as SGLang's /server_info reports them: every ServerArgs field with
        the value in effect where the flag was left to choose (context length, chunked prefill
        size (-1: off), attention backend, running limit, device), plus live figures."""
        info = {k: v for k, v in dataclasses.asdict(self.server_args).items() if k != "api_key"}
        si = self.scheduler_info
        chunk = si.get("chunked_prefill_size", self.server_args.chunked_prefill_size)
        info.update(
            context_length=self.context_len,
            chunked_prefill_size=-1 if chunk is None else chunk,
            attention_backend=si.get("attention_backend") or self.server_args.attention_backend,
            max_running_requests=si.get("max_running_requests", self.server_args.max_running_requests),
            device=si.get("device") or self.server_args.device,
        )
        info.update(
            model_path=self.model_path,
            served_model_name=self.served_model_name,
            context_len=self.context_len,
            max_total_num_tokens=self.max_total_num_tokens,
            dtype=self.scheduler_info.get("dtype"),
            is_healthy=self.is_healthy,
            num_inflight_requests=len(self.tokenizer_manager.rid_to_state),
            ready_time_s=self.ready_time_s,
            pids={role: p.pid for role, p in self.procs.items()},
        )
        if self.is_healthy:
            info["internal_state"] = self.get_internal_state()
        return info

    def stall_reason(self, limit_s: float) -> str | None:
        """Why /health should answer 503 although every process lives: the scheduler has sent nothing for
        more than `limit_s` while requests sent to it are unfinished (its loop is stuck in a step). None
        otherwise. Reads the TokenizerManager's state: call it on the engine's loop (the HTTP handlers run there)."""
        seconds, n = self.tokenizer_manager.stall_s()
        if seconds <= limit_s:
            return None
        return (
            f"the scheduler has not completed a step for {seconds:.0f} s with {n} request(s) in flight "
            f"(limit {limit_s:g} s, WORKBENCH_STALL_S); its log says what it is doing"
        )

    def step_gate(self, action: str, steps: int = 1) -> dict:
        """Pause the scheduler, resume it, or run exactly `steps` iterations while paused."""
        if action not in ("pause", "resume", "step"):
            raise ValueError("action must be pause, resume or step")
        out = self._run(self.tokenizer_manager.step_gate(action, steps))
        return {"paused": out.paused, "step": out.step}

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first `truncate_size` values of a weight, flattened; HF names work (q_proj, gate_proj, ...)."""
        out = self._run(self.tokenizer_manager.get_weights_by_name(name, truncate_size))
        if out.values is None:
            raise ValueError(out.message)
        return out.values

    # ==== weight updates (see core/managers/weight_updater.py) ==========================
    # Each waits for in-flight requests (or aborts them with abort_all_requests=True) while new
    # ones are held, flushes the prefix cache and emits `weights.updated`. A rejected update
    # raises ValueError with the reason and leaves the old weights in place.
    # `flush_cache=False` keeps the radix cache, whose KV was computed with the old weights (SGLang's flag).
    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        """Load a LoRA adapter (PEFT's format) under `lora_name` while serving (docs/lora.md); raises
        ValueError when it cannot be served (the message says why)."""
        out = self._run(self.tokenizer_manager.load_lora_adapter(str(lora_name), str(lora_path)))
        return _lora_reply(out)

    def unload_lora_adapter(self, lora_name: str) -> dict:
        """Forget a LoRA adapter; raises ValueError while a request uses it or when it is unknown."""
        return _lora_reply(self._run(self.tokenizer_manager.unload_lora_adapter(str(lora_name))))

    def update_weights_from_disk(
        self, model_path: str, abort_all_requests: bool = False, flush_cache: bool = True
    ) -> dict:
        """Load a checkpoint (HF dir or .gguf) of the same architecture in place."""
        return _update_reply(
            self._run(
                self.tokenizer_manager.update_weights_from_disk(str(model_path), abort_all_requests, bool(flush_cache))
            )
        )

    def update_weights_from_tensor(
        self, named_tensors, abort_all_requests: bool = False, flush_cache: bool = True
    ) -> dict:
        """Load `[(hf_name, tensor), ...]` (any subset of the weights) from this process."""
        from workbench.core.io_struct import UpdateWeightsFromTensorReq
        from workbench.core.managers.weight_updater import encode_named_tensors

        req = UpdateWeightsFromTensorReq(
            tensors=encode_named_tensors(list(named_tensors)), flush_cache=bool(flush_cache)
        )
        return _update_reply(self._run(self.tokenizer_manager.update_weights_from_tensor(req, abort_all_requests)))

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
        timeout_s: float = 120.0,
    ) -> dict:
        """Join a trainer's process group (trainer = rank 0; this server's TP ranks from `rank_offset`).

        Returns when every rank has joined, so the trainer must join at the same time
        (e.g. `weight_updater.TrainerWeightSync` in another process or thread); the engine keeps
        serving meanwhile (the join runs beside the scheduler's loop). Joining and each later
        broadcast fail after `timeout_s` (at most 300 s; ValueError above). With `rank_offset=0`
        this server hosts the group's store, listening on `master_address` only.
        """
        from workbench.core.io_struct import InitWeightsUpdateGroupReq
        from workbench.core.managers.weight_updater import check_group_timeout

        req = InitWeightsUpdateGroupReq(
            master_address=master_address,
            master_port=int(master_port),
            rank_offset=int(rank_offset),
            world_size=int(world_size),
            group_name=group_name,
            backend=backend,
            timeout_s=check_group_timeout(timeout_s),
        )
        return _update_reply(self._run(self.tokenizer_manager.init_weights_update_group(req)))

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list,
        shapes: list,
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict:
        """Receive `names` (HF names) by broadcast from rank 0 of the group, in order, and load them.

        The trainer broadcasts the same tensors, in the same order, from rank 0 with
        `dist.broadcast(t, src=0, group=pg)` while this call runs.
        """
        from workbench.core.io_struct import UpdateWeightsFromDistributedReq

        req = UpdateWeightsFromDistributedReq(
            names=list(names),
            dtypes=[str(d).replace("torch.", "") for d in dtypes],
            shapes=[[int(x) for x in s] for s in shapes],
            group_name=group_name,
            flush_cache=bool(flush_cache),
        )
        return _update_reply(self._run(self.tokenizer_manager.update_weights_from_distributed(req, abort_all_requests)))

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return _update_reply(self._run(self.tokenizer_manager.destroy_weights_update_group(group_name)))

    # ==== trace ======================================================================
    def subscribe(self, maxsize: int = 100_000, with_snapshot: bool = True, name: str = ""):
        """A Subscription to the trace bus (switches the tracers on while it lives)."""
        return self.bus.subscribe(maxsize=maxsize, with_snapshot=with_snapshot, name=name)

    def subscribe_callback(self, fn, name: str = ""):
        return self.bus.subscribe_callback(fn, name=name)

    def _on_listeners_changed(self, active: bool) -> None:
        mode = self.server_args.trace_mode
        active = mode == "on" or (mode == "auto" and (active or bool(self.server_args.trace_publish)))
        self.tracer.set_enabled(active)
        if not self._shutdown and self.is_healthy or active:
            try:
                asyncio.run_coroutine_threadsafe(self.tokenizer_manager.set_trace(active), self.loop)
            except RuntimeError:
                pass

    # ==== health and shutdown ===========================================================
    def _watch_children(self) -> None:
        sentinels = {p.sentinel: role for role, p in self.procs.items()}
        while not self._shutdown:
            ready = mp_wait(list(sentinels), timeout=0.5)
            if self._shutdown or not ready:
                continue
            role = sentinels[ready[0]]
            proc = self.procs[role]
            proc.join(1.0)  # reap it: until then its exitcode is None
            reason = (
                f"the {role} process died ({exit_reason(proc.exitcode)}); the engine cannot serve "
                f"requests any more — restart it"
            )
            logger.error(reason)
            self.is_healthy = False
            self.bus.publish_batch(
                [
                    ev.ProcExited(
                        ts=self.clock.now_ns(),
                        proc="engine",
                        pid=proc.pid or 0,
                        role=role,
                        exitcode=proc.exitcode,
                        reason=reason,
                    )
                ]
            )
            self.loop.call_soon_threadsafe(self.tokenizer_manager.fail_all, reason)
            return

    def _run(self, coro):
        """Run a coroutine on the engine loop and wait for it (from any thread but the loop's)."""
        if _running_loop() is self.loop:
            raise RuntimeError("use the async API (async_generate, ...) from inside the engine loop")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def shutdown(self) -> None:
        """Stop every process and thread; idempotent."""
        if self._shutdown:
            return
        self._shutdown = True
        self.is_healthy = False
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs.values():
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2)
        loop = getattr(self, "loop", None)
        if loop is not None and loop.is_running():
            tm = getattr(self, "tokenizer_manager", None)
            if tm is not None:
                try:
                    asyncio.run_coroutine_threadsafe(tm.close(), loop).result(timeout=5)
                except Exception:
                    pass
            loop.call_soon_threadsafe(loop.stop)
            self._loop_thread.join(timeout=5)
        # The bus first: its thread stops delivering, so the recorder and exporter it feeds
        # have received their last batch before they close.
        if getattr(self, "bus", None) is not None:
            self.bus.close()
        if getattr(self, "_recorder", None) is not None:
            self._recorder.close()
        if getattr(self, "_otel", None) is not None:
            self._otel.close()
        detach_log_file(getattr(self, "_log_handler", None))
        self.port_args.cleanup()
        try:
            atexit.unregister(self.shutdown)
        except Exception:
            pass

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _bootstrap_per_prompt(bootstrap: tuple, n: int) -> list[tuple]:
    """(host, port, room) for each of n prompts: each given as one value or one per prompt (SGLang's rule)."""
    cols = []
    for name, value in zip(("bootstrap_host", "bootstrap_port", "bootstrap_room"), bootstrap):
        if isinstance(value, list):
            if len(value) != n:
                raise ValueError(f"{name} has {len(value)} values for {n} prompts: give one, or one per prompt")
            cols.append(value)
        else:
            cols.append([value] * n)
    rows = list(zip(*cols))
    if n > 1 and bootstrap[2] is not None and not isinstance(bootstrap[2], list):
        raise ValueError("a batch needs one bootstrap_room per prompt (a list): a room names one request")
    return rows


def _lora_per_prompt(lora_path: str | list[str | None] | None, n: int) -> list[str | None]:
    """Each of n prompts' LoRA adapter: one name for all, or a list of one per prompt (None: the base model)."""
    values = lora_path if isinstance(lora_path, list) else [lora_path] * n
    if len(values) != n:
        raise ValueError(f"lora_path has {len(values)} values for {n} prompts: give one, or one per prompt")
    for v in values:
        if v is not None and (not isinstance(v, str) or not v):
            raise ValueError(f"lora_path must name a loaded adapter (a non-empty string) or be None, got {v!r}")
    return list(values)


def _priority_per_prompt(priority: int | list[int] | None, n: int) -> list[int | None]:
    """Each of n prompts' priority: one value for all, or a list of one per prompt."""
    values = priority if isinstance(priority, list) else [priority] * n
    if len(values) != n:
        raise ValueError(f"priority has {len(values)} values for {n} prompts: give one, or one per prompt")
    for v in values:
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"priority must be an integer (or None), got {v!r}")
    return list(values)


def _to_sampling_params(sp: Any) -> SamplingParams:
    if isinstance(sp, SamplingParams):
        return msgspec.structs.replace(sp)
    return sampling_params_from_dict(sp)


@contextlib.contextmanager
def _sigint_ignored_by_children() -> Iterator[None]:
    """Processes started inside the block ignore SIGINT (see Engine._launch). Only the main thread may
    change a disposition; elsewhere (an Engine built on a worker thread) the block changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        logger.debug("children started with SIGINT ignored in %.1f ms", 1e3 * (time.perf_counter() - t0))


def exit_reason(exitcode: int | None) -> str:
    """A child's `Process.exitcode` in words: "exit code 1", "killed by SIGKILL"."""
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _lora_reply(out) -> dict:
    if not out.success:
        raise ValueError(out.message)
    return {"success": True, "message": out.message, "loaded_adapters": dict(out.loaded_adapters)}


def _update_reply(out) -> dict:
    if not out.success:
        raise ValueError(out.message)
    return {"success": True, "message": out.message, "version": out.version}


def _load_tokenizer_into(model_dir, out: dict) -> None:
    try:
        out["tokenizer"] = load_tokenizer(model_dir)
    except BaseException as exc:  # raised again on the engine's thread
        out["error"] = exc


def _running_loop():
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _print_progress(msg: str) -> None:
    # A Jupyter front end draws stderr as an error box; start-up progress is not an error, so in a
    # kernel it is ordinary output (still in the cell, and in an executed notebook's outputs).
    print(f"[workbench] {msg}", file=sys.stdout if _in_jupyter_kernel() else sys.stderr, flush=True)


def _in_jupyter_kernel() -> bool:
    """True inside an IPython kernel (Jupyter, nbclient), not in a terminal IPython or a script."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return shell is not None and getattr(shell, "kernel", None) is not None
