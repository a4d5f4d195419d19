"""What chat and completions share: request checks, sampling-parameter mapping,
fan-out of `n` choices into engine requests, logprob conversion, SSE framing,
usage accounting and aborting on client disconnect.

Every choice of every prompt is one engine request with `n=1` (its own rid), so
streaming works for `n > 1` and a disconnect can abort exactly the requests it
started. With a `seed`, choice i samples with `seed + i` so the choices differ
and the whole response is still reproducible.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from workbench.core.constrained.grammar import ANY_JSON
from workbench.core.constrained.grammar_check import check_grammar
from workbench.core.entrypoints.errors import APIError, bad_request, engine_error_to_api
from workbench.core.entrypoints.openai.protocol import (
    OFF_ONLY_FIELDS,
    ChatTokenLogprob,
    CommonOpenAIFields,
    CompletionLogprobs,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)

logger = logging.getLogger(__name__)

# Most choices (prompts x n) one request may fan out into.
MAX_CHOICES_PER_REQUEST = 256


@dataclass
class ServingContext:
    """The engine plus what the handlers need to know about the served model.

    `abort` takes a rid and must not block the engine loop (see http_server)."""

    engine: Any
    model_name: str
    model_path: str
    context_len: int
    vocab_size: int | None
    max_n: int = 16
    max_top_logprobs: int = 20
    tool_call_parser: str = "hermes"  # --tool-call-parser
    aliases: frozenset = frozenset()
    abort: Callable[[str], None] = lambda rid: None
    # set by the server when its drain window is over: requests still running end with a 503
    # (in-band for streams, before the stream closes) and their KV is freed
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    _tok_str: dict = field(default_factory=dict)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def check_model(self, name: str | None) -> None:
        """Unknown model name -> 404 (None means the served model; BASE:ADAPTER a LoRA adapter of it)."""
        if name is None or name == self.model_name or name in self.aliases:
            return
        base, sep, adapter = name.rpartition(":")
        if sep and adapter and (base == self.model_name or base in self.aliases):
            return  # the adapter itself is checked by the scheduler (unknown: a 400 saying which are loaded)
        raise APIError(
            404,
            f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
            param="model",
            code="model_not_found",
        )

    def lora_of(self, model: str | None, lora_path: str | None) -> str | None:
        """The LoRA adapter an OpenAI request names, as SGLang reads it: `model` = BASE:ADAPTER, or the
        `lora_path` extra body field (both: they must agree); None for the base model."""
        adapter = None
        if model and model != self.model_name and model not in self.aliases:
            base, sep, name = model.rpartition(":")
            if sep and name and (base == self.model_name or base in self.aliases):
                adapter = name
        if lora_path is not None and adapter is not None and lora_path != adapter:
            raise APIError(
                400,
                f"`model` names adapter {adapter!r} but `lora_path` names {lora_path!r}: give one of them",
                param="lora_path",
            )
        return adapter if adapter is not None else lora_path

    def token_str(self, tid: int) -> str:
        s = self._tok_str.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid], skip_special_tokens=False)
            if len(self._tok_str) < 200_000:
                self._tok_str[tid] = s
        return s

    def encode(self, text: str) -> list[int]:
        """Tokenize a raw prompt exactly as the TokenizerManager does (no special tokens added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def check_token_ids(self, ids: Iterable[int], param: str) -> None:
        for t in ids:
            if t < 0 or (self.vocab_size is not None and t >= self.vocab_size):
                raise bad_request(f"token id {t} is outside the vocabulary (size {self.vocab_size})", param)


def new_rid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------- request checks


def response_format_grammar(response_format: dict | None) -> tuple[str, str] | None:
    """OpenAI's response_format -> the sampling param that constrains the output, or None:
    text: none; json_object: any JSON object; json_schema: `json_schema.schema` (strict or not,
    the output follows it)."""
    fmt = (response_format or {}).get("type", "text")
    if fmt == "text":
        return None
    if fmt == "json_object":
        return "json_schema", ANY_JSON
    if fmt == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request(
                "response_format json_schema needs json_schema.schema (a JSON Schema object)", "response_format"
            )
        return "json_schema", json.dumps(schema)
    raise bad_request(f"response_format {fmt!r}: one of text, json_object, json_schema", "response_format")


def refuse_off_only(req) -> None:
    """A 400 naming the first OFF_ONLY_FIELDS feature a request turns on (SGLang's fields for
    features this server does not have, which routers and clients send switched off)."""
    for name in OFF_ONLY_FIELDS:
        if getattr(req, name, None):
            raise bad_request(f"{name} is not supported by this server: leave it false or unset", name)


def bootstrap_kwargs(req, num_generations: int) -> dict[str, Any]:
    """A PD router's bootstrap fields as engine arguments ({} when none are set): on the OpenAI routes one
    room names one generation, so they need a single prompt and n = 1 (a 400 otherwise)."""
    fields = {k: getattr(req, k, None) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")}
    if all(v is None for v in fields.values()):
        return {}
    if num_generations != 1:
        raise bad_request(
            "a bootstrap_room names one generation: send one prompt with n = 1 in disaggregated serving",
            "bootstrap_room",
        )
    return fields


def structured_output(req: CommonOpenAIFields) -> dict[str, str]:
    """The one grammar a request sets, as the sampling param that carries it ({} for none):
    `response_format`, or SGLang's `json_schema` / `regex` / `ebnf` extras."""
    found = {}
    for key in ("json_schema", "regex", "ebnf"):
        value = getattr(req, key)
        if value is not None:
            found[key] = value if isinstance(value, str) else json.dumps(value)
    fmt = response_format_grammar(req.response_format)
    if fmt is not None:
        if found:
            raise bad_request(
                f"response_format constrains the output already: drop {', '.join(found)}", "response_format"
            )
        found = {fmt[0]: fmt[1]}
    if len(found) > 1:
        raise bad_request(f"set at most one of json_schema, regex and ebnf, got {', '.join(found)}", next(iter(found)))
    for kind, text in found.items():
        # an unreadable or impossible grammar ({"$ref": "#"}) is a 400 here, before any decoding
        try:
            check_grammar(kind, text)
        except ValueError as e:
            raise bad_request(str(e), "response_format" if fmt is not None else kind) from None
    return found


def sampling_params_from(
    req: CommonOpenAIFields, ctx: ServingContext, max_new_tokens: int | None, allow_zero: bool = False
) -> dict[str, Any]:
    """OpenAI request fields -> SGLang sampling_params (only what the client set). `allow_zero`:
    max_tokens 0 is allowed (completions with echo: scoring a prompt, as lm-eval does)."""
    logit_bias = None
    if req.logit_bias:
        try:
            logit_bias = {int(t): b for t, b in req.logit_bias.items()}
        except ValueError:
            raise bad_request("logit_bias keys must be token ids (integers as strings)", "logit_bias") from None
        ctx.check_token_ids(logit_bias, "logit_bias")
        if not all(isinstance(b, (int, float)) and -100 <= b <= 100 for b in logit_bias.values()):
            raise bad_request("logit_bias values must be numbers in [-100, 100]", "logit_bias")
    n = 1 if req.n is None else req.n
    if not 1 <= n <= ctx.max_n:
        raise bad_request(f"n must be between 1 and {ctx.max_n}, got {n}", "n")
    if max_new_tokens is not None:
        if max_new_tokens < (0 if allow_zero else 1):
            hint = "" if allow_zero else " (0 scores the prompt: completions with echo=true)"
            raise bad_request(
                f"max_tokens must be at least {0 if allow_zero else 1}, got {max_new_tokens}{hint}", "max_tokens"
            )
        if max_new_tokens > ctx.context_len:
            raise bad_request(
                f"max_tokens ({max_new_tokens}) is larger than the model's context length ({ctx.context_len})",
                "max_tokens",
                "context_length_exceeded",
            )
    if req.min_tokens is not None and req.min_tokens < 0:
        raise bad_request(f"min_tokens must be >= 0, got {req.min_tokens}", "min_tokens")
    if req.stop_token_ids:
        ctx.check_token_ids(req.stop_token_ids, "stop_token_ids")
    stop = req.stop
    if isinstance(stop, list) and len(stop) > 16:
        raise bad_request("at most 16 stop sequences are allowed", "stop")
    sp: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
        "repetition_penalty": req.repetition_penalty,
        "stop": stop,
        "stop_token_ids": req.stop_token_ids,
        "ignore_eos": req.ignore_eos,
        "min_new_tokens": req.min_tokens,
        "skip_special_tokens": req.skip_special_tokens,
        "spaces_between_special_tokens": req.spaces_between_special_tokens,
        "no_stop_trim": req.no_stop_trim,
        "seed": req.seed,
        "logit_bias": logit_bias,
        **structured_output(req),
    }
    return {k: v for k, v in sp.items() if v is not None}


def check_prompt_fits(ctx: ServingContext, prompt_len: int, max_new_tokens: int | None) -> int:
    """Resolve max_new_tokens (None: up to the context) and check prompt + output fits."""
    room = ctx.context_len - prompt_len
    if room <= 0 or (max_new_tokens is not None and max_new_tokens > room):
        want = "" if max_new_tokens is None else f" + {max_new_tokens} max_tokens"
        raise bad_request(
            f"This model's maximum context length is {ctx.context_len} tokens; the request has "
            f"{prompt_len} prompt tokens{want}. Shorten the prompt or lower max_tokens.",
            "messages" if max_new_tokens is None else "max_tokens",
            "context_length_exceeded",
        )
    return room if max_new_tokens is None else max_new_tokens


# ---------------------------------------------------------------- engine fan-out


@dataclass
class ChoiceSpec:
    """One engine request behind one choice."""

    index: int
    prompt_index: int
    rid: str
    kwargs: dict[str, Any]


def fan_out(
    base_rid: str, prompts: list[dict[str, Any]], sampling_params: dict[str, Any], n: int, gen_kwargs: dict[str, Any]
) -> list[ChoiceSpec]:
    """prompts x n -> ChoiceSpecs (OpenAI's order: prompt-major)."""
    if len(prompts) * n > MAX_CHOICES_PER_REQUEST:
        raise bad_request(
            f"too many choices in one request ({len(prompts)} prompts x n={n}; at most {MAX_CHOICES_PER_REQUEST})", "n"
        )
    specs = []
    for p, prompt in enumerate(prompts):
        for i in range(n):
            sp = dict(sampling_params)
            if "seed" in sp and i:
                sp["seed"] = (sp["seed"] + i) % (1 << 63)
            idx = p * n + i
            rid = base_rid if len(prompts) * n == 1 else f"{base_rid}-{idx}"
            specs.append(ChoiceSpec(idx, p, rid, dict(prompt, sampling_params=sp, rid=rid, **gen_kwargs)))
    return specs


async def generate_all(ctx: ServingContext, request: Request, specs: list[ChoiceSpec]) -> list[dict]:
    """Run every choice to completion; a client disconnect aborts them all."""

    async def one(spec: ChoiceSpec):
        return await ctx.engine.async_generate(**spec.kwargs)

    tasks = [asyncio.ensure_future(one(s)) for s in specs]
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    gathered = asyncio.gather(*tasks)
    # Retrieve its outcome even when nobody awaits it (cancelled on disconnect), so
    # asyncio does not log "exception was never retrieved".
    gathered.add_done_callback(lambda f: f.cancelled() or f.exception())
    stop = asyncio.ensure_future(ctx.stopping.wait())
    try:
        done, _ = await asyncio.wait({gathered, watcher, stop}, return_when=asyncio.FIRST_COMPLETED)
        if gathered not in done:
            # The client went away (or the server stops): free the KV instead of finishing work nobody reads.
            for s in specs:
                ctx.abort(s.rid)
            gathered.cancel()
            if stop in done:
                raise shutdown_error()
            raise APIError(499, "client disconnected", code="client_disconnected")
        return gathered.result()
    except BaseException as e:
        for t in tasks:
            if not t.done():
                t.cancel()
                ctx.abort(specs[tasks.index(t)].rid)
        if isinstance(e, (APIError, asyncio.CancelledError)):
            raise
        if isinstance(e, Exception):
            raise engine_error_to_api(e) from e
        raise
    finally:
        watcher.cancel()
        stop.cancel()


def shutdown_error() -> APIError:
    return APIError(
        503,
        "The server is shutting down and stopped this request before it finished; send it again "
        "(to another server if this one does not come back)",
        code="server_shutdown",
    )


async def until_stopping(ctx: ServingContext, awaitable):
    """Await `awaitable` unless the server stops serving first (then APIError 503 server_shutdown)."""
    if ctx.stopping.is_set():
        if asyncio.iscoroutine(awaitable):
            awaitable.close()
        raise shutdown_error()
    task = asyncio.ensure_future(awaitable)
    stop = asyncio.ensure_future(ctx.stopping.wait())
    try:
        done, _ = await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        # We were cancelled (the client went away): cancel what we were waiting for too. Left
        # running, it would drive the request's generator one step and leave it suspended, its
        # state in the tokenizer manager until a garbage collection happened to free it.
        task.cancel()
        raise
    finally:
        stop.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise shutdown_error()


async def stop_aware(ctx: ServingContext, it: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """The chunks of `it` until it ends or the server stops serving (then APIError 503)."""
    while True:
        try:
            chunk = await until_stopping(ctx, it.__anext__())
        except StopAsyncIteration:
            return
        yield chunk


async def _wait_disconnect(request: Request) -> None:
    # After the body is read, the next ASGI message can only be the disconnect.
    while True:
        msg = await request.receive()
        if msg.get("type") == "http.disconnect":
            return


async def open_streams(
    ctx: ServingContext, specs: list[ChoiceSpec]
) -> list[tuple[ChoiceSpec, dict | None, AsyncIterator[dict] | None]]:
    """Start every choice as a stream and wait for its first chunk, so that a bad
    request fails with a status code before any SSE byte is sent."""

    async def start(spec: ChoiceSpec):
        it = await ctx.engine.async_generate(stream=True, **spec.kwargs)
        it = it.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            return spec, None, None
        return spec, first, it

    tasks = [asyncio.ensure_future(start(s)) for s in specs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException as e:
        for s, t in zip(specs, tasks):
            if not t.done():
                t.cancel()
            ctx.abort(s.rid)
        if isinstance(e, Exception) and not isinstance(e, APIError):
            raise engine_error_to_api(e) from e
        raise


async def merge_streams(opened, ctx: ServingContext | None = None) -> AsyncIterator[tuple[ChoiceSpec, dict]]:
    """Interleave the chunks of several choices as they come (first chunks first); with `ctx`, end
    with APIError 503 when the server stops serving before they finish."""
    queue: asyncio.Queue = asyncio.Queue()
    live = 0

    async def pump(spec, it):
        try:
            async for chunk in it:
                await queue.put((spec, chunk, None))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((spec, None, e))
            return
        await queue.put((spec, None, StopAsyncIteration()))

    for spec, first, _ in opened:
        if first is not None:
            yield spec, first
    tasks = []
    for spec, first, it in opened:
        if it is not None and not is_finished(first):
            tasks.append(asyncio.ensure_future(pump(spec, it)))
            live += 1
    try:
        while live:
            spec, chunk, err = await (queue.get() if ctx is None else until_stopping(ctx, queue.get()))
            if err is not None:
                live -= 1
                if isinstance(err, StopAsyncIteration):
                    continue
                raise err
            yield spec, chunk
    finally:
        for t in tasks:
            t.cancel()


def is_finished(chunk: dict | None) -> bool:
    return bool(chunk and chunk.get("meta_info", {}).get("finish_reason"))


class StreamGuard:
    """Tracks which rids of a stream are still running, to abort them on disconnect."""

    def __init__(self, ctx: ServingContext, rids: Iterable[str]):
        self.ctx = ctx
        self.pending = set(rids)

    def finished(self, rid: str) -> None:
        self.pending.discard(rid)

    def abort_pending(self) -> None:
        for rid in list(self.pending):
            self.ctx.abort(rid)
        self.pending.clear()


class SSEResponse(StreamingResponse):
    """A text/event-stream response that aborts the engine requests it still owns when
    the client disconnects (or anything else stops the stream early)."""

    def __init__(self, content: AsyncIterator[str], guard: StreamGuard):
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.guard = guard

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.guard.abort_pending()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except BaseException:  # noqa: BLE001 - best effort cleanup
                    pass


def sse(obj: Any) -> str:
    """One SSE event; pydantic models are dumped without None-valued optional extras."""
    if hasattr(obj, "model_dump_json"):
        return f"data: {obj.model_dump_json()}\n\n"
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(exc: BaseException) -> str:
    err = engine_error_to_api(exc) if not isinstance(exc, APIError) else exc
    return sse(err.to_dict())


# ---------------------------------------------------------------- results


def finish_reason_of(meta: dict) -> tuple[str | None, Any]:
    fr = meta.get("finish_reason")
    if not fr:
        return None, None
    if isinstance(fr, str):
        return fr, None
    return fr.get("type"), fr.get("matched")


def usage_from(results: list[dict], n: int, prompt_lens: list[int] | None = None) -> UsageInfo:
    """Prompt tokens and cached tokens count once per prompt (the largest reuse among
    its n choices); completion tokens count every choice."""
    prompt = cached = completion = 0
    for p in range(0, len(results), n):
        group = results[p : p + n]
        metas = [r.get("meta_info", {}) for r in group]
        prompt += prompt_lens[p // n] if prompt_lens else int(metas[0].get("prompt_tokens", 0))
        cached += max(int(m.get("cached_tokens", 0) or 0) for m in metas)
        completion += sum(int(m.get("completion_tokens", 0)) for m in metas)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def new_logprob_items(meta: dict, seen: int, n_ids: int) -> tuple[list, list]:
    """The output logprob entries after the first `seen`: streaming chunks may carry
    the whole list so far (cumulative) or only the new entries."""
    lps = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    if len(lps) >= n_ids and n_ids >= seen:  # cumulative
        return lps[seen:n_ids], tops[seen:n_ids]
    return lps, tops


def chat_logprobs(ctx: ServingContext, lps: list, tops: list, top_n: int) -> list[ChatTokenLogprob]:
    out = []
    for k, item in enumerate(lps):
        lp, tid = finite_logprob(item[0]), int(item[1])
        tok = ctx.token_str(tid)
        top_items = []
        if top_n and k < len(tops) and tops[k]:
            for t in tops[k][:top_n]:
                ts = ctx.token_str(int(t[1]))
                top_items.append(TopLogprob(token=ts, logprob=finite_logprob(t[0]), bytes=list(ts.encode())))
        out.append(ChatTokenLogprob(token=tok, logprob=lp, bytes=list(tok.encode()), top_logprobs=top_items))
    return out


def completion_logprobs(
    ctx: ServingContext,
    lps: list,
    tops: list,
    top_n: int,
    start_offset: int = 0,
    prompt_ids: list[int] | None = None,
    input_lps: list | None = None,
    input_tops: list | None = None,
) -> CompletionLogprobs:
    """Completions-shaped logprobs; with `prompt_ids` (echo) the prompt tokens come first,
    their logprobs from `input_lps` and their top tokens from `input_tops` (SGLang's meta_info
    lists; the first prompt token has neither)."""
    out = CompletionLogprobs()
    offset = start_offset
    rows: list[tuple[float | None, int, Any]] = []
    if prompt_ids is not None:
        in_lps = [it[0] if isinstance(it, (list, tuple)) else it for it in (input_lps or [])]
        in_lps = [None] * (len(prompt_ids) - len(in_lps)) + in_lps[-len(prompt_ids) :] if prompt_ids else []
        in_tops = list(input_tops or [])[-len(prompt_ids) :] if prompt_ids else []
        in_tops = [None] * (len(prompt_ids) - len(in_tops)) + in_tops
        rows += [(lp, tid, top) for lp, tid, top in zip(in_lps, prompt_ids, in_tops)]
    rows += [(it[0], it[1], tops[k] if k < len(tops) else None) for k, it in enumerate(lps)]
    for lp, tid, top in rows:
        tok = ctx.token_str(int(tid))
        out.tokens.append(tok)
        out.token_logprobs.append(None if lp is None else finite_logprob(lp))
        out.text_offset.append(offset)
        offset += len(tok)
        if top_n and top:
            out.top_logprobs.append({ctx.token_str(int(t[1])): finite_logprob(t[0]) for t in top[:top_n]})
        else:
            out.top_logprobs.append(None)
    return out


def finite_logprob(x: Any) -> float:
    """JSON has no -inf: a token the sampler could never pick gets -9999.0."""
    v = float(x)
    if v != v:
        return -9999.0
    return max(v, -9999.0) if v != float("inf") else 0.0
