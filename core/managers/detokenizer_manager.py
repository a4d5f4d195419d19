"""DetokenizerManager: the process between the Scheduler and the TokenizerManager.

Scheduler --PUSH BatchTokenIDOut--> [PULL] DetokenizerManager [PUSH] --BatchStrOut--> TokenizerManager

It turns token ids into incremental text (see incremental_detokenize.py) and
forwards every other message (control replies) unchanged. It never holds the
model, so it imports neither torch nor transformers at module import time.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

import zmq
from workbench.core.engine_log import LOG_PATH_KEY, attach_log_file
from workbench.core.io_struct import BatchStrOut, BatchTokenIDOut, Msg
from workbench.core.ipc import PortArgs, get_zmq_socket, recv_all_nowait, send_msg
from workbench.core.managers.incremental_detokenize import (
    DEFAULT_MAX_STATES,
    IncrementalDetokenizer,
    load_decode_tokenizer,
)
from workbench.core.trace import clock as trace_clock
from workbench.core.trace.events import ProcStarted
from workbench.core.trace.tracer import Tracer

logger = logging.getLogger(__name__)

PROC_NAME = "detokenizer"


class DetokenizerManager:
    """Receives BatchTokenIDOut from the scheduler, sends BatchStrOut to the tokenizer manager."""

    def __init__(self, tokenizer, port_args: PortArgs, max_states: int = DEFAULT_MAX_STATES):
        self.tokenizer = tokenizer
        self.port_args = port_args
        self.context = zmq.Context(1)
        self.recv_from_scheduler = get_zmq_socket(self.context, zmq.PULL, port_args.detokenizer_ipc_name, bind=True)
        self.send_to_tokenizer = get_zmq_socket(self.context, zmq.PUSH, port_args.tokenizer_ipc_name, bind=False)
        self.detokenizer = IncrementalDetokenizer(tokenizer, max_states=max_states)
        self._stopped = False

    # ---- message handling ---------------------------------------------------

    def handle_batch_token_id_out(self, recv_obj: BatchTokenIDOut) -> BatchStrOut:
        """Decode one scheduler step's tokens into a BatchStrOut (deltas only)."""
        try:
            text_deltas = self.detokenizer.process(recv_obj)
            return _str_out(recv_obj, text_deltas)
        except Exception:
            # A bad request (e.g. an id the tokenizer rejects) must not take the
            # other requests of the batch down with it: redo them one by one.
            logger.exception("batch decode failed; decoding its %d requests one by one", len(recv_obj.rids))
            return self._handle_one_by_one(recv_obj)

    def _handle_one_by_one(self, recv_obj: BatchTokenIDOut) -> BatchStrOut:
        n = len(recv_obj.rids)
        deltas = [""] * n
        finished = list(recv_obj.finished_reasons)
        errors: list[str | None] = list(recv_obj.error_messages) if recv_obj.error_messages else [None] * n
        for i in range(n):
            try:
                deltas[i] = self.detokenizer.process(_select(recv_obj, i))[0]
            except Exception as e:  # noqa: BLE001 - reported to the client as an abort
                self.detokenizer.release(recv_obj.rids[i])
                finished[i] = "abort"
                errors[i] = f"detokenizer failed: {type(e).__name__}: {e}"
        out = _str_out(recv_obj, deltas)
        out.finished_reasons = finished
        out.error_messages = errors
        return out

    def handle_msg(self, msg: Msg) -> Msg:
        """What goes to the tokenizer manager for one incoming message."""
        if isinstance(msg, BatchTokenIDOut):
            return self.handle_batch_token_id_out(msg)
        return msg  # control replies pass through untouched

    # ---- loop ---------------------------------------------------------------

    def stop(self) -> None:
        """Make event_loop return after its current poll (at most poll_interval_s)."""
        self._stopped = True

    def event_loop(self, poll_interval_s: float = 1.0, parent_alive: Callable[[], bool] | None = None) -> None:
        """Serve until stop(), or until `parent_alive()` (checked every poll_interval_s) is False."""
        poller = zmq.Poller()
        poller.register(self.recv_from_scheduler, zmq.POLLIN)
        timeout_ms = max(1, int(poll_interval_s * 1000))
        last_parent_check = time.monotonic()
        while not self._stopped:
            if poller.poll(timeout_ms):
                for msg in recv_all_nowait(self.recv_from_scheduler):
                    send_msg(self.send_to_tokenizer, self.handle_msg(msg))
            # Checked on a timer, not per message, so a busy loop pays nothing.
            now = time.monotonic()
            if parent_alive is not None and now - last_parent_check >= poll_interval_s:
                last_parent_check = now
                if not parent_alive():
                    logger.warning("parent process is gone; detokenizer exits")
                    return

    def close(self) -> None:
        """Close the sockets and the context (the ipc files go with PortArgs.cleanup())."""
        self.recv_from_scheduler.close(linger=0)
        self.send_to_tokenizer.close(linger=0)
        self.context.term()


def _str_out(recv_obj: BatchTokenIDOut, text_deltas: list[str]) -> BatchStrOut:
    return BatchStrOut(
        rids=recv_obj.rids,
        text_deltas=text_deltas,
        new_token_ids=recv_obj.new_token_ids,
        finished_reasons=recv_obj.finished_reasons,
        matched_stops=recv_obj.matched_stops,
        prompt_tokens=recv_obj.prompt_tokens,
        completion_tokens=recv_obj.completion_tokens,
        cached_tokens=recv_obj.cached_tokens,
        output_token_logprobs=recv_obj.output_token_logprobs,
        output_top_logprobs=recv_obj.output_top_logprobs,
        input_token_logprobs=recv_obj.input_token_logprobs,
        input_top_logprobs=recv_obj.input_top_logprobs,
        error_messages=recv_obj.error_messages,
        error_status=recv_obj.error_status,
        ts=recv_obj.ts,
    )


_PER_REQ_FIELDS = (
    "rids",
    "new_token_ids",
    "finished_reasons",
    "matched_stops",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stop_strs",
)


def _select(recv_obj: BatchTokenIDOut, i: int) -> BatchTokenIDOut:
    """The one-request BatchTokenIDOut of request i (only the fields decoding reads)."""
    fields: dict[str, Any] = {name: [getattr(recv_obj, name)[i]] for name in _PER_REQ_FIELDS}
    return BatchTokenIDOut(**fields)


def _emit_proc_started(port_args: PortArgs) -> None:
    """Announce this process on the trace bus (its only event; Tracer never raises)."""
    tracer = Tracer(PROC_NAME, endpoint=port_args.trace_ipc_name, enabled=True)
    tracer.emit(ProcStarted(pid=os.getpid(), role=PROC_NAME))
    tracer.close()  # flushes; nothing else to trace here, so no socket stays open


def parent_watch() -> Callable[[], bool]:
    """A cheap check that the process which started this one is still alive.

    Compares getppid() with the parent's pid known from multiprocessing (not
    with getppid() read now: the parent may already be gone and this process
    re-parented before the first look).
    """
    parent = multiprocessing.parent_process()
    expected = parent.pid if parent is not None else os.getppid()
    return lambda: os.getppid() == expected


def _raise_system_exit(signum, frame):
    raise SystemExit(0)


def run_detokenizer_process(model_dir: str, port_args: PortArgs, pipe_writer) -> None:
    """Entry point of the detokenizer process (multiprocessing spawn target).

    Loads the tokenizer from `model_dir` (an HF-style directory), sends
    {"status": "ready", "role": "detokenizer", "pid": ...} through `pipe_writer`
    (or {"status": "error", "role": ..., "error": traceback} and exits 1), then
    serves until SIGTERM or until its parent dies.
    """
    parent_alive = parent_watch()
    # SIGTERM from the parent is the normal shutdown: unwind so sockets close.
    signal.signal(signal.SIGTERM, _raise_system_exit)
    # Ctrl-C in a terminal reaches the whole process group; the parent decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="[detokenizer %(process)d] %(levelname)s %(message)s")
    attach_log_file(port_args.extra.get(LOG_PATH_KEY), own_process=True)
    manager = None
    trace_clock.attach(port_args.extra.get(trace_clock.SHARED_CLOCK_KEY))  # the engine's clock, if it shares one
    try:
        try:
            tokenizer = load_decode_tokenizer(model_dir)
            manager = DetokenizerManager(tokenizer, port_args)
        except Exception:
            pipe_writer.send({"status": "error", "role": PROC_NAME, "error": traceback.format_exc()})
            raise SystemExit(1)
        _emit_proc_started(port_args)
        pipe_writer.send({"status": "ready", "role": PROC_NAME, "pid": os.getpid()})
        manager.event_loop(parent_alive=parent_alive)
    finally:
        if manager is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut close() short
            manager.close()
