"""Tool calls: rendering tools into the prompt, the grammar that forces a call, and parsing calls from output.

Templates that know tools render them; others get a system message asking for `<tool_call>{json}</tool_call>`.
"required" or a named function constrains output to one call matching the schemas (an array only with
`parallel_tool_calls`: small models repeat calls); "auto" leaves it free.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from worker.sampling.params import GrammarSpec

from .errors import APIError
from .schemas import ChatCompletionRequest, ChatMessage, Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text

    def as_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index} | out


def tool_mode(req: ChatCompletionRequest) -> str:
    """ "none" (tools ignored), "auto", "required" or "named"."""
    if not req.tools:
        if req.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return "none"
    choice = req.tool_choice or "auto"
    if isinstance(choice, str):
        return choice
    name = choice.function.get("name")
    if name not in {t.function.name for t in req.tools}:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return "named"


def template_knows_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template


def render_messages(req: ChatCompletionRequest, mode: str, native: bool) -> tuple[list[dict], list[dict] | None]:
    """Messages for the chat template, and the `tools` argument when the template renders tools itself."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()] if mode != "none" else []
    if native:
        return [_native_message(m) for m in req.messages], tools or None
    messages = [_builtin_message(m) for m in req.messages]
    if tools:
        system = _tools_system_prompt(req.tools, mode, req)
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + system}
        else:
            messages.insert(0, {"role": "system", "content": system})
    return messages, None


def _role(m: ChatMessage) -> str:
    return "system" if m.role == "developer" else m.role


def _native_message(m: ChatMessage) -> dict:
    out = {"role": _role(m), "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": _loads(c.function.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def _builtin_message(m: ChatMessage) -> dict:
    if m.role == "tool":
        name = f' name="{m.name}"' if m.name else ""
        return {"role": "user", "content": f"<tool_response{name}>\n{m.text()}\n</tool_response>"}
    text = m.text()
    if m.tool_calls:
        calls = "\n".join(
            OPEN + json.dumps({"name": c.function.name, "arguments": _loads(c.function.arguments)}) + CLOSE
            for c in m.tool_calls
        )
        text = f"{text}\n{calls}" if text else calls
    return {"role": _role(m), "content": text}


def _loads(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _tools_system_prompt(tools: list[Tool], mode: str, req: ChatCompletionRequest) -> str:
    listing = "\n".join(json.dumps(t.function.model_dump(exclude_none=True)) for t in tools)
    if mode == "named":
        ask = f"Call the function {req.tool_choice.function['name']}."
    elif mode == "required":
        ask = "Call one or more of these functions."
    else:
        ask = "Call a function only when it helps; otherwise answer normally."
    return (
        f'You can call functions. {ask} To call one, write\n{OPEN}{{"name": <function name>, '
        f'"arguments": <arguments as a JSON object>}}{CLOSE}\nFunctions:\n{listing}'
    )


def call_grammar(req: ChatCompletionRequest, mode: str) -> GrammarSpec | None:
    """For "required" and a named function: the output must be JSON calls that match the tools' schemas."""
    if mode not in ("required", "named"):
        return None
    tools = req.tools or []
    if mode == "named":
        tools = [t for t in tools if t.function.name == req.tool_choice.function["name"]]
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "arguments": t.function.parameters or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    one = options[0] if len(options) == 1 else {"anyOf": options}
    parallel = mode == "required" and req.parallel_tool_calls is True  # explicit: small models repeat calls
    schema = {"type": "array", "items": one, "minItems": 1} if parallel else one
    return GrammarSpec("json_schema", json.dumps(schema), param="tools")


def parse_calls(text: str, mode: str, req: ChatCompletionRequest) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) from a finished output. Constrained modes parse the whole output as JSON calls."""
    known = {t.function.name for t in req.tools or ()}
    if mode in ("required", "named"):
        try:
            value = json.loads(text)
        except ValueError:  # cut off by max_tokens: no call
            return text, []
        items = value if isinstance(value, list) else [value]
        return None, [_call(item) for item in items if isinstance(item, dict) and item.get("name") in known]
    if mode != "auto" or OPEN not in text:
        return text, []
    calls = []
    for block in _BLOCK.findall(text):
        try:
            item = json.loads(block)
        except ValueError:
            continue
        if isinstance(item, dict) and item.get("name") in known:
            calls.append(_call(item))
    if not calls:
        return text, []
    content = _BLOCK.sub("", text).strip()
    return content or None, calls


def _call(item: dict) -> ParsedCall:
    args = item.get("arguments", {})
    return ParsedCall(
        f"call_{uuid.uuid4().hex[:24]}",
        item["name"],
        args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
    )


def held_back(text: str) -> int:
    """How many trailing characters of streamed text could begin a `<tool_call>` block (auto mode holds them)."""
    start = text.find(OPEN)
    if start >= 0:
        return len(text) - start
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0
