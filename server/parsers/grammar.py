"""The grammar of a forced call (`tool_choice` "required" or a named function) in a parser's format.

xgrammar ships a structural tag for each of these formats (the tags, the tools' JSON schemas as arguments or as XML
values, and a leading reasoning block); it is compiled here and handed to rank 0 as EBNF, where the size and repeat
limits of every grammar apply. Each tool's schema is checked against the nesting limits first, by name.
"""

from __future__ import annotations

import json

from worker.sampling.grammar import check_grammar
from worker.sampling.params import GrammarSpec, InvalidGrammarError

from .base import BlockCalls

MAX_WHITESPACE = 2  # runs of whitespace inside arguments: a small model under a grammar can pad without end


def forced_call_grammar(
    fmt: type[BlockCalls], tools: list[dict], named: str | None, parallel: bool, reasoning: bool
) -> GrammarSpec:
    """`tools` in OpenAI's shape; `named`: the one function to call, else at least one call of any (several only
    with `parallel`); `reasoning`: the output starts inside a reasoning block, which it closes before the call."""
    import xgrammar as xgr

    for tool in tools:
        schema = tool["function"].get("parameters") or {"type": "object"}
        check_grammar(GrammarSpec("json_schema", json.dumps(schema), param="tools"))
    choice = {"type": "function", "function": {"name": named}} if named else "required"
    try:
        tag = xgr.get_model_structural_tag(
            fmt.GRAMMAR,
            tools=tools,
            tool_choice=choice,
            reasoning="enabled" if reasoning else "disabled",
            max_whitespace_cnt=MAX_WHITESPACE,
            parallel_tool_calls=parallel and not named,
        )
        ebnf = str(xgr.Grammar.from_structural_tag(tag))
    except (ValueError, RuntimeError) as e:
        raise InvalidGrammarError("tools", f"no call grammar for these tools: {e}") from e
    return GrammarSpec("ebnf", ebnf, param="tools")
