"""Pydantic models of the OpenAI-compatible API and SGLang's native /generate.

Requests are validated in strict JSON mode (`Model.model_validate_json(body)`):
a string where a number belongs, or a field the API does not know, is a 422;
value checks (ranges, limits that depend on the server) live in the serving
modules and answer 400. The fields the official `openai` client sends through
`extra_body` for SGLang/vLLM (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, ...) are declared, so they pass; anything else unknown is refused.
OpenAI fields this server accepts but does not act on (store, metadata,
service_tier, ...) are declared as ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Lenient(BaseModel):
    # For nested objects clients echo back from earlier responses (assistant
    # messages carry refusal/audio/annotations...): unknown keys are dropped.
    model_config = ConfigDict(strict=True, extra="ignore")


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------- shared pieces


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingExtras(_Strict):
    """SGLang/vLLM sampling extensions that clients send via `extra_body`."""

    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    rid: str | None = None
    # structured outputs, as SGLang's OpenAI routes take them (at most one, and not with a
    # response_format that constrains): a JSON Schema (object or its text), a regex, an EBNF grammar
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None


class CommonOpenAIFields(SamplingExtras):
    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # accepted and ignored (no effect on a local server)
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # sglang-router's additions: PD mode's bootstrap fields (docs/disaggregation.md) and a switch it
    # always sends (no hidden states here: refused by name when true)
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    return_hidden_states: bool | None = None
    # SGLang's priority (an extra body field; with --enable-priority-scheduling; ignored without it)
    priority: int | None = None
    # SGLang's lora_path (an extra body field): the adapter by name; `model` = BASE:ADAPTER says the same
    lora_path: str | None = None


# ---------------------------------------------------------------- chat requests


class TextContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(CommonOpenAIFields):
    messages: list[ChatMessage]
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    # chat-template controls (SGLang/vLLM extensions)
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    # SGLang's reasoning switches (sglang-router sends them on): no reasoning parser here, so
    # reasoning stays in the content either way
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None


# ---------------------------------------------------------------- completion requests


class CompletionRequest(CommonOpenAIFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None


# ---------------------------------------------------------------- native /generate


class GenerateReqInput(_Strict):
    """SGLang's /generate body: `text` or `input_ids` (one or a batch)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool | None = False
    return_logprob: bool | None = False
    top_logprobs_num: int | None = 0
    logprob_start_len: int | None = -1
    return_text_in_logprobs: bool | None = False
    rid: str | None = None
    # Sent by sglang-router (which re-serialises bodies with SGLang's defaults) and SGLang's
    # clients: logging switches and the model name have no effect here; the features below
    # (OFF_ONLY_FIELDS) are accepted while off and refused by name when asked for.
    model: str | None = None
    log_metrics: bool | None = None
    no_logs: bool | None = None
    return_hidden_states: bool | None = None
    background: bool | None = None
    return_bytes: bool | None = None
    return_entropy: bool | None = None
    # PD mode (docs/disaggregation.md): one value, or one per prompt of a batch
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None
    # priority scheduling (--enable-priority-scheduling): one value, or one per prompt of a batch
    priority: int | list[int] | None = None
    # multi-LoRA (--enable-lora): the adapter by name, one for all prompts or one per prompt (None: base)
    lora_path: str | list[str | None] | None = None


# Request fields of features this server does not have: accepted while false or null (as
# sglang-router and SGLang's clients send them), a 400 naming the field when true.
OFF_ONLY_FIELDS = ("return_hidden_states", "background", "return_bytes", "return_entropy")


class AbortReqInput(_Strict):
    rid: str = ""
    abort_all: bool = False


# ---------------------------------------------------------------- responses


class PromptTokensDetails(_Out):
    cached_tokens: int = 0


class UsageInfo(_Out):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Out):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(_Out):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class ChatResponseMessage(_Out):
    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionChoice(_Out):
    index: int
    message: ChatResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(_Out):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionStreamChoice(_Out):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "workbench"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
