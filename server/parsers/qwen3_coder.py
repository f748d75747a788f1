"""Qwen3-Coder calls (SGLang's `qwen3_coder`): XML functions and parameters inside `<tool_call>`.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value loses one newline at each end; it is a string where the tool's schema says string, else decoded as JSON.
A parameter whose `</parameter>` is missing ends at the next parameter or at `</function>`, as SGLang reads it.
"""

from __future__ import annotations

import json
import re

from .base import BlockCalls, ParsedCall, make_call, typed_value

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


class Qwen3CoderCalls(BlockCalls):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    GRAMMAR = "qwen_3_coder"
    MARKERS = (OPEN, CLOSE)

    def parse_block(self, body: str, closed: bool) -> list[ParsedCall] | None:
        functions = _FUNCTION.findall(body)
        if not closed or not functions or _FUNCTION.sub("", body).strip():
            return None
        calls = []
        for name, inner in functions:
            name = name.strip()
            if name not in self.tools or _PARAMETER.sub("", inner).strip():
                return None
            properties = (self.tools[name] or {}).get("properties") or {}
            args = {}
            for key, value in _PARAMETER.findall(inner):
                value = value.removeprefix("\n").removesuffix("\n")
                args[key.strip()] = typed_value(value, properties.get(key.strip()))
            calls.append(make_call(name, args))
        return calls

    @classmethod
    def render(cls, name: str, arguments: dict) -> str:
        params = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
            for k, v in arguments.items()
        )
        return f"{cls.OPEN}\n<function={name}>\n{params}</function>\n{cls.CLOSE}"
