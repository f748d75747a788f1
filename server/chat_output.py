"""Parsed output in OpenAI's chat shapes: a choice's message, its stream deltas, and reasoning token counts."""

from __future__ import annotations

from .parsers.base import Delta
from .parsers.registry import OutputParser


def parse_whole(text: str, parser: OutputParser | None) -> Delta:
    return parser.parse(text) if parser is not None else Delta(content=text)


def chat_message(d: Delta, reasoning: bool) -> dict:
    """The assistant message; `reasoning`: a reasoning parser is set, so the message has `reasoning_content`."""
    message = {"role": "assistant", "content": d.content or (None if d.calls or d.reasoning else "")}
    if reasoning:
        message["reasoning_content"] = d.reasoning or None
    if d.calls:
        message["tool_calls"] = [c.as_openai() for c in d.calls]
    return message


def finish_reason(finish: str, called: bool) -> str:
    return "tool_calls" if called and finish == "stop" else finish


def chat_deltas(d: Delta, calls_before: int) -> list[dict]:
    """The stream deltas of one parsed piece: reasoning, content, then each call as OpenAI's tool-call deltas (index,
    id and name, then the arguments). `calls_before`: the choice's calls already sent (the next call's index)."""
    out = []
    if d.reasoning:
        out.append({"reasoning_content": d.reasoning})
    if d.content:
        out.append({"content": d.content})
    for k, c in enumerate(d.calls, calls_before):
        head = {"index": k, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}
        out.append({"tool_calls": [head]})
        out.append({"tool_calls": [{"index": k, "function": {"arguments": c.arguments}}]})
    return out


def reasoning_tokens(tokenizer, text: str) -> int:
    """Tokens of reasoning, counted by encoding its text again (the output's own split is not kept per piece)."""
    return len(tokenizer.encode(text, add_special_tokens=False)) if text else 0
