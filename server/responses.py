"""OpenAI's Responses API, stateless: a request becomes a chat request, and its output becomes response items.

Supports string or message-item input (with function-call items), `instructions`, `max_output_tokens`, sampling,
function tools, `text.format`, SGLang's `regex` and `ebnf`, and streaming; with a reasoning parser, reasoning is an
item of its own. Nothing is stored, so `previous_response_id` and `background` are refused with a 400 that says so.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import Discriminator, Field, Tag, TypeAdapter, ValidationError, field_validator

from .errors import APIError
from .parsers.base import Delta, ParsedCall
from .schemas import ChatCompletionRequest, _Lenient, _Strict, now


class ResponseTool(_Lenient):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Lenient):
    format: TextFormat | None = None


class InputText(_Lenient):
    type: Literal["input_text", "output_text", "text"] = "input_text"
    text: str


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"] = "user"
    content: str | list[InputText]


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str = ""
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str
    output: str | dict | list


def _item_kind(item) -> str:
    """An item without a `type` is a message (OpenAI's easy input); an unknown type matches no tag (a 400)."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(
        _item_kind,
        custom_error_type="invalid_item",
        custom_error_message="an item's type is message, function_call or function_call_output",
    ),
]
_ITEMS = TypeAdapter(list[InputItem])
_TAGS = {"message", "function_call", "function_call_output"}
_TYPES = {"str", "dict", "list"}  # union members in a validation error's location


class ResponsesRequest(_Strict):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    regex: str | None = None  # SGLang's extras, as on chat completions
    ebnf: str | None = None
    stream: bool = False
    previous_response_id: str | None = None
    background: bool | None = None
    # accepted and ignored: they do not change the output
    store: bool | None = None
    metadata: dict | None = None
    user: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    reasoning: dict | None = None
    include: list[str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    stream_options: dict | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, v):
        """Items are checked one by one, so a bad one is named (`input[2].content[0].text: ...`), never a 500."""
        if isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError("input is a string or a list of items")
        try:
            return _ITEMS.validate_python(v)
        except ValidationError as e:
            err = max(e.errors(), key=lambda x: len(x["loc"]))  # the deepest: the field that is wrong
            loc = [x for x in err["loc"] if not (isinstance(x, str) and (x in _TAGS or x in _TYPES or "[" in x))]
            where = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc)
            raise ValueError(f"input{where}: {err['msg']}") from None


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    if req.previous_response_id:
        raise APIError(
            400,
            "this server keeps no responses (stateless): resend the conversation as input",
            param="previous_response_id",
        )
    if req.background:
        raise APIError(400, "background responses are not supported (stateless)", param="background")
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += [{"role": "user", "content": req.input}] if isinstance(req.input, str) else _messages(req.input)
    body = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls,
        "regex": req.regex,
        "ebnf": req.ebnf,
    }
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})} for t in req.tools
        ]
    choice = req.tool_choice
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    body["tool_choice"] = choice
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_ or {}},
        }
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValueError as e:
        raise APIError(400, f"input: {e}", param="input") from e


def _messages(items: list[MessageItem | FunctionCallItem | FunctionCallOutputItem]) -> list[dict]:
    out: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            text = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            out.append({"role": item.role, "content": text})
        elif isinstance(item, FunctionCallItem):
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            output = item.output if isinstance(item.output, str) else json.dumps(item.output)
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    return out


@dataclass
class ResponseBuilder:
    """The response object and its items, for the plain body and for the stream's events."""

    req: ResponsesRequest
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=now)
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    reasoning_id: str = field(default_factory=lambda: f"rs_{uuid.uuid4().hex}")

    def message_item(self, text: str, status: str = "completed") -> dict:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status else []
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status, "content": content}

    def reasoning_item(self, text: str, status: str = "completed") -> dict:
        content = [{"type": "reasoning_text", "text": text}]
        return {"id": self.reasoning_id, "type": "reasoning", "summary": [], "content": content, "status": status}

    @staticmethod
    def call_item(call: ParsedCall, arguments: str | None = None, status: str = "completed") -> dict:
        return {
            "id": f"fc_{call.id.removeprefix('call_')}",
            "type": "function_call",
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments if arguments is None else arguments,
            "status": status,
        }

    def items(self, d: Delta) -> list[dict]:
        """Reasoning, the message and the calls of a parsed output, each where there is one."""
        out = [self.reasoning_item(d.reasoning)] if d.reasoning else []
        out += [self.message_item(d.content)] if d.content else []
        return out + [self.call_item(c) for c in d.calls]

    def response(
        self,
        status: str,
        output: list[dict],
        finish: str | None = None,
        usage: tuple[int, int, int] | None = None,
        cached: int = 0,
    ) -> dict:
        """`usage`: input, output and reasoning tokens."""
        r = self.req
        fmt = r.text.format.model_dump(by_alias=True, exclude_none=True) if r.text and r.text.format else None
        body = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": r.model,
            "output": output,
            "error": None,
            "instructions": r.instructions,
            "incomplete_details": None,
            "max_output_tokens": r.max_output_tokens,
            "metadata": r.metadata or {},
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "tool_choice": r.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or ()],
            "text": {"format": fmt or {"type": "text"}},
            "usage": None,
        }
        if finish == "length":
            body["status"] = "incomplete"
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if usage is not None:
            body["usage"] = {
                "input_tokens": usage[0],
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": usage[1],
                "output_tokens_details": {"reasoning_tokens": usage[2]},
                "total_tokens": usage[0] + usage[1],
            }
        return body
