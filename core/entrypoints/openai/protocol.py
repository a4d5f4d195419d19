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
from typing import Any, Literal, Optional, Union

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
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class SamplingExtras(_Strict):
    """SGLang/vLLM sampling extensions that clients send via `extra_body`."""

    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = None
    min_tokens: Optional[int] = None
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    no_stop_trim: Optional[bool] = None
    rid: Optional[str] = None
    # structured outputs, as SGLang's OpenAI routes take them (at most one, and not with a
    # response_format that constrains): a JSON Schema (object or its text), a regex, an EBNF grammar
    json_schema: Optional[Union[str, dict[str, Any]]] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None


class CommonOpenAIFields(SamplingExtras):
    model: Optional[str] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    response_format: Optional[dict[str, Any]] = None  # text, json_object, json_schema
    n: Optional[int] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    user: Optional[str] = None
    # accepted and ignored (no effect on a local server)
    store: Optional[bool] = None
    metadata: Optional[dict[str, Any]] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None


# ---------------------------------------------------------------- chat requests


class TextContentPart(_Lenient):
    type: str
    text: Optional[str] = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # a tool message: the call it answers


class ChatCompletionRequest(CommonOpenAIFields):
    messages: list[ChatMessage]
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    modalities: Optional[list[str]] = None
    reasoning_effort: Optional[str] = None
    verbosity: Optional[str] = None
    # chat-template controls (SGLang/vLLM extensions)
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = False
    # SGLang's reasoning switches (sglang-router sends them on): no reasoning parser here, so
    # reasoning stays in the content either way
    separate_reasoning: Optional[bool] = None
    stream_reasoning: Optional[bool] = None
    return_hidden_states: Optional[bool] = None


# ---------------------------------------------------------------- completion requests


class CompletionRequest(CommonOpenAIFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    best_of: Optional[int] = None
    echo: Optional[bool] = False
    logprobs: Optional[int] = None
    max_tokens: Optional[int] = 16
    suffix: Optional[str] = None


# ---------------------------------------------------------------- native /generate


class GenerateReqInput(_Strict):
    """SGLang's /generate body: `text` or `input_ids` (one or a batch)."""

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    stream: Optional[bool] = False
    return_logprob: Optional[bool] = False
    top_logprobs_num: Optional[int] = 0
    logprob_start_len: Optional[int] = -1
    return_text_in_logprobs: Optional[bool] = False
    rid: Optional[str] = None
    # Sent by sglang-router (which re-serialises bodies with SGLang's defaults) and SGLang's
    # clients: logging switches and the model name have no effect here; the features below
    # (OFF_ONLY_FIELDS) are accepted while off and refused by name when asked for.
    model: Optional[str] = None
    log_metrics: Optional[bool] = None
    no_logs: Optional[bool] = None
    return_hidden_states: Optional[bool] = None
    background: Optional[bool] = None
    return_bytes: Optional[bool] = None
    return_entropy: Optional[bool] = None


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
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(_Out):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Out):
    content: Optional[list[ChatTokenLogprob]] = None


class CompletionLogprobs(_Out):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class ChatResponseMessage(_Out):
    role: str = "assistant"
    content: Optional[str] = None
    refusal: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None


class ChatCompletionChoice(_Out):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Optional[Union[int, str]] = None


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None


class DeltaMessage(_Out):
    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None


class ChatCompletionStreamChoice(_Out):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Optional[Union[int, str]] = None


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None
    system_fingerprint: Optional[str] = None


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Optional[Union[int, str]] = None


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None
    system_fingerprint: Optional[str] = None


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "workbench"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
