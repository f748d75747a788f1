"""JSON schemas that sit at the grammar limits."""

from __future__ import annotations

import json


def nested_schema(levels: int) -> str:
    """A JSON schema of objects nested `levels` deep."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return json.dumps(schema)


def slow_schema() -> dict:
    """Within every grammar limit, and about 10 s of xgrammar compiling on one core for SmolLM2's vocabulary: 600
    properties, each with its own bounded pattern."""
    props = {f"p{i}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1},{i % 7 + 9}}}x{i}"} for i in range(600)}
    return {"type": "object", "properties": props, "required": list(props)}
