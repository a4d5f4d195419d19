"""POST /v1/completions: raw prompts (string, list of strings, token ids or lists of them).

`echo` prepends the prompt (and, with `logprobs`, the prompt tokens' logprobs,
the first one null). `max_tokens` defaults to 16 as in OpenAI's API; an explicit
null means "up to the context length".
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from workbench.core.entrypoints.errors import APIError, bad_request
from workbench.core.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)
from workbench.core.entrypoints.openai.serving_common import (
    SSE_DONE,
    ServingContext,
    SSEResponse,
    StreamGuard,
    bootstrap_kwargs,
    check_prompt_fits,
    completion_logprobs,
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


def normalize_prompts(ctx: ServingContext, prompt: Any) -> list[dict[str, Any]]:
    """The `prompt` field -> one engine input per prompt ({"prompt": str} or {"input_ids": [...]})."""
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        ctx.check_token_ids(prompt, "prompt")
        return [{"input_ids": list(prompt)}]
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            out.append({"prompt": p})
        else:
            if not p:
                raise bad_request(f"prompt {i} is an empty token list", f"prompt.{i}")
            ctx.check_token_ids(p, f"prompt.{i}")
            out.append({"input_ids": list(p)})
    return out


def _prompt_text(ctx: ServingContext, p: dict[str, Any]) -> str:
    if "prompt" in p or "text" in p:
        return p.get("prompt", p.get("text"))
    return ctx.tokenizer.decode(p["input_ids"], skip_special_tokens=False)


async def create_completion(ctx: ServingContext, request: Request, req: CompletionRequest):
    """Handle one validated completions request; returns a JSONResponse or an SSEResponse."""
    ctx.check_model(req.model)
    refuse_off_only(req)
    if req.suffix:
        raise bad_request("suffix is not supported by this server", "suffix")
    n = req.n or 1
    if req.best_of is not None and req.best_of != n:
        raise bad_request("best_of other than n is not supported", "best_of")
    top_n = req.logprobs
    if top_n is not None and not 0 <= top_n <= ctx.max_top_logprobs:
        raise bad_request(f"logprobs must be between 0 and {ctx.max_top_logprobs}", "logprobs")
    sp = sampling_params_from(req, ctx, req.max_tokens, allow_zero=bool(req.echo))
    prompts = normalize_prompts(ctx, req.prompt)
    if req.max_tokens is None:
        # Explicit null: as many tokens as the context leaves, which differs per prompt.
        if len(prompts) > 1:
            raise bad_request("max_tokens: null needs a single prompt", "max_tokens")
        ids = prompts[0].get("input_ids") or ctx.encode(prompts[0]["prompt"])
        sp["max_new_tokens"] = check_prompt_fits(ctx, len(ids), None)
    else:
        for p in prompts:  # text prompts are checked by the engine after tokenizing
            if "input_ids" in p:
                check_prompt_fits(ctx, len(p["input_ids"]), req.max_tokens)
    if req.echo and top_n is not None:
        # Prompt logprobs are reported against our own tokenization of the prompt.
        prompts = [
            p if "input_ids" in p else {"input_ids": ctx.encode(p["prompt"]), "text": p["prompt"]} for p in prompts
        ]
    gen_kwargs: dict[str, Any] = {}
    if top_n is not None:
        gen_kwargs.update(return_logprob=True, top_logprobs_num=top_n)
        if req.echo:
            gen_kwargs["logprob_start_len"] = 0
    gen_kwargs.update(bootstrap_kwargs(req, len(prompts) * n))
    if req.priority is not None:  # SGLang's extra body field (priority scheduling)
        gen_kwargs["priority"] = req.priority
    lora = ctx.lora_of(req.model, req.lora_path)
    if lora is not None:  # multi-LoRA: model = BASE:ADAPTER or the lora_path extra field
        gen_kwargs["lora_path"] = lora
    echo_texts = [_prompt_text(ctx, p) for p in prompts] if req.echo else None
    echo_ids = [p.get("input_ids") for p in prompts] if req.echo and top_n is not None else None
    prompts = [{k: v for k, v in p.items() if k != "text"} for p in prompts]
    base = req.rid or new_rid("cmpl")
    specs = fan_out(base, prompts, sp, n, gen_kwargs)
    model = req.model or ctx.model_name

    if req.stream:
        opened = await open_streams(ctx, specs)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        guard = StreamGuard(ctx, [s.rid for s in specs])
        return SSEResponse(
            _stream(ctx, base, model, opened, n, top_n, echo_texts, echo_ids, include_usage, guard), guard
        )

    results = await generate_all(ctx, request, specs)
    choices = []
    for spec, res in zip(specs, results):
        meta = res.get("meta_info", {})
        reason, matched = finish_reason_of(meta)
        prefix = echo_texts[spec.prompt_index] if echo_texts else ""
        lp = None
        if top_n is not None:
            lp = completion_logprobs(
                ctx,
                meta.get("output_token_logprobs") or [],
                meta.get("output_top_logprobs") or [],
                top_n,
                prompt_ids=echo_ids[spec.prompt_index] if echo_ids else None,
                input_lps=meta.get("input_token_logprobs"),
                input_tops=meta.get("input_top_logprobs"),
            )
        choices.append(
            CompletionChoice(
                index=spec.index,
                text=prefix + res.get("text", ""),
                logprobs=lp,
                finish_reason=reason,
                matched_stop=matched,
            )
        )
    resp = CompletionResponse(id=base, model=model, choices=choices, usage=usage_from(results, n))
    return JSONResponse(resp.model_dump(mode="json"))


async def _stream(
    ctx: ServingContext,
    rid: str,
    model: str,
    opened,
    n: int,
    top_n: int | None,
    echo_texts: list[str] | None,
    echo_ids: list | None,
    include_usage: bool,
    guard: StreamGuard,
) -> AsyncIterator[str]:
    seen_ids: dict[int, int] = {}
    offsets: dict[int, int] = {}
    finals: dict[int, dict] = {}
    echoed: set[int] = set()
    try:
        async for spec, chunk in merge_streams(opened, ctx):
            meta = chunk.get("meta_info", {})
            reason, matched = finish_reason_of(meta)
            n_ids = len(chunk.get("output_ids") or [])
            text = chunk.get("delta", "")
            prompt_ids = None
            if echo_texts is not None and spec.index not in echoed:
                echoed.add(spec.index)
                text = echo_texts[spec.prompt_index] + text
                prompt_ids = echo_ids[spec.prompt_index] if echo_ids else None
            lp = None
            if top_n is not None:
                lps, tops = new_logprob_items(meta, seen_ids.get(spec.index, 0), n_ids)
                if lps or prompt_ids:
                    lp = completion_logprobs(
                        ctx,
                        lps,
                        tops,
                        top_n,
                        offsets.get(spec.index, 0),
                        prompt_ids,
                        meta.get("input_token_logprobs"),
                        meta.get("input_top_logprobs"),
                    )
                    if lp.tokens:
                        offsets[spec.index] = lp.text_offset[-1] + len(lp.tokens[-1])
            seen_ids[spec.index] = n_ids
            if text or lp is not None or reason:
                yield sse(
                    CompletionResponse(
                        id=rid,
                        model=model,
                        choices=[
                            CompletionChoice(
                                index=spec.index, text=text, logprobs=lp, finish_reason=reason, matched_stop=matched
                            )
                        ],
                    )
                )
            if reason:
                finals[spec.index] = chunk
                guard.finished(spec.rid)
        if include_usage:
            results = [finals.get(s.index, {}) for s, _, _ in opened]
            yield sse(CompletionResponse(id=rid, model=model, choices=[], usage=usage_from(results, n)))
    except APIError as e:
        yield sse(e.to_dict())
    except Exception as e:  # noqa: BLE001 - reported in-band: the status line is already sent
        yield sse_error(e)
    yield SSE_DONE
