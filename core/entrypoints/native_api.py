"""SGLang's native /generate (the engine's own result dicts, or SSE chunks of them) and its
tokenizer routes /tokenize and /detokenize (with vLLM's /tokenizer_info, which lm-eval's `remote`
tokenizer backend reads besides them)."""

from __future__ import annotations

import asyncio
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from workbench.core.entrypoints.errors import APIError, bad_request, engine_error_to_api, validation_error
from workbench.core.entrypoints.openai.protocol import GenerateReqInput
from workbench.core.entrypoints.openai.serving_common import (
    MAX_CHOICES_PER_REQUEST,
    SSE_DONE,
    ChoiceSpec,
    ServingContext,
    SSEResponse,
    StreamGuard,
    generate_all,
    new_rid,
    refuse_off_only,
    sse,
    sse_error,
    stop_aware,
)
from workbench.core.sampling.sampling_params import sampling_params_from_dict


def finite_json(obj: Any) -> Any:
    """JSON has no inf/nan: -inf logprobs become -9999.0, nan becomes null."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        return obj if math.isfinite(obj) else (-9999.0 if obj < 0 else 9999.0)
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def _choice_count(ctx: ServingContext, n: Any) -> int:
    """A sampling_params `n` as an int in [1, max_n] (absent or null: 1), else a 400."""
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= ctx.max_n:
        raise bad_request(f"sampling_params n must be an integer in [1, {ctx.max_n}], got {n!r}", "sampling_params")
    return n


async def native_generate(ctx: ServingContext, request: Request, req: GenerateReqInput):
    """Handle one validated /generate request (single prompt, batch, or a stream)."""
    refuse_off_only(req)
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("give exactly one of text or input_ids", "text")
    if isinstance(req.text, list) and not req.text or isinstance(req.input_ids, list) and not req.input_ids:
        raise bad_request("empty batch", "text" if req.text is not None else "input_ids")
    is_batch = isinstance(req.text, list) or (bool(req.input_ids) and isinstance(req.input_ids[0], list))
    sps = req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params or {}]
    for sp in sps:
        try:  # SGLang's keys and rules (null = default; unsupported keys only while unset)
            sampling_params_from_dict(sp)
        except ValueError as e:
            raise bad_request(str(e), "sampling_params") from None
    n = max(_choice_count(ctx, (sp or {}).get("n")) for sp in sps)
    num_prompts = len(req.text if isinstance(req.text, list) else req.input_ids) if is_batch else 1
    if num_prompts * n > MAX_CHOICES_PER_REQUEST:
        raise bad_request(
            f"too many generations in one request ({num_prompts} prompts x n={n}; at most "
            f"{MAX_CHOICES_PER_REQUEST}): split the batch",
            "text" if req.text is not None else "input_ids",
        )
    if req.input_ids is not None:
        flat = req.input_ids if not is_batch else [t for ids in req.input_ids for t in ids]
        ctx.check_token_ids(flat, "input_ids")
    if req.top_logprobs_num and not 0 <= req.top_logprobs_num <= ctx.max_top_logprobs:
        raise bad_request(f"top_logprobs_num must be between 0 and {ctx.max_top_logprobs}", "top_logprobs_num")
    if req.logprob_start_len is not None and not -1 <= req.logprob_start_len <= ctx.context_len:
        raise bad_request(
            f"logprob_start_len must be -1 (no prompt logprobs) or a prompt position in [0, {ctx.context_len}]",
            "logprob_start_len",
        )
    kwargs = dict(
        prompt=req.text,
        input_ids=req.input_ids,
        sampling_params=req.sampling_params,
        return_logprob=bool(req.return_logprob),
        top_logprobs_num=req.top_logprobs_num or 0,
        logprob_start_len=-1 if req.logprob_start_len is None else req.logprob_start_len,
        return_text_in_logprobs=bool(req.return_text_in_logprobs),
        bootstrap_host=req.bootstrap_host,
        bootstrap_port=req.bootstrap_port,
        bootstrap_room=req.bootstrap_room,
        priority=req.priority,
        lora_path=req.lora_path,
    )
    if req.stream:
        if is_batch or n > 1:
            raise bad_request("streaming takes a single prompt with n=1", "stream")
        rid = req.rid or new_rid("gen")
        try:
            it = (await ctx.engine.async_generate(stream=True, rid=rid, **kwargs)).__aiter__()
            first = await it.__anext__()
        except StopAsyncIteration:
            first = None
        except Exception as e:
            ctx.abort(rid)
            raise engine_error_to_api(e) from e
        guard = StreamGuard(ctx, [rid])

        async def body():
            try:
                if first is not None:
                    yield sse(finite_json(first))
                    if not first.get("meta_info", {}).get("finish_reason"):
                        async for chunk in stop_aware(ctx, it):
                            yield sse(finite_json(chunk))
                guard.finished(rid)
            except Exception as e:  # noqa: BLE001 - in-band: headers are already sent
                yield sse_error(e)
            yield SSE_DONE

        return SSEResponse(body(), guard)
    rid = req.rid if (req.rid or is_batch or n > 1) else new_rid("gen")
    if rid is not None:
        kwargs["rid"] = rid
    spec = ChoiceSpec(0, 0, rid or "", kwargs)
    result = (await generate_all(ctx, request, [spec]))[0]
    return JSONResponse(finite_json(result))


# ---------------------------------------------------------------- tokenizer routes


class TokenizeRequest(BaseModel):
    """SGLang's /tokenize body: a prompt (or a list of them) or chat messages (rendered through the
    model's chat template as a chat completion would be). Unknown fields are ignored, as SGLang does."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[dict[str, Any]] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    """SGLang's /detokenize body: token ids, or a list of id lists."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


class TokenizeResponse(BaseModel):
    """SGLang's answer: one id list (or one per prompt), their lengths, the context length."""

    tokens: list[int] | list[list[int]]
    count: int | list[int]
    max_model_len: int


class DetokenizeResponse(BaseModel):
    """SGLang's `text`, and the same as vLLM's `prompt` (what lm-eval's remote tokenizer reads)."""

    text: str | list[str]
    prompt: str | list[str]


class TokenizerInfo(BaseModel):
    """vLLM's /tokenizer_info fields that lm-eval's remote tokenizer backend reads."""

    tokenizer_class: str
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    chat_template: str | None = None
    model_max_length: int


def _parse_body(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body or b"")
    except ValidationError as e:
        errs = e.errors()
        if errs and errs[0].get("type") == "json_invalid":
            raise bad_request(
                f"Request body is not valid JSON: {errs[0].get('msg', '')}", code="invalid_json"
            ) from None
        raise validation_error(e) from None


def _tokenizer(ctx: ServingContext) -> Any:
    tok = getattr(ctx.engine, "tokenizer", None)
    if tok is None:  # e.g. a simulated engine: it has token counts, not a tokenizer
        raise APIError(503, "This engine has no tokenizer (a simulated one?): no /tokenize", code="engine_unavailable")
    return tok


def tokenize(ctx: ServingContext, req: TokenizeRequest) -> TokenizeResponse:
    """SGLang's TokenizeResponse: `tokens` (a list, or one list per prompt), `count`, `max_model_len`."""
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    tok = _tokenizer(ctx)
    if req.messages is not None:
        try:
            ids: Any = list(
                ctx.engine.apply_chat_template(req.messages, add_generation_prompt=req.add_generation_prompt)
            )
        except Exception as e:  # noqa: BLE001 - any template failure (jinja's own errors too) is the messages' fault
            raise bad_request(f"the chat template rejected the messages: {e}", "messages") from e
        count: Any = len(ids)
    elif isinstance(req.prompt, str):
        ids = list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        count = len(ids)
    else:
        ids = [list(tok.encode(p, add_special_tokens=req.add_special_tokens)) for p in req.prompt]
        count = [len(x) for x in ids]
    return TokenizeResponse(tokens=ids, count=count, max_model_len=ctx.context_len)


def detokenize(ctx: ServingContext, req: DetokenizeRequest) -> DetokenizeResponse:
    """SGLang's DetokenizeResponse `text`; the same string also as `prompt`, the name vLLM's
    answer uses and lm-eval's remote tokenizer reads."""
    tok = _tokenizer(ctx)
    batch = bool(req.tokens) and isinstance(req.tokens[0], list)
    for ids in req.tokens if batch else [req.tokens]:
        ctx.check_token_ids(ids, "tokens")
    if batch:
        text: Any = [tok.decode(ids, skip_special_tokens=req.skip_special_tokens) for ids in req.tokens]
    else:
        text = tok.decode(req.tokens, skip_special_tokens=req.skip_special_tokens)
    return DetokenizeResponse(text=text, prompt=text)


def tokenizer_info(ctx: ServingContext) -> TokenizerInfo:
    """vLLM's /tokenizer_info: the special tokens and the chat template, what lm-eval's `remote`
    tokenizer backend needs besides /tokenize and /detokenize to run without a local tokenizer."""
    tok = _tokenizer(ctx)

    def special(name: str) -> str | None:
        value = getattr(tok, name, None)
        return value if isinstance(value, str) else None

    template = getattr(tok, "chat_template", None)
    return TokenizerInfo(
        tokenizer_class=type(tok).__name__,
        bos_token=special("bos_token"),
        eos_token=special("eos_token"),
        pad_token=special("pad_token"),
        unk_token=special("unk_token"),
        chat_template=template if isinstance(template, str) else None,
        model_max_length=ctx.context_len,
    )


def add_tokenizer_routes(app: FastAPI, ctx: ServingContext) -> None:
    """POST /tokenize and /detokenize (and SGLang's /v1/ names for them), GET /tokenizer_info.
    Tokenizing runs on a worker thread: a long prompt must not hold the event loop."""

    @app.post("/tokenize", operation_id="tokenize")
    @app.post("/v1/tokenize", operation_id="tokenize_v1")
    async def tokenize_route(request: Request):
        req = _parse_body(TokenizeRequest, await request.body())
        return JSONResponse((await asyncio.to_thread(tokenize, ctx, req)).model_dump())

    @app.post("/detokenize", operation_id="detokenize")
    @app.post("/v1/detokenize", operation_id="detokenize_v1")
    async def detokenize_route(request: Request):
        req = _parse_body(DetokenizeRequest, await request.body())
        return JSONResponse((await asyncio.to_thread(detokenize, ctx, req)).model_dump())

    @app.get("/tokenizer_info")
    async def tokenizer_info_route():
        return JSONResponse(tokenizer_info(ctx).model_dump())
