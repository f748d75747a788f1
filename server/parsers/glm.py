"""GLM-4.5/4.6/4.7 calls (SGLang's `glm45`, `glm47`, `glm`): the function name, then key/value pairs as XML.

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

GLM-4.7 writes the same without the newlines. A value is the text between its tags: a string where the tool's schema
says string, else decoded as JSON (numbers, objects, arrays).
"""

from __future__ import annotations

import json
import re

from .base import BlockCalls, ParsedCall, make_call, typed_value

_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class GlmCalls(BlockCalls):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    MARKERS = (OPEN, CLOSE, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
    GRAMMAR = "glm_4_7"  # xgrammar's GLM XML allows whitespace between the parts, which covers GLM-4.5's newlines

    def parse_block(self, body: str, closed: bool) -> list[ParsedCall] | None:
        if not closed:
            return None  # a cut-off call may have lost arguments
        name, _, rest = body.partition("<arg_key>")
        name, rest = name.strip(), "<arg_key>" + rest if rest else ""
        if name not in self.tools or _PAIR.sub("", rest).strip():
            return None
        properties = (self.tools[name] or {}).get("properties") or {}
        args = {k.strip(): typed_value(v, properties.get(k.strip())) for k, v in _PAIR.findall(rest)}
        return [make_call(name, args)]

    @classmethod
    def render(cls, name: str, arguments: dict) -> str:
        pairs = "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
            "</arg_value>\n"
            for k, v in arguments.items()
        )
        return f"{cls.OPEN}{name}\n{pairs}{cls.CLOSE}"
