"""POST /v1/chat/completions: messages through the model's chat template, then the engine.

Non-streaming answers one `chat.completion`; streaming answers SSE
`chat.completion.chunk`s: a role chunk per choice, content deltas, a final
chunk with `finish_reason`, a usage chunk (`choices: []`) when
`stream_options.include_usage`, then `data: [DONE]`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from workbench.core.entrypoints.errors import APIError, bad_request
from workbench.core.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatResponseMessage,
    ChoiceLogprobs,
    DeltaMessage,
)
from workbench.core.entrypoints.openai.serving_common import (
    SSE_DONE,
    ServingContext,
    SSEResponse,
    StreamGuard,
    bootstrap_kwargs,
    chat_logprobs,
    check_prompt_fits,
    fan_out,
    finish_reason_of,
    generate_all,
    merge_streams,
    new_logprob_items,
    new_rid,
    open_streams,
    refuse_off_only,
    sampling_params_from,
    sse,
    sse_error,
    usage_from,
)
from workbench.core.entrypoints.openai.serving_tools import ToolPlan, plan_tools, render_tool_messages
from workbench.core.function_call.parser import merge_deltas


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Validated request messages -> plain {role, content} dicts for the chat template (an
    assistant's `tool_calls` and a tool message's `tool_call_id` kept)."""
    if not req.messages:
        raise bad_request("messages must contain at least one message", "messages")
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"content part type {part.type!r} is not supported (text only)",
                        f"messages.{i}.content.{j}.type",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        if content is None:
            if m.role != "assistant":
                raise bad_request(f"message {i} ({m.role}) has no content", f"messages.{i}.content")
            content = ""
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.role == "assistant" and m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        if m.role == "tool" and m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def check_chat_features(req: ChatCompletionRequest, ctx: ServingContext) -> None:
    refuse_off_only(req)
    if req.modalities and any(m != "text" for m in req.modalities):
        raise bad_request("only the text modality is supported", "modalities")
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= ctx.max_top_logprobs:
            raise bad_request(f"top_logprobs must be between 0 and {ctx.max_top_logprobs}", "top_logprobs")
        if not req.logprobs and req.top_logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")


async def create_chat_completion(ctx: ServingContext, request: Request, req: ChatCompletionRequest):
    """Handle one validated chat request; returns a JSONResponse or an SSEResponse."""
    ctx.check_model(req.model)
    check_chat_features(req, ctx)
    plan = plan_tools(req, ctx.tool_call_parser)
    native = bool(getattr(ctx.engine, "chat_template_renders_tools", False))
    messages, tools = render_tool_messages(chat_messages(req), plan, native, ctx.tool_call_parser)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    sp = sampling_params_from(req, ctx, max_tokens)
    if plan is not None and plan.forced_schema is not None:
        sp["json_schema"] = plan.forced_schema  # required / named: the output is the calls
    try:
        ids = list(
            ctx.engine.apply_chat_template(
                messages, add_generation_prompt=bool(req.add_generation_prompt), **({"tools": tools} if tools else {})
            )
        )
    except (ValueError, TypeError) as e:  # e.g. a template that rejects the role order
        raise bad_request(f"the chat template rejected the messages: {e}", "messages") from e
    sp["max_new_tokens"] = check_prompt_fits(ctx, len(ids), max_tokens)
    n = req.n or 1
    top_n = req.top_logprobs or 0
    gen_kwargs: dict[str, Any] = {}
    if req.logprobs:
        gen_kwargs.update(return_logprob=True, top_logprobs_num=top_n)
    gen_kwargs.update(bootstrap_kwargs(req, n))
    if req.priority is not None:  # SGLang's extra body field (priority scheduling)
        gen_kwargs["priority"] = req.priority
    lora = ctx.lora_of(req.model, req.lora_path)
    if lora is not None:  # multi-LoRA: model = BASE:ADAPTER or the lora_path extra field
        gen_kwargs["lora_path"] = lora
    base = req.rid or new_rid("chatcmpl")
    specs = fan_out(base, [{"input_ids": ids}], sp, n, gen_kwargs)
    model = req.model or ctx.model_name

    if req.stream:
        opened = await open_streams(ctx, specs)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        guard = StreamGuard(ctx, [s.rid for s in specs])
        return SSEResponse(
            _stream(ctx, base, model, opened, n, len(ids), top_n, bool(req.logprobs), include_usage, guard, plan),
            guard,
        )

    results = await generate_all(ctx, request, specs)
    choices = []
    for spec, res in zip(specs, results):
        meta = res.get("meta_info", {})
        reason, matched = finish_reason_of(meta)
        lp = None
        if req.logprobs:
            lp = ChoiceLogprobs(
                content=chat_logprobs(
                    ctx, meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs") or [], top_n
                )
            )
        message = ChatResponseMessage(content=res.get("text", ""))
        if plan is not None:  # the same parser as a stream's, fed the whole text: the answers agree
            content, calls = plan.new_parser().parse(message.content)
            message = ChatResponseMessage(
                content=(content or None) if calls else content, tool_calls=[c.to_openai() for c in calls] or None
            )
            if calls and reason == "stop":
                reason = "tool_calls"
        choices.append(
            ChatCompletionChoice(
                index=spec.index,
                message=message,
                logprobs=lp,
                finish_reason=reason,
                matched_stop=matched,
            )
        )
    resp = ChatCompletionResponse(id=base, model=model, choices=choices, usage=usage_from(results, n, [len(ids)]))
    return JSONResponse(resp.model_dump(mode="json"))


async def _stream(
    ctx: ServingContext,
    rid: str,
    model: str,
    opened,
    n: int,
    prompt_len: int,
    top_n: int,
    want_logprobs: bool,
    include_usage: bool,
    guard: StreamGuard,
    plan: ToolPlan | None = None,
) -> AsyncIterator[str]:
    seen_ids: dict[int, int] = {}
    finals: dict[int, dict] = {}
    parsers = {spec.index: plan.new_parser() for spec, _, _ in opened} if plan is not None else {}
    try:
        for spec, _, _ in opened:
            yield sse(
                ChatCompletionChunk(
                    id=rid,
                    model=model,
                    choices=[
                        ChatCompletionStreamChoice(index=spec.index, delta=DeltaMessage(role="assistant", content=""))
                    ],
                )
            )
        async for spec, chunk in merge_streams(opened, ctx):
            meta = chunk.get("meta_info", {})
            reason, matched = finish_reason_of(meta)
            n_ids = len(chunk.get("output_ids") or [])
            lp = None
            if want_logprobs:
                lps, tops = new_logprob_items(meta, seen_ids.get(spec.index, 0), n_ids)
                if lps:
                    lp = ChoiceLogprobs(content=chat_logprobs(ctx, lps, tops, top_n))
            seen_ids[spec.index] = n_ids
            delta = chunk.get("delta", "")
            calls: list[dict] = []
            if spec.index in parsers:  # tools: calls are taken out of the text as it grows
                parser = parsers[spec.index]
                delta, found = parser.feed(delta or "")
                if reason:
                    rest, more = parser.finish()
                    delta, found = delta + rest, found + more
                    if parser.calls and reason == "stop":
                        reason = "tool_calls"
                # feed's and finish's entries for one call go out as one (one entry per index a chunk)
                calls = [d.to_openai() for d in merge_deltas(found)]
            if delta or calls or lp is not None or reason:
                yield sse(
                    ChatCompletionChunk(
                        id=rid,
                        model=model,
                        choices=[
                            ChatCompletionStreamChoice(
                                index=spec.index,
                                delta=DeltaMessage(content=delta or None, tool_calls=calls or None),
                                logprobs=lp,
                                finish_reason=reason,
                                matched_stop=matched,
                            )
                        ],
                    )
                )
            if reason:
                finals[spec.index] = chunk
                guard.finished(spec.rid)
        if include_usage:
            results = [finals.get(s.index, {}) for s, _, _ in opened]
            yield sse(ChatCompletionChunk(id=rid, model=model, choices=[], usage=usage_from(results, n, [prompt_len])))
    except APIError as e:
        yield sse(e.to_dict())
    except Exception as e:  # noqa: BLE001 - reported in-band: the status line is already sent
        yield sse_error(e)
    yield SSE_DONE
