"""Calls as JSON objects: Qwen2.5/Qwen3's Hermes-style `<tool_call>{"name": .., "arguments": ..}</tool_call>` (SGLang's
`qwen25`, `qwen`; also the built-in format for templates that know no tools), and the whole output as one JSON call or
an array of calls (the built-in format of a forced call, whose grammar is a JSON schema)."""

from __future__ import annotations

import json

from .base import BlockCalls, Delta, ParsedCall, json_object, make_call


def json_calls(value, tools: dict[str, dict]) -> list[ParsedCall] | None:
    """Calls from a decoded JSON object or array of them; None unless every one names a known function and has
    object arguments (`arguments`, or `parameters` as some models write; a JSON string of an object too)."""
    calls = []
    for item in value if isinstance(value, list) else [value]:
        if not isinstance(item, dict) or item.get("name") not in tools:
            return None
        args = item.get("arguments", item.get("parameters", {}))
        args = json_object(args) if isinstance(args, str) else args
        if not isinstance(args, dict):
            return None
        calls.append(make_call(item["name"], args))
    return calls or None


class HermesCalls(BlockCalls):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    GRAMMAR = "qwen_3"
    MARKERS = (OPEN, CLOSE)

    def parse_block(self, body: str, closed: bool) -> list[ParsedCall] | None:
        return json_calls(json.loads(body), self.tools)  # an unclosed block whose JSON is whole is a call

    @classmethod
    def render(cls, name: str, arguments: dict) -> str:
        call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{cls.OPEN}\n{call}\n{cls.CLOSE}"


class WholeJsonCalls:
    """The output is nothing but calls: held until it ends, then parsed; a cut-off one is content."""

    def __init__(self, tools: dict[str, dict]):
        self.tools, self.buf = tools, ""

    def feed(self, text: str) -> Delta:
        self.buf += text
        return Delta()

    def parse(self, text: str) -> Delta:
        return self.feed(text) + self.finish()

    def finish(self) -> Delta:
        text, self.buf = self.buf, ""
        try:
            calls = json_calls(json.loads(text), self.tools)
        except ValueError:
            calls = None
        return Delta(calls=calls) if calls else Delta(content=text)
