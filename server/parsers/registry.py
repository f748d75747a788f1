"""The parsers by SGLang's names (`--reasoning-parser`, `--tool-call-parser`), and one request's output parser:
reasoning first, then calls in what is left."""

from __future__ import annotations

from dataclasses import dataclass

from .base import BlockCalls, Delta
from .deepseekv3 import DeepSeekV3Calls
from .deepseekv31 import DeepSeekV31Calls
from .glm import GlmCalls
from .hermes import HermesCalls, WholeJsonCalls
from .qwen3_coder import Qwen3CoderCalls
from .reasoning import START, ThinkParser

# name -> whether the output always starts inside the reasoning block (DeepSeek-R1 writes no start tag)
REASONING_PARSERS = {"deepseek-r1": True, "deepseek-v3": False, "glm45": False, "qwen3": False, "qwen3-thinking": True}
TOOL_CALL_PARSERS: dict[str, type[BlockCalls]] = {
    "deepseekv3": DeepSeekV3Calls,
    "deepseekv31": DeepSeekV31Calls,
    "glm": GlmCalls,
    "glm45": GlmCalls,
    "glm47": GlmCalls,
    "qwen": HermesCalls,
    "qwen25": HermesCalls,
    "qwen3_coder": Qwen3CoderCalls,
}


class OutputParser:
    """One choice's output: fed text as it comes, it returns what is final (reasoning, content, whole calls)."""

    def __init__(self, reasoning: ThinkParser | None, calls: BlockCalls | WholeJsonCalls | None):
        self.reasoning, self.calls = reasoning, calls

    def feed(self, text: str) -> Delta:
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        return Delta(reasoning) + (self.calls.feed(content) if self.calls else Delta(content=content))

    def finish(self) -> Delta:
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        if self.calls is None:
            return Delta(reasoning, content)
        return Delta(reasoning) + self.calls.feed(content) + self.calls.finish()

    def parse(self, text: str) -> Delta:
        """The whole output at once (the same result as any chunking of it)."""
        return self.feed(text) + self.finish()


@dataclass(frozen=True)
class Parsers:
    """The server's choice of parsers; None keeps the built-in behaviour."""

    reasoning: str | None = None
    tool_call: str | None = None

    @property
    def format(self) -> type[BlockCalls] | None:
        return TOOL_CALL_PARSERS[self.tool_call] if self.tool_call else None

    def opens_reasoning(self, prompt: str) -> bool:
        """Whether the output starts inside the reasoning block: always for DeepSeek-R1's parser, else when the
        chat template ends the prompt with `<think>`."""
        return self.reasoning is not None and (REASONING_PARSERS[self.reasoning] or prompt.rstrip().endswith(START))

    def markers(self) -> tuple[str, ...]:
        """Strings the detokenizer must keep even where the tokenizer marks them special."""
        fmt = self.format
        think = ("<think>", "</think>") if self.reasoning else ()
        return think + (fmt.MARKERS if fmt else ())

    def for_request(self, mode: str, tools: dict[str, dict], opens: bool) -> OutputParser | None:
        """The parser of one request's output (None: the text is all content). `mode` is the tool mode; `opens`:
        the output starts inside the reasoning block."""
        calls = None
        if mode in ("required", "named") and self.format is None:
            calls = WholeJsonCalls(tools)  # the built-in forced call is bare JSON
        elif mode != "none":
            calls = (self.format or HermesCalls)(tools)
        reasoning = None
        if self.reasoning:
            stops = (calls.OPEN,) if isinstance(calls, BlockCalls) else ()
            reasoning = ThinkParser(opens, stops)
        return OutputParser(reasoning, calls) if reasoning or calls else None
