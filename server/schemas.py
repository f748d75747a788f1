"""OpenAI request and response bodies (pydantic). Unknown fields are accepted and ignored, as OpenAI does."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 8


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Lenient):
    include_usage: bool = False


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
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if v is None:
            return []
        items = [v] if isinstance(v, str) else v
        if len(items) > 16 or any(not s for s in items):
            raise ValueError("stop must be at most 16 non-empty strings")
        return items


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
