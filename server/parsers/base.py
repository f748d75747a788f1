"""What the output parsers share: the parsed call, a stream's delta, marker scanning, edge whitespace, and the machine
that splits content from call blocks.

A parser is fed text as it is detokenized and returns only what is final. Text that could still grow into a marker
is held back, so a partial tag (`<tool_ca`) never reaches content, and a call is sent once its block has closed and
parsed, so a stream never shows a call that the one-shot parse would not. The one-shot parse is the same machine fed
the whole text at once: both give the same result whatever the chunking.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field

log = logging.getLogger("eaglegate.parsers")


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text

    def as_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index} | out


def make_call(name: str, arguments: dict) -> ParsedCall:
    return ParsedCall(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments, ensure_ascii=False))


@dataclass
class Delta:
    """What a piece of output adds: reasoning text, content text, and whole calls, in that order."""

    reasoning: str = ""
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)

    def __add__(self, other: Delta) -> Delta:
        return Delta(self.reasoning + other.reasoning, self.content + other.content, self.calls + other.calls)


def find_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    """The first marker in `text` and where it starts. Markers hold `<` only as their first character, so one that
    is complete cannot hide inside another that is still partial."""
    hits = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(hits) if hits else None


def partial_tail(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that begins a marker: it is held back, since it may grow into one."""
    for k in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0


class Spacing:
    """Whitespace at the edges of a span: leading whitespace is dropped while `lstrip` is set; trailing whitespace is
    held until more text comes, then released (`flush`) or dropped (`drop`) by what comes next."""

    def __init__(self, lstrip: bool):
        self.lstrip, self.held = lstrip, ""

    def add(self, text: str) -> str:
        if self.lstrip:
            text = text.lstrip()
            if not text:
                return ""
            self.lstrip = False
        body = text.rstrip()
        if not body:
            self.held += text
            return ""
        out, self.held = self.held + body, text[len(body) :]
        return out

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out

    def drop(self) -> None:
        self.held, self.lstrip = "", True


class BlockCalls:
    """Content with call blocks in it (`OPEN` body `CLOSE`); a format parses a block's body into calls.

    A block that does not parse (bad JSON, an unknown function, a cut-off XML call) stays in content as it was
    written. Content is the text around the calls, without leading whitespace, and without trailing whitespace when
    there are calls (as the built-in parser always wrote it)."""

    OPEN: str
    CLOSE: str
    GRAMMAR: str  # xgrammar's built-in structural tag for the format (forced calls)
    MARKERS: tuple[str, ...] = ()  # its tags, which the detokenizer keeps where a tokenizer marks them special

    def __init__(self, tools: dict[str, dict]):
        self.tools = tools  # function name -> its parameters schema
        self.buf, self.in_block, self.called = "", False, False
        self.text = Spacing(lstrip=True)

    def parse_block(self, body: str, closed: bool) -> list[ParsedCall] | None:
        """The calls of one block, or None when it is not a valid call block. `closed` is False for a block the
        output ended inside."""
        raise NotImplementedError

    @classmethod
    def render(cls, name: str, arguments: dict) -> str:
        """One call written in the format (for tool calls in the history, and the built-in tools prompt)."""
        raise NotImplementedError

    def feed(self, text: str) -> Delta:
        self.buf += text
        out = Delta()
        while True:
            if self.in_block:
                end = self.buf.find(self.CLOSE)
                if end < 0:
                    return out
                body, self.buf, self.in_block = self.buf[:end], self.buf[end + len(self.CLOSE) :], False
                out += self._block(body, closed=True)
                continue
            start = self.buf.find(self.OPEN)
            if start < 0:
                safe = len(self.buf) - partial_tail(self.buf, (self.OPEN,))
                out.content += self.text.add(self.buf[:safe])
                self.buf = self.buf[safe:]
                return out
            out.content += self.text.add(self.buf[:start])
            self.buf, self.in_block = self.buf[start + len(self.OPEN) :], True

    def parse(self, text: str) -> Delta:
        """A whole output: the same as feeding it in any pieces, then finishing."""
        return self.feed(text) + self.finish()

    def finish(self) -> Delta:
        out = self._block(self.buf, closed=False) if self.in_block else Delta(content=self.text.add(self.buf))
        self.buf, self.in_block = "", False
        trailing = self.text.flush()
        out.content += "" if self.called else trailing
        return out

    def _block(self, body: str, closed: bool) -> Delta:
        try:
            calls = self.parse_block(body, closed)
        except (ValueError, TypeError, AttributeError) as e:  # malformed output is content, never a 500
            log.debug("tool-call block not parsed: %s", e)
            calls = None
        if calls:
            self.called = True
            return Delta(calls=calls)
        return Delta(content=self.text.add(self.OPEN + body + (self.CLOSE if closed else "")))


def json_object(text: str) -> dict | None:
    """A JSON object from text (arguments), or None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}


def schema_types(schema) -> set[str]:
    """The JSON types a property's schema allows (from `type`, `enum`, `const`, `anyOf`, `oneOf`); empty: unknown."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    types = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    values = [schema["const"]] if "const" in schema else schema.get("enum") or []
    types |= {_JSON_TYPES.get(type(v), "null") for v in values}
    for branch in schema.get("anyOf", []) + schema.get("oneOf", []):
        types |= schema_types(branch)
    return types


def typed_value(raw: str, schema) -> object:
    """An argument written as bare text (GLM, Qwen3-Coder): a string where the property's schema says string, else
    its JSON value (a number, an object, ...), as SGLang decodes them; text that is not JSON stays a string."""
    types = schema_types(schema)
    if types == {"string"}:
        return raw
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    kind = "null" if value is None else _JSON_TYPES[type(value)]
    if "string" in types and kind not in types and not (kind == "integer" and "number" in types):
        return raw  # "007" for a string-or-null property stays "007"
    return value
