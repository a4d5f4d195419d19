"""SGLang's native /generate: the engine's own result dicts, or SSE chunks of them."""

from __future__ import annotations

import math
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from workbench.core.entrypoints.errors import bad_request, engine_error_to_api
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
