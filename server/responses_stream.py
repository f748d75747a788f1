"""The Responses API's stream events for one output: a reasoning item, a message item and function-call items, each
opened when its first piece is final (through the output parser, where there is one) and closed at the end."""

from __future__ import annotations

from collections.abc import Callable

from .generation import ChoiceSet
from .parsers.base import Delta
from .parsers.registry import OutputParser
from .responses import ResponseBuilder


async def responses_stream(
    build: ResponseBuilder,
    choices: ChoiceSet,
    prompt_tokens: int,
    parser: OutputParser | None,
    count_reasoning: Callable[[str], int],
):
    seq = iter(range(1 << 30))
    items: dict[str, int] = {}  # "reasoning" / "message" -> output index, while open
    output: dict[int, dict] = {}  # finished items by output index
    text = {"reasoning": "", "message": ""}

    def event(kind: str, **fields) -> dict:
        return {"type": kind, "sequence_number": next(seq), **fields}

    def index() -> int:
        return len(output) + len(items)

    def close(kind: str):
        k = items.pop(kind, None)
        if k is None:
            return
        if kind == "reasoning":
            done = build.reasoning_item(text[kind])
            yield event("response.reasoning_text.done", item_id=build.reasoning_id, output_index=k, content_index=0,
                        text=text[kind])  # fmt: skip
        else:
            done = build.message_item(text[kind])
            where = {"item_id": build.message_id, "output_index": k, "content_index": 0}
            yield event("response.output_text.done", **where, text=text[kind], logprobs=[])
            yield event("response.content_part.done", **where, part=done["content"][0])
        output[k] = done
        yield event("response.output_item.done", output_index=k, item=done)

    def pieces(d: Delta):
        if d.reasoning:
            if "reasoning" not in items:
                items["reasoning"] = index()
                added = build.reasoning_item("", "in_progress")
                yield event("response.output_item.added", output_index=items["reasoning"], item=added)
            text["reasoning"] += d.reasoning
            yield event("response.reasoning_text.delta", item_id=build.reasoning_id,
                        output_index=items["reasoning"], content_index=0, delta=d.reasoning)  # fmt: skip
        if d.content or d.calls:
            yield from close("reasoning")  # reasoning comes first: it is over
        if d.content:
            if "message" not in items:
                k = items["message"] = index()
                yield event("response.output_item.added", output_index=k, item=build.message_item("", "in_progress"))
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                yield event("response.content_part.added", item_id=build.message_id, output_index=k, content_index=0,
                            part=part)  # fmt: skip
            text["message"] += d.content
            yield event("response.output_text.delta", item_id=build.message_id, output_index=items["message"],
                        content_index=0, delta=d.content, logprobs=[])  # fmt: skip
        for call in d.calls:
            k = index()
            added = build.call_item(call, arguments="", status="in_progress")
            yield event("response.output_item.added", output_index=k, item=added)
            yield event("response.function_call_arguments.delta", item_id=added["id"], output_index=k,
                        delta=call.arguments)  # fmt: skip
            yield event("response.function_call_arguments.done", item_id=added["id"], output_index=k,
                        arguments=call.arguments)  # fmt: skip
            output[k] = build.call_item(call)
            yield event("response.output_item.done", output_index=k, item=output[k])

    yield event("response.created", response=build.response("in_progress", []))
    yield event("response.in_progress", response=build.response("in_progress", []))
    finish, completion = None, 0
    async for ev in choices.events():
        completion, finish = ev.completion_tokens, ev.finish_reason or finish
        d = parser.feed(ev.text) if parser else Delta(content=ev.text)
        if ev.finish_reason is not None and parser:
            d += parser.finish()
        for e in pieces(d):
            yield e
    for kind in ("reasoning", "message"):
        for e in close(kind):
            yield e
    # status says "incomplete" when max_output_tokens cut it; the SDK's stream helper waits for this event either way
    usage = (prompt_tokens, completion, count_reasoning(text["reasoning"]))
    final = [output[k] for k in sorted(output)]
    response = build.response("completed", final, finish, usage, choices.cached_tokens(1))
    yield event("response.completed", response=response)
