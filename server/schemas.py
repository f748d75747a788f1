"""OpenAI request and response bodies (pydantic). Unknown fields are accepted and ignored, as OpenAI does."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 8
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # a stop string is held back, so each token's check costs its length


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class FunctionCall(_Lenient):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCall(_Lenient):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Lenient):
    include_usage: bool = False


class JSONSchemaFormat(_Lenient):
    name: str = "response"
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDef(_Lenient):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: dict  # {"name": ...}


class _Strict(BaseModel):
    """Top-level request bodies: an unknown field is a 400 that names it (as OpenAI does)."""

    model_config = ConfigDict(extra="forbid")


class _SamplingFields(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    regex: str | None = None  # SGLang's extras: constrain the output to a regex or an EBNF grammar
    ebnf: str | None = None
    return_spec_metrics: bool = False  # the response carries `spec_metrics`: this request's speculation figures
    # OpenAI fields accepted and ignored: they do not change the output (README: "Accepted and ignored")
    user: str | None = None
    store: bool | None = None
    metadata: dict | None = None
    service_tier: str | None = None
    prediction: dict | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if v is None:
            return []
        items = [v] if isinstance(v, str) else v
        if len(items) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in items):
            raise ValueError(
                f"stop must be at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters"
            )
        return items


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None  # accepted and ignored (text only)
    reasoning_effort: str | None = None  # accepted and ignored (no reasoning model here)
    verbosity: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
