"""DeepSeek-V3 calls (SGLang's `deepseekv3`): a section of calls, each a name and a fenced JSON block.

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The section is the block: its calls are sent when it closes (or, when the output ends inside it, if every call in it
is whole), and a section with a malformed call stays in content.
"""

from __future__ import annotations

import json
import re

from .base import BlockCalls, ParsedCall, json_object, make_call

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(CALL_END), re.S)
_FENCED = re.compile(r"function" + re.escape(SEP) + r"([^\n]+)\n```(?:json)?\n(.*)\n```", re.S)


def section_calls(body: str, call, tools: dict[str, dict]) -> list[ParsedCall] | None:
    """Every call of a section, or None if anything but whole calls and whitespace is in it. `call` turns one call's
    text into (name, arguments) or None."""
    if _CALL.sub("", body).strip():
        return None
    calls = []
    for text in _CALL.findall(body):
        parsed = call(text)
        if parsed is None or parsed[0] not in tools or parsed[1] is None:
            return None
        calls.append(make_call(*parsed))
    return calls or None


class DeepSeekV3Calls(BlockCalls):
    OPEN, CLOSE = CALLS_BEGIN, CALLS_END
    MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
    GRAMMAR = "deepseek_r1"  # xgrammar's name for this format (DeepSeek-V3 and R1 share it)

    def parse_block(self, body: str, closed: bool) -> list[ParsedCall] | None:
        return section_calls(body, self._call, self.tools)

    @staticmethod
    def _call(text: str) -> tuple[str, dict | None] | None:
        m = _FENCED.fullmatch(text.strip())
        return (m[1].strip(), json_object(m[2])) if m else None

    @classmethod
    def render(cls, name: str, arguments: dict) -> str:
        args = json.dumps(arguments, ensure_ascii=False)
        return f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}{name}\n```json\n{args}\n```{CALL_END}{CALLS_END}"
