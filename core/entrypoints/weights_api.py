"""SGLang's weight-update routes over HTTP: request models, answers and errors.

Each route validates its JSON body with a pydantic model (a wrong type, a missing or unknown field
is a 422 in the OpenAI error envelope, like every other route), then calls the Engine method of
the same name off the event loop. The answers keep SGLang's shape, which its clients
(`sglang.srt.entrypoints.http_server_engine`, RL trainers) read: `{"success": true, "message",
"version"}` on success. An update the engine refuses (a missing checkpoint, no group, a shape that
does not match) is a 400 whose body is the OpenAI envelope plus SGLang's `success: false` and
`message`, so both kinds of client find what they look for; the old weights keep serving. A body
that is not JSON (400) or that the model refuses (422) gets the same two fields.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from workbench.core.entrypoints.errors import APIError, parse_body
from workbench.core.entrypoints.native_api import finite_json


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class UpdateWeightFromDiskReqInput(_Strict):
    """Load a checkpoint (HF directory or .gguf) of the served architecture in place."""

    model_path: str = Field(min_length=1)
    abort_all_requests: bool = False
    flush_cache: bool = True


class InitWeightsUpdateGroupReqInput(_Strict):
    """Join a trainer's process group (the trainer is rank 0; this server's ranks start at `rank_offset`)."""

    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=0)
    world_size: int = Field(ge=1)
    group_name: str = Field("weight_update_group", min_length=1)
    backend: Literal["gloo", "nccl"] = "gloo"
    # At most 300 s: a larger value is refused with a 400 naming the bound (weight_updater.check_group_timeout).
    timeout_s: float = Field(120.0, gt=0, description="seconds to wait for the trainer, and for each broadcast")


class UpdateWeightsFromDistributedReqInput(_Strict):
    """Receive `names` (HF names) by broadcast from rank 0 of the group, in order, and load them."""

    names: list[str] = Field(min_length=1)
    dtypes: list[str] = Field(min_length=1)
    shapes: list[list[int]] = Field(min_length=1)
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False


class DestroyWeightsUpdateGroupReqInput(_Strict):
    group_name: str = "weight_update_group"


class GetWeightsByNameReqInput(_Strict):
    """The first `truncate_size` values of a weight, flattened (HF names work)."""

    name: str = Field(min_length=1)
    truncate_size: int = Field(100, ge=1)


class LoadLoRAAdapterReqInput(_Strict):
    """Load (or reload) a LoRA adapter in PEFT's format under a name (--enable-lora; docs/lora.md)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterReqInput(_Strict):
    """Forget a LoRA adapter (refused while a queued or running request uses it)."""

    lora_name: str = Field(min_length=1)


class LoRAUpdateOutput(BaseModel):
    """SGLang's answer to a LoRA load/unload: the adapters known afterwards (name -> path)."""

    success: bool
    message: str
    loaded_adapters: dict[str, str]


class WeightsUpdateOutput(BaseModel):
    """SGLang's answer to a weight update (`version` counts the updates so far)."""

    success: bool
    message: str
    version: int | None = None


class WeightsErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class WeightsErrorResponse(BaseModel):
    """An update the engine refused: the OpenAI envelope plus SGLang's `success` and `message`."""

    error: WeightsErrorDetail
    success: bool = False
    message: str


# path -> (Engine method, request model, answer model, HTTP methods)
WEIGHT_ROUTES: dict[str, tuple[str, type[BaseModel], Any, tuple[str, ...]]] = {
    "/update_weights_from_disk": (
        "update_weights_from_disk",
        UpdateWeightFromDiskReqInput,
        WeightsUpdateOutput,
        ("POST",),
    ),
    "/init_weights_update_group": (
        "init_weights_update_group",
        InitWeightsUpdateGroupReqInput,
        WeightsUpdateOutput,
        ("POST",),
    ),
    "/update_weights_from_distributed": (
        "update_weights_from_distributed",
        UpdateWeightsFromDistributedReqInput,
        WeightsUpdateOutput,
        ("POST",),
    ),
    "/destroy_weights_update_group": (
        "destroy_weights_update_group",
        DestroyWeightsUpdateGroupReqInput,
        WeightsUpdateOutput,
        ("POST",),
    ),
    "/get_weights_by_name": ("get_weights_by_name", GetWeightsByNameReqInput, list[float], ("GET", "POST")),
    "/load_lora_adapter": ("load_lora_adapter", LoadLoRAAdapterReqInput, LoRAUpdateOutput, ("POST",)),
    "/unload_lora_adapter": ("unload_lora_adapter", UnloadLoRAAdapterReqInput, LoRAUpdateOutput, ("POST",)),
}


def refused(message: str) -> JSONResponse:
    """400 for an update the engine refused (see the module docstring)."""
    body = APIError(400, message, code="weights_update_failed").to_dict()
    return JSONResponse({**body, "success": False, "message": message}, status_code=400)


def _route(engine: Any, method: str, model: type[BaseModel]):
    async def route(request: Request):
        # An empty body is `{}`: a route whose fields all have defaults needs none.
        try:
            req = parse_body(model, (await request.body()) or b"{}")
        except APIError as e:  # not JSON (400), or a body the model refuses (422)
            return JSONResponse({**e.to_dict(), "success": False, "message": e.message}, status_code=e.status)
        try:
            out = await asyncio.to_thread(getattr(engine, method), **req.model_dump())
        except (ValueError, TypeError) as e:
            return refused(str(e))
        return JSONResponse(finite_json(out))

    return route


def add_weight_routes(app: FastAPI, engine: Any) -> None:
    """Register the routes of WEIGHT_ROUTES on `app`, calling `engine`'s methods."""
    for path, (method, model, _answer, http_methods) in WEIGHT_ROUTES.items():
        route = _route(engine, method, model)
        for m in http_methods:  # one route per method: distinct OpenAPI operation ids
            app.add_api_route(path, route, methods=[m], name=method, operation_id=f"{method}_{m.lower()}")
