"""DeepSeek-V3.1 calls (SGLang's `deepseekv31`): DeepSeek-V3's section, each call a name and its bare JSON arguments.

<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>
<｜tool▁calls▁end｜>  (one line in the output)
"""

from __future__ import annotations

import json

from .base import ParsedCall, json_object
from .deepseekv3 import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP, DeepSeekV3Calls, section_calls


class DeepSeekV31Calls(DeepSeekV3Calls):
    GRAMMAR = "deepseek_v3_1"

    def parse_block(self, body: str, closed: bool) -> list[ParsedCall] | None:
        return section_calls(body, self._named_call, self.tools)

    @staticmethod
    def _named_call(text: str) -> tuple[str, dict | None] | None:
        name, sep, args = text.partition(SEP)
        return (name.strip(), json_object(args)) if sep else None

    @classmethod
    def render(cls, name: str, arguments: dict) -> str:
        args = json.dumps(arguments, ensure_ascii=False)
        return f"{CALLS_BEGIN}{CALL_BEGIN}{name}{SEP}{args}{CALL_END}{CALLS_END}"
