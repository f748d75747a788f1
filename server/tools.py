"""Tool calls: rendering tools into the prompt and the grammar that forces a call (`server/parsers/` reads them back).

Templates that know tools render them; others get a system message asking for `<tool_call>{json}</tool_call>`, or for
the `--tool-call-parser` format when one is set. "required" or a named function constrains output to one call
matching the schemas (several only with `parallel_tool_calls`: small models repeat calls); "auto" leaves it free.
"""

from __future__ import annotations

import json

from worker.sampling.params import GrammarSpec, InvalidGrammarError

from .errors import APIError
from .parsers.base import BlockCalls
from .parsers.grammar import forced_call_grammar
from .schemas import ChatCompletionRequest, ChatMessage, Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"


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


def tool_schemas(req: ChatCompletionRequest) -> dict[str, dict]:
    """Each tool's name and parameters schema, for the parsers."""
    return {t.function.name: t.function.parameters for t in req.tools or ()}


def render_messages(
    req: ChatCompletionRequest, mode: str, native: bool, fmt: type[BlockCalls] | None = None
) -> tuple[list[dict], list[dict] | None]:
    """Messages for the chat template, and the `tools` argument when the template renders tools itself. `fmt`: the
    `--tool-call-parser` format, in which templates without tools see calls (else the built-in JSON)."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()] if mode != "none" else []
    if native:
        return [_native_message(m) for m in req.messages], tools or None
    messages = [_builtin_message(m, fmt) for m in req.messages]
    if tools:
        system = _tools_system_prompt(req.tools, mode, req, fmt)
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


def _builtin_message(m: ChatMessage, fmt: type[BlockCalls] | None) -> dict:
    if m.role == "tool":
        name = f' name="{m.name}"' if m.name else ""
        return {"role": "user", "content": f"<tool_response{name}>\n{m.text()}\n</tool_response>"}
    text = m.text()
    if m.tool_calls:
        calls = "\n".join(_render_call(c.function.name, _loads(c.function.arguments), fmt) for c in m.tool_calls)
        text = f"{text}\n{calls}" if text else calls
    return {"role": _role(m), "content": text}


def _loads(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _render_call(name: str, arguments, fmt: type[BlockCalls] | None) -> str:
    if fmt is None or not isinstance(arguments, dict):
        return OPEN + json.dumps({"name": name, "arguments": arguments}) + CLOSE
    return fmt.render(name, arguments)


def _tools_system_prompt(tools: list[Tool], mode: str, req: ChatCompletionRequest, fmt: type[BlockCalls] | None) -> str:
    listing = "\n".join(json.dumps(t.function.model_dump(exclude_none=True)) for t in tools)
    if mode == "named":
        ask = f"Call the function {req.tool_choice.function['name']}."
    elif mode == "required":
        ask = "Call one or more of these functions."
    else:
        ask = "Call a function only when it helps; otherwise answer normally."
    if fmt is None:
        how = f'{OPEN}{{"name": <function name>, "arguments": <arguments as a JSON object>}}{CLOSE}'
    else:  # an example call of the first function, in the parser's format
        first = tools[0].function
        how = fmt.render(first.name, {k: "..." for k in list((first.parameters or {}).get("properties") or {})[:2]})
    return f"You can call functions. {ask} To call one, write\n{how}\nFunctions:\n{listing}"


def call_grammar(
    req: ChatCompletionRequest, mode: str, fmt: type[BlockCalls] | None = None, reasoning: bool = False
) -> GrammarSpec | None:
    """For "required" and a named function: the output must be calls that match the tools' schemas, as bare JSON,
    or in `fmt`'s format (after the reasoning block, when the output starts inside one)."""
    if mode not in ("required", "named"):
        return None
    parallel = mode == "required" and req.parallel_tool_calls is True  # explicit: small models repeat calls
    if fmt is not None:
        named = req.tool_choice.function["name"] if mode == "named" else None
        try:
            tools = [t.model_dump(exclude_none=True) for t in req.tools]
            return forced_call_grammar(fmt, tools, named, parallel, reasoning)
        except InvalidGrammarError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_grammar") from e
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
    schema = {"type": "array", "items": one, "minItems": 1} if parallel else one
    return GrammarSpec("json_schema", json.dumps(schema), param="tools")
